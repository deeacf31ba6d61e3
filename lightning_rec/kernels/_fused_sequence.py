"""The fused kernel for sequence lookups: one row per id, no pooling, the optimizer inside backward."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from lightning_rec.fused_kinds import FusedOptimizerSpec
from lightning_rec.kernels._fused_tbe import FusedPooledKernel


class FusedSequenceKernel(FusedPooledKernel):
    """Lookup of one row per id over several tables of one dim, whose optimizer runs inside backward.

    :class:`FusedPooledKernel` with ``pooling="none"`` (fbgemm's ``PoolingMode.NONE``; on CPU the Adam family's
    torch stand-in): the kernel of ``EmbeddingCollection`` (sequence, two-tower) tables. :meth:`forward`
    takes the pooled kernel's feature-major ``values`` / ``offsets`` (the bags only say which feature, so which
    table, each id reads) and returns ``[len(values), dim]``: each id's row, ids in input order. The update
    after backward is the kind's update from each row's gradient summed over all its occurrences in the batch
    (fbgemm's exact kinds aggregate repeated rows first), exactly as a torch optimizer stepping
    ``F.embedding``'s gradient.

    Everything else is the pooled kernel's: ids checked before the kernel, ``grad_scale``, the second-backward
    guard, :meth:`finish_step`, accumulation mode (kept ``[ids, dim]`` gradients, one update over the union at
    the step), :meth:`drop_kept_rows`, optimizer state, learning rate and :meth:`tables` as ``<table>.weight``.

    Args:
        tables: ``(name, rows, dim, dtype)`` per table, one ``dim`` (a multiple of 4) for all: fbgemm's no-bag
            mode has a single width, so tables of several dims need one kernel each.
        feature_table, optimizer, device, weights: as for :class:`FusedPooledKernel`. ``feature_table`` must be
            non-decreasing: fbgemm's no-bag CPU kernel crashes otherwise (docs/ARCHITECTURE.md F2).
    """

    def __init__(
        self,
        tables: Sequence[tuple[str, int, int, torch.dtype]],
        feature_table: Sequence[int],
        optimizer: FusedOptimizerSpec | Mapping[str, Any],
        device: torch.device | str | None = None,
        weights: Sequence[torch.Tensor | Callable[[torch.Tensor], object]] | None = None,
    ) -> None:
        super().__init__(tables, feature_table, optimizer, device=device, weights=weights, pooling="none")
