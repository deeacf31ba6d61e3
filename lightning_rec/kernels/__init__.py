"""Lookup kernels: fbgemm's table-batched calls, or plain torch ``F.embedding_bag`` / ``F.embedding``.

Every pooled kernel here pools with SUM (the fused one can also return one row per id, for sequence lookups).
MEAN is applied by the caller, once, on the sample's own rank (docs/ARCHITECTURE.md C1); that also keeps us clear
of fbgemm's wrong MEAN + per-sample-weight backward.

- :mod:`._capability`: which kernel runs (``compute_kernel`` ``"auto"`` / ``"fbgemm"`` / ``"torch"``), and
  whether the installed fbgemm build has the ops for the device (asked once; torch fallback or one error)
- :mod:`._guards`: the checks on what a lookup is given (ids and offsets on every path; the fused kernel's
  tables, feature -> table map and backward passes)
- :mod:`._torch`: the torch path (the reference)
- :mod:`._dense_tbe`: fbgemm's dense table-batched lookup over plain parameters
- :mod:`._grouped`: one pooled lookup over tables served by different kernels (a sharded rank's shards)
- :mod:`._fused_tbe`: fbgemm's split table-batched lookup with the optimizer in backward;
  :mod:`._fused_sequence`: the same without pooling (one row per id)
- :mod:`._accumulate`: its accumulation mode (backward keeps the gradients; the step applies one update)
- :mod:`._tables`: the tables as objects: the module behind a fused kernel (fbgemm's, or on CPU for the Adam
  family, which has no fbgemm CPU kernel, :mod:`._torch_adam`'s torch stand-in applying fbgemm's CUDA update),
  the containers registering tables under their own names, the dtype several tables' outputs share
- the process memory policy under the kernels: :mod:`lightning_rec.memory`
"""

from lightning_rec.kernels._capability import (
    DENSE_LOOKUP_OP,
    FUSED_OPS,
    KERNELS,
    check_fused_available,
    fused_width_problem,
    has_fbgemm_op,
    load_fbgemm,
    resolve_kernel,
    resolve_table_kernel,
    validate_kernel,
)
from lightning_rec.kernels._dense_tbe import FbgemmPooledKernel
from lightning_rec.kernels._fused_sequence import FusedSequenceKernel
from lightning_rec.kernels._fused_tbe import FusedPooledKernel
from lightning_rec.kernels._grouped import LOOKUP_KERNELS, GroupedPooledLookup
from lightning_rec.kernels._guards import check_ids, check_offsets, validate_ids
from lightning_rec.kernels._tables import FusedTables, TableContainer, promoted_dtype
from lightning_rec.kernels._torch import mean_divisor, torch_pooled, torch_sequence
from lightning_rec.kernels._torch_adam import TorchAdamTBE
from lightning_rec.memory import keep_freed_memory

__all__ = [
    "DENSE_LOOKUP_OP",
    "FUSED_OPS",
    "KERNELS",
    "LOOKUP_KERNELS",
    "FbgemmPooledKernel",
    "FusedPooledKernel",
    "FusedSequenceKernel",
    "FusedTables",
    "GroupedPooledLookup",
    "TableContainer",
    "TorchAdamTBE",
    "check_fused_available",
    "check_ids",
    "check_offsets",
    "fused_width_problem",
    "has_fbgemm_op",
    "keep_freed_memory",
    "load_fbgemm",
    "mean_divisor",
    "promoted_dtype",
    "resolve_kernel",
    "resolve_table_kernel",
    "torch_pooled",
    "torch_sequence",
    "validate_ids",
    "validate_kernel",
]
