"""A pooled lookup over tables that each run their own resolved kernel (``"torch"`` or ``"fbgemm"``).

A sharded collection's plan picks a ``compute_kernel`` per table, so one rank may hold shards served by
fbgemm's dense table-batched kernel next to shards served by ``F.embedding_bag``. :class:`GroupedPooledLookup`
splits the feature-major input by group (one group for the torch tables, one fbgemm call per table dtype),
runs each group's kernel once and puts the output columns back in feature order. With one group (the usual
case) the input goes to that kernel untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_rec.kernels._dense_tbe import FbgemmPooledKernel
from lightning_rec.kernels._torch import torch_pooled

#: the kernel names a table may resolve to here
LOOKUP_KERNELS = ("torch", "fbgemm")


class _Group:
    __slots__ = ("features", "kernel", "local_ft", "tables")

    def __init__(self, tables: list[int], features: list[int], local_ft: list[int], kernel: FbgemmPooledKernel | None):
        self.tables = tables  # indexes into the lookup's tables
        self.features = features  # indexes into the lookup's features, ascending
        self.local_ft = local_ft  # the table (index into ``tables``) of each feature of the group
        self.kernel = kernel  # None: the torch kernel


class GroupedPooledLookup:
    """SUM-pooled ``[batch, sum of feature widths]`` over tables served by different kernels.

    Args:
        table_kernels: ``"torch"`` or ``"fbgemm"`` per table.
        table_dtypes: each table's dtype (fbgemm tables of different dtypes get one kernel call each).
        feature_table: the table of each feature, in input order.
        feature_dims: the width of each feature's table.

    Not a Module: it holds no parameters (the caller passes its tables each call), only fbgemm's flat
    buffer, which is derived from the tables (see :class:`FbgemmPooledKernel`).
    """

    def __init__(
        self,
        table_kernels: Sequence[str],
        table_dtypes: Sequence[torch.dtype],
        feature_table: Sequence[int],
        feature_dims: Sequence[int],
    ) -> None:
        bad = [k for k in table_kernels if k not in LOOKUP_KERNELS]
        if bad:
            raise ValueError(f"lookup kernels must be one of {LOOKUP_KERNELS}, got {bad[0]!r}")
        self.table_kernels = list(table_kernels)
        self.feature_table = list(feature_table)
        self.feature_dims = list(feature_dims)
        by_key: dict[str | tuple[str, torch.dtype], list[int]] = {}
        for f, t in enumerate(self.feature_table):
            key = "torch" if table_kernels[t] == "torch" else ("fbgemm", table_dtypes[t])
            by_key.setdefault(key, []).append(f)
        self._groups: list[_Group] = []
        for key, feats in by_key.items():
            tables = sorted({self.feature_table[f] for f in feats})
            pos = {t: i for i, t in enumerate(tables)}
            local_ft = [pos[self.feature_table[f]] for f in feats]
            kernel = None if key == "torch" else FbgemmPooledKernel(local_ft)
            self._groups.append(_Group(tables, feats, local_ft, kernel))
        order = [f for g in self._groups for f in g.features]
        starts = [0]
        for d in self.feature_dims:
            starts.append(starts[-1] + d)
        cat_cols = [c for f in order for c in range(starts[f], starts[f + 1])]
        # output column j of the concatenated group outputs holds the input order's column cat_cols[j]
        inverse = [0] * len(cat_cols)
        for j, c in enumerate(cat_cols):
            inverse[c] = j
        self._inverse = None if inverse == list(range(len(inverse))) else inverse
        self._inverse_t: torch.Tensor | None = None

    @property
    def uses_fbgemm(self) -> bool:
        """Whether any feature goes through fbgemm's kernel."""
        return any(g.kernel is not None for g in self._groups)

    def __call__(
        self,
        tables: Sequence[torch.Tensor],
        values: torch.Tensor,
        offsets: torch.Tensor,
        batch_size: int,
        per_sample_weights: torch.Tensor | None,
        sparse_grad: bool,
        storage: Sequence[torch.Tensor] | None = None,
        bounds: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Like :func:`torch_pooled` (``bounds`` too); ``storage``: the leaf parameters behind ``tables`` (which may
        be views made for autograd) that fbgemm packs into its flat buffer (default: ``tables``)."""
        b = batch_size
        storage = list(tables) if storage is None else list(storage)
        if not self.uses_fbgemm or b == 0 or torch.compiler.is_compiling():
            # an empty batch keeps the [0, D] output in the autograd graph through F.embedding_bag; under
            # torch.compile ids go unchecked (checks would break the graph) and fbgemm's op is opaque, while
            # F.embedding_bag traces and checks its ids itself
            return torch_pooled(tables, self.feature_table, values, offsets, b, per_sample_weights, sparse_grad, bounds)
        if len(self._groups) == 1:
            return self._run(
                self._groups[0], tables, storage, values, offsets, b, per_sample_weights, sparse_grad, bounds
            )
        if bounds is None:
            bounds = offsets[::b].tolist()
        lengths = offsets.diff()
        outs = []
        for g in self._groups:
            v = torch.cat([values[bounds[f] : bounds[f + 1]] for f in g.features])
            lens = torch.cat([lengths[f * b : (f + 1) * b] for f in g.features])
            o = torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0)])
            w = None
            if per_sample_weights is not None:
                w = torch.cat([per_sample_weights[bounds[f] : bounds[f + 1]] for f in g.features])
            outs.append(self._run(g, tables, storage, v, o, b, w, sparse_grad, None))
        dtype = outs[0].dtype
        for o in outs[1:]:
            dtype = torch.promote_types(dtype, o.dtype)
        out = torch.cat([o.to(dtype) for o in outs], dim=1)
        if self._inverse is None:
            return out
        if self._inverse_t is None or self._inverse_t.device != out.device:
            self._inverse_t = torch.tensor(self._inverse, dtype=torch.long, device=out.device)
        return out.index_select(1, self._inverse_t)

    @staticmethod
    def _run(
        g: _Group,
        tables: Sequence[torch.Tensor],
        storage: Sequence[torch.Tensor],
        values: torch.Tensor,
        offsets: torch.Tensor,
        b: int,
        psw: torch.Tensor | None,
        sparse_grad: bool,
        bounds: Sequence[int] | None,
    ) -> torch.Tensor:
        mine = [tables[t] for t in g.tables]
        if g.kernel is None:
            return torch_pooled(mine, g.local_ft, values, offsets, b, psw, sparse_grad, bounds)
        return g.kernel(mine, values, offsets, psw, storage=[storage[t] for t in g.tables])
