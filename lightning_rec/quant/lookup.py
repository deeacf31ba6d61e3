"""Lookups over stored rows (:mod:`lightning_rec.quant.rows`): fbgemm's inference kernel, or torch.

``IntNBitTableBatchedEmbeddingBagsCodegen`` reads every table from one flat byte buffer. The collection's
``weight`` buffers (one per table, what ``state_dict`` holds) are views of it, so ``load_state_dict`` writes
through. The buffers are the truth: whenever one no longer is the kernel's view (``.to()``, ``load_state_dict(
assign=True)``, a copy), the kernel is rebuilt from them before the lookup, so it can never read stale rows.

fbgemm on CPU (docs/ARCHITECTURE.md F16): SUM over mixed widths and types, with or without per-sample weights,
is exact against the dequantized rows; ``PoolingMode.NONE`` is exact too (it drops per-sample weights, which
sequence lookups never pass) but takes one width per kernel, so a sequence collection holds one kernel per
width. MEAN is applied by the collection, as everywhere in the library.
The torch path (``kernel="torch"``, a device the installed fbgemm build has no kernel for, or ``torch.compile``)
dequantizes the looked-up rows and pools them with ``F.embedding_bag``.
On CPU, ``kernel="auto"`` takes the row-wise kernels over the stored rows in place (:mod:`lightning_rec.quant.rowwise`),
10-50x faster than fbgemm's inference kernel there; the collection's rows are then views of one buffer of its own.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from lightning_rec import kernels
from lightning_rec.configs import DataType
from lightning_rec.kernels._capability import missing_ops_reason
from lightning_rec.quant import rowwise
from lightning_rec.quant.rows import dequantize_rows, kernel_alignment, relayout, row_bytes

#: the op behind fbgemm's inference lookup
INT_NBIT_OP = "fbgemm::int_nbit_split_embedding_codegen_lookup_function"
_warned: set[str] = set()


class TableSpec(NamedTuple):
    """One stored table: its name, rows, width and storage type."""

    name: str
    rows: int
    dim: int
    data_type: DataType


@functools.cache
def _fbgemm() -> tuple[ModuleType, Any, Any, Any, Any]:
    # fbgemm takes seconds to import: on first use only
    import fbgemm_gpu.split_table_batched_embeddings_ops_inference as inference  # noqa: PLC0415
    from fbgemm_gpu.split_embedding_configs import SparseType  # noqa: PLC0415
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (  # noqa: PLC0415
        BoundsCheckMode,
        EmbeddingLocation,
        PoolingMode,
    )

    return inference, SparseType, EmbeddingLocation, PoolingMode, BoundsCheckMode


def resolve(kernel: str, device: torch.device) -> str:
    """``"fbgemm"``, ``"rowwise"`` or ``"torch"`` for ``kernel`` (``"auto"``, ``"fbgemm"``, ``"torch"``) on
    ``device``: ``"auto"`` is the row-wise kernels on CPU (where this torch build has them), else fbgemm's."""
    kernels.validate_kernel(kernel)
    if kernel == "torch":
        return "torch"
    if kernel == "auto" and device.type == "cpu" and rowwise.missing_reason() is None:
        return "rowwise"
    missing = missing_ops_reason([INT_NBIT_OP], device)
    if missing is None:
        return "fbgemm"
    if kernel == "fbgemm":
        raise RuntimeError(f"kernel='fbgemm' cannot look up quantized tables on {device}: {missing}")
    if device.type not in _warned:
        _warned.add(device.type)
        warnings.warn(
            f"quantized tables on {device}: dequantizing in torch because {missing}", RuntimeWarning, stacklevel=4
        )
    return "torch"


class _Kernel:
    """One fbgemm inference kernel over some tables; ``views`` are their rows in its flat buffer."""

    def __init__(
        self,
        specs: Sequence[TableSpec],
        feature_table: Sequence[int],
        pooled: bool,
        output_dtype: torch.dtype,
        row_alignment: int | None,
        device: torch.device,
    ) -> None:
        inference, sparse_type, location, pooling, bounds = _fbgemm()
        where = location.HOST if device.type == "cpu" else location.DEVICE
        out = {torch.float32: sparse_type.FP32, torch.float16: sparse_type.FP16, torch.bfloat16: sparse_type.BF16}
        self.module = inference.IntNBitTableBatchedEmbeddingBagsCodegen(
            [(s.name, s.rows, s.dim, sparse_type[s.data_type.name], where) for s in specs],
            feature_table_map=list(feature_table),
            pooling_mode=pooling.SUM if pooled else pooling.NONE,
            device=device,
            # ids are checked before every eager lookup, naming feature and table (fbgemm lets -1 through)
            bounds_check_mode=bounds.NONE,
            output_dtype=out[output_dtype],
            row_alignment=kernel_alignment(row_alignment, device),
        )
        self.module.initialize_weights()
        self.views: list[torch.Tensor] = [w for w, _ in self.module.split_embedding_weights(split_scale_shifts=False)]

    def __call__(self, values: torch.Tensor, offsets: torch.Tensor, psw: torch.Tensor | None) -> torch.Tensor:
        return self.module(values, offsets, None if psw is None else psw.float())


class QuantLookup:
    """Pooled (SUM) or sequence lookups of a collection's features over its stored tables.

    ``feature_table[f]``: the table feature ``f`` reads (non-decreasing, as a collection's config order gives).
    """

    def __init__(
        self,
        specs: Sequence[TableSpec],
        feature_table: Sequence[int],
        pooled: bool,
        output_dtype: torch.dtype,
        row_alignment: int | None,
        kernel: str,
    ) -> None:
        self.specs = list(specs)
        self.feature_table = list(feature_table)
        self.pooled = pooled
        self.output_dtype = output_dtype
        self.row_alignment = row_alignment
        self.kernel = kernels.validate_kernel(kernel)
        # fbgemm's NONE pooling needs one width per kernel: a sequence collection groups its tables by width
        widths = [None] if pooled else sorted({s.dim for s in self.specs})
        self._groups = [[i for i, s in enumerate(self.specs) if pooled or s.dim == d] for d in widths if self.specs]
        self._kernels: list[_Kernel] = []
        self._plan: rowwise.Plan | None = None

    def allocate(self, device: torch.device | str | None) -> list[torch.Tensor]:
        """Zeroed row buffers, one per table: the fbgemm kernel's own storage where it serves ``device`` (rows of
        its alignment), else views of one buffer (the row-wise path looks up every INT8 table in one call over
        it), rows of the collection's layout."""
        device = torch.device(device or "cpu")
        path = resolve(self.kernel, device) if self.specs and device.type != "meta" else "torch"
        if path == "fbgemm":
            return self._build(device)
        sizes = [s.rows * row_bytes(s.dim, s.data_type, self.row_alignment) for s in self.specs]
        flat = torch.zeros(sum(sizes), dtype=torch.uint8, device=device)
        return [
            v.view(s.rows, -1) if s.rows else v.view(0, row_bytes(s.dim, s.data_type, self.row_alignment))
            for s, v in zip(self.specs, flat.split(sizes))
        ]

    def path(self, weights: Sequence[torch.Tensor]) -> str:
        """The lookup that serves ``weights`` now: ``"fbgemm"``, ``"rowwise"`` or ``"torch"``."""
        if torch.compiler.is_compiling() or not weights:
            return "torch"
        return resolve(self.kernel, weights[0].device)

    def use_torch(self) -> None:
        """Dequantize in torch from now on (``kernel="torch"``), dropping the fbgemm kernels."""
        self.kernel = "torch"
        self._kernels = []
        self._plan = None

    def _build(self, device: torch.device) -> list[torch.Tensor]:
        self._kernels = []
        views: list[torch.Tensor] = [torch.empty(0)] * len(self.specs)
        for group in self._groups:
            local = {t: i for i, t in enumerate(group)}
            ftm = [local[t] for t in self.feature_table if t in local]
            k = _Kernel([self.specs[t] for t in group], ftm, self.pooled, self.output_dtype, self.row_alignment, device)
            self._kernels.append(k)
            for t, v in zip(group, k.views):
                views[t] = v
        return views

    def bind(self, weights: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """Make the fbgemm kernels (or the row-wise plan) read ``weights``; new buffers to register when the fbgemm
        kernels had to be rebuilt."""
        if not self.specs:
            return None
        path = self.path(weights)
        if path == "rowwise":
            s = self.specs
            self._plan = rowwise.build(
                [t.name for t in s],
                [t.dim for t in s],
                [t.data_type for t in s],
                self.feature_table,
                weights,
                self._plan,
            )
            return None
        if path == "torch":
            return None
        if self._kernels and all(
            weights[t].data_ptr() == v.data_ptr() and weights[t].shape == v.shape
            for group, k in zip(self._groups, self._kernels)
            for t, v in zip(group, k.views)
        ):
            return None
        fresh = self._build(weights[0].device)
        with torch.no_grad():
            for spec, w, f in zip(self.specs, weights, fresh):
                if f.shape == w.shape:
                    f.copy_(w)
                else:  # rows of another layout (compact rows moved to CUDA, where fbgemm needs 16-byte rows)
                    relayout(w, f, spec.dim, spec.data_type, spec.name)
        return fresh

    def _use_torch(self, weights: Sequence[torch.Tensor]) -> bool:
        return self.path(weights) != "fbgemm"

    def _rowwise_plan(self, weights: Sequence[torch.Tensor]) -> rowwise.Plan | None:
        if self.path(weights) != "rowwise":
            return None
        s = self.specs
        self._plan = rowwise.build(
            [t.name for t in s], [t.dim for t in s], [t.data_type for t in s], self.feature_table, weights, self._plan
        )
        return self._plan

    def pooled_sum(
        self,
        weights: Sequence[torch.Tensor],
        values: torch.Tensor,
        offsets: torch.Tensor,
        psw: torch.Tensor | None,
        batch: int,
        bounds: Sequence[int],
    ) -> torch.Tensor:
        """SUM-pooled ``[batch, sum of feature widths]`` in the output dtype (feature-major ``values``/``offsets``;
        ``bounds``: where each feature's ids start, and the end)."""
        if self._kernels and not self._use_torch(weights) and batch > 0:
            return self._kernels[0](values, offsets, psw)
        plan = self._rowwise_plan(weights)
        if plan is not None and batch > 0:
            return rowwise.pooled_sum(plan, self.feature_table, values, offsets, psw, batch, bounds).to(
                self.output_dtype
            )
        outs = []
        for f, t in enumerate(self.feature_table):
            s, (lo, hi) = self.specs[t], (bounds[f], bounds[f + 1])
            rows = dequantize_rows(weights[t][values[lo:hi]], s.data_type, s.dim)
            outs.append(
                F.embedding_bag(
                    torch.arange(hi - lo, device=values.device),
                    rows,
                    offsets[f * batch : (f + 1) * batch + 1] - lo,
                    mode="sum",
                    include_last_offset=True,
                    per_sample_weights=None if psw is None else psw[lo:hi].float(),
                )
            )
        dims = sum(self.specs[t].dim for t in self.feature_table)
        if not outs:
            return torch.zeros(batch, dims, dtype=self.output_dtype, device=values.device)
        return torch.cat(outs, 1).to(self.output_dtype)

    def sequence(
        self, weights: Sequence[torch.Tensor], values: torch.Tensor, bounds: Sequence[int]
    ) -> list[torch.Tensor]:
        """One ``[ids of feature, width]`` tensor per feature, in the output dtype."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(self.feature_table)
        if self._kernels and not self._use_torch(weights):
            for group, k in zip(self._groups, self._kernels):
                held = set(group)
                feats = [f for f, t in enumerate(self.feature_table) if t in held]
                lens = [bounds[f + 1] - bounds[f] for f in feats]
                ids = (
                    values
                    if len(feats) == len(self.feature_table)
                    else torch.cat([values[bounds[f] : bounds[f + 1]] for f in feats])
                )
                # one "bag" per feature: NONE pooling returns every id's row in order
                offsets = torch.tensor([0, *lens], dtype=torch.long, device=values.device).cumsum(0)
                for f, rows in zip(feats, k(ids, offsets, None).split(lens)):
                    out[f] = rows
            return out
        plan = self._rowwise_plan(weights)
        if plan is not None:
            return [e.to(self.output_dtype) for e in rowwise.sequence(plan, self.feature_table, values, bounds)]
        for f, t in enumerate(self.feature_table):
            s = self.specs[t]
            ids = values[bounds[f] : bounds[f + 1]]
            out[f] = dequantize_rows(weights[t][ids], s.data_type, s.dim).to(self.output_dtype)
        return out
