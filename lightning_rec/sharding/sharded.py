"""Sharded embedding collections: one input dist -> lookup -> output dist pipeline for every sharding type.

Every model-parallel sharding type (table-wise, row-wise, column-wise, table-row-wise, grid) is a tiling
of the table into rectangular shards (``layout.ShardMeta``), each owned by one rank of the shard group.
The pipeline only ever sees shards, so the types differ in their layout, not in their code:

* **input dist** -- for every (feature, shard) pair (a *route*), each rank keeps the ids that fall in
  the shard's row block, makes them local to the block and sends them, with their bag lengths, to the
  shard's owner (all-to-all; sizes and batch sizes travel first).
* **lookup** -- the owner pools each received bag over its local rows and columns with SUM.
* **output dist** -- pooled partial rows go back to the rank that owns the sample (all-to-all, the
  reverse of the input dist) and are summed into place: row blocks add up (the reduce-scatter of
  row-wise sharding, done as all-to-all + local sum so gloo can run it), column blocks sit side by side.
  MEAN pooling then divides by the full bag length, once, on the sample's rank (rule 1).

Forward comm: all-gather of batch sizes, all-to-all of id counts, lengths, ids (and weights), all-to-all
of pooled rows. Backward comm: the reverse all-to-all of the pooled gradient; ids get none.
Gradient scale (rule 2): each shard receives the sum of every rank's gradient; ``embedding_grad="mean"``
multiplies it by ``1 / data-parallel ranks`` in ``comm.embedding_grad``, the one place a scale is applied.

Data-parallel tables skip the dists: every rank looks up its own replica and, in backward, the rows
some rank touched are summed across ranks (only those rows move) and scaled the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lightning_rec import _compat, kernels
from lightning_rec.configs import BaseEmbeddingConfig
from lightning_rec.modules import (
    EmbeddingBagCollection,
    EmbeddingCollection,
    _FeatureLayout,
    _Table,
    _TableContainer,
)
from lightning_rec.sharding import comm
from lightning_rec.sharding.layout import ShardMeta, offsets_of
from lightning_rec.sharding.plan import ShardingPlan, default_local_size, resolve_module_plan
from lightning_rec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor, _segment_gather_index


def _broadcast_from_first(w: torch.Tensor, group: dist.ProcessGroup) -> None:
    if dist.get_world_size(group) == 1:
        return
    with torch.no_grad():
        wire = w.float() if w.dtype == torch.bfloat16 else w
        dist.broadcast(wire, src=dist.get_process_group_ranks(group)[0], group=group)
        if wire is not w:
            w.copy_(wire)


@dataclass(frozen=True)
class _Route:
    feature: int
    table: int
    shard: ShardMeta


def _complete_cumsum(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.numel() + 1, dtype=torch.long, device=x.device)
    torch.cumsum(x, 0, out=out[1:])
    return out


def _regroup(x: torch.Tensor, seg_sizes: list[int], n_outer: int, n_inner: int) -> torch.Tensor:
    """Reorder contiguous segments laid out ``[outer][inner]`` into ``[inner][outer]`` order."""
    sizes = torch.tensor(seg_sizes, dtype=torch.long, device=x.device)
    starts = _complete_cumsum(sizes)[:-1]
    perm = torch.arange(n_outer * n_inner, device=x.device).view(n_outer, n_inner).t().reshape(-1)
    return x[_segment_gather_index(starts[perm], sizes[perm])]


class ShardedCollection(nn.Module):
    """Shared machinery of the sharded pooled and sequence collections.

    Other modules read a sharded collection only through the read-only accessors below and
    ``sharded_collections(model)``; everything underscored is this module's own.
    """

    _attr = ""

    def __init__(
        self,
        module: nn.Module,
        shards: dict[str, list[ShardMeta] | None],
        shard_group: dist.ProcessGroup,
        *,
        embedding_grad: str = "sum",
        replica_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        sparse_grad: bool | None = None,
        embedding_optimizer=None,
    ) -> None:
        super().__init__()
        from lightning_rec.optim import as_spec

        fused = as_spec(embedding_optimizer)
        if replica_group is not None and dist.get_world_size(replica_group) == 1:
            replica_group = None
        tables: list[BaseEmbeddingConfig] = list(module._layout.tables)
        self._layout = _FeatureLayout(tables)
        self._shards = shards
        self._group = shard_group
        self._replica_group = replica_group
        self._group_size = dist.get_world_size(shard_group)
        self._group_rank = dist.get_rank(shard_group)
        self._global_ranks = dist.get_process_group_ranks(shard_group)
        replicas = 1 if replica_group is None else dist.get_world_size(replica_group)
        self._num_dp_ranks = self._group_size * replicas
        # replicated tables live on every data-parallel rank: the shard group, times the replicas under 2D
        self._dp_group = shard_group if replica_group is None else dist.group.WORLD
        self.embedding_grad = embedding_grad
        self._scale = comm.grad_scale(embedding_grad, self._num_dp_ranks)
        self.sparse_grad = module.sparse_grad if sparse_grad is None else sparse_grad
        self._table_dtypes = [t.dtype for t in tables]
        self._keep_table_dtypes = False
        self._output_dtype: torch.dtype | None = None

        me = self._group_rank
        source = getattr(module, self._attr)
        container = _TableContainer()
        self._dp_tables = [i for i, t in enumerate(tables) if shards[t.name] is None]
        if fused is not None:  # before any shard is allocated
            self._check_fused(tables, shards)
        self._local_shards: list[tuple[int, ShardMeta]] = []  # (table index, shard) held here, table order
        for i, t in enumerate(tables):
            full = source[t.name].weight.detach()
            if shards[t.name] is None:
                w = full.to(device) if device is not None and not full.is_meta else full
                if w.is_meta:
                    w = torch.empty(full.shape, dtype=full.dtype, device=device)
                    t.init_weight(w)
                # replicas must start equal, as DDP makes dense replicas equal
                _broadcast_from_first(w, self._dp_group)
                container.add(t.name, _Table(w))
                continue
            mine = [s for s in shards[t.name] if s.rank == me]
            if not mine:
                continue
            (s,) = mine
            if full.is_meta:
                piece = torch.empty(s.rows, s.cols, dtype=full.dtype, device=device)
                t.init_weight(piece)
            else:
                piece = full[s.row_offset : s.row_offset + s.rows, s.col_offset : s.col_offset + s.cols]
                piece = piece.to(device).clone().contiguous() if device is not None else piece.clone().contiguous()
            if replica_group is not None:
                _broadcast_from_first(piece, replica_group)
            container.add(t.name, _Table(piece))
            self._local_shards.append((i, s))
        self._fused: kernels.FusedPooledKernel | None = None  # this rank's shards
        self._dp_fused: kernels.FusedPooledKernel | None = None  # the data-parallel tables
        if fused is not None:
            # a zero-row shard receives no ids; the fused kernel holds only shards with rows
            self._local_shards = [(ti, s) for ti, s in self._local_shards if s.rows > 0]
        setattr(self, self._attr, container)

        self._build_routes()
        if fused is not None:
            self._build_fused_kernels(container, fused)
        self._register_state_dict_hook(_sharded_state_dict_hook)
        self._register_load_state_dict_pre_hook(self._load_hook)

    # -- read-only accessors for the rest of the library --------------------------------------------
    @property
    def tables(self) -> list[BaseEmbeddingConfig]:
        """The table configs, in config order."""
        return list(self._layout.tables)

    @property
    def shards(self) -> dict[str, list[ShardMeta] | None]:
        """``{table: every shard of it (all ranks)}``; ``None`` for a data-parallel table."""
        return dict(self._shards)

    @property
    def local_shards(self) -> list[tuple[int, ShardMeta]]:
        """``(table index, shard)`` for the shards this rank holds, in table order."""
        return list(self._local_shards)

    @property
    def shard_group(self) -> dist.ProcessGroup:
        return self._group

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        return self._replica_group

    @property
    def shard_group_ranks(self) -> list[int]:
        """Global rank of every shard-group rank (``ShardMeta.rank`` indexes this list)."""
        return list(self._global_ranks)

    @property
    def table_dtypes(self) -> list[torch.dtype]:
        return list(self._table_dtypes)

    @property
    def table_attr(self) -> str:
        """The attribute holding the tables (``embedding_bags`` or ``embeddings``), as in state_dict keys."""
        return self._attr

    @property
    def is_fused(self) -> bool:
        """Whether any table here (sharded or data-parallel) updates inside backward."""
        return bool(self.fused_kernels())

    def _load_hook(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        _load_hook_impl(self, state_dict, prefix)

    # -- static routing -----------------------------------------------------------------------------
    def _build_routes(self) -> None:
        layout, tables = self._layout, self._layout.tables
        routes_to: list[list[_Route]] = [[] for _ in range(self._group_size)]
        self._row_starts: dict[int, list[int]] = {}
        self._block_of: dict[tuple[int, int], int] = {}  # (table, row_offset) -> row block index
        for ti, t in enumerate(tables):
            shards = self._shards[t.name]
            if shards is None:
                continue
            starts = sorted({s.row_offset for s in shards if s.rows > 0})
            self._row_starts[ti] = starts
            for b, start in enumerate(starts):
                self._block_of[(ti, start)] = b
        for f, ti in enumerate(layout.feature_table):
            shards = self._shards[tables[ti].name]
            for s in shards or []:
                if s.rows > 0:
                    routes_to[s.rank].append(_Route(f, ti, s))
        for lst in routes_to:
            lst.sort(key=lambda r: (r.table, r.feature))
        self._routes_to = routes_to
        self._has_mp = any(routes_to)
        feat_off = self._feat_off = offsets_of(layout.dims)
        self._my_routes = routes_to[self._group_rank]
        local_index = {ti: k for k, (ti, _) in enumerate(self._local_shards)}
        self._my_route_table = [local_index[r.table] for r in self._my_routes]
        self._cols_from = [sum(r.shard.cols for r in lst) for lst in routes_to]
        self._dp_features = [f for f, ti in enumerate(layout.feature_table) if ti in set(self._dp_tables)]
        mp_cols = [
            torch.arange(feat_off[r.feature] + r.shard.col_offset, feat_off[r.feature] + r.shard.col_offset + r.shard.cols)
            for lst in routes_to
            for r in lst
        ]
        dp_cols = [torch.arange(feat_off[f], feat_off[f + 1]) for f in self._dp_features]
        self._colmap = torch.cat(dp_cols + mp_cols) if dp_cols or mp_cols else torch.zeros(0, dtype=torch.long)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        if self._keep_table_dtypes:
            # a precision plugin converting the model moves tables but keeps the dtype their config fixed
            convert = fn
            fn = lambda t: t.to(convert(torch.empty(0, dtype=t.dtype, device=t.device)).device)  # noqa: E731
        # Ranks without a local piece of a table still need its dtype for the wire; follow conversions.
        out = super()._apply(fn, recurse)
        self._table_dtypes = [fn(torch.empty(0, dtype=d)).dtype for d in self._table_dtypes]
        self._colmap = self._colmap.to(fn(torch.empty(0)).device)
        return out

    def keep_table_dtypes(self, output_dtype: torch.dtype | None) -> None:
        """Make later dtype conversions of this module leave the tables' configured dtypes alone.

        Lookups then return ``output_dtype`` (the precision the rest of the model computes in); gradients
        flow back into the tables at their own precision. Used by the strategy for ``*-true`` precision.
        """
        self._keep_table_dtypes = True
        self._output_dtype = output_dtype

    def _out_dtype(self) -> torch.dtype:
        return kernels.promoted_dtype(self._table_dtypes)

    # -- forward helpers ----------------------------------------------------------------------------
    def _checked_input(self, features: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor | None, list[int]]:
        """Validate locally, then agree across ranks, so one rank's bad input never leaves others waiting."""
        err: Exception | None = None
        kjt = None
        try:
            kjt = self._layout.select(features)
            self._check_weights(kjt)
        except (ValueError, TypeError) as e:
            err = e
        batch = kjt.stride() if kjt is not None else 0
        if dist.get_world_size(self._dp_group) == 1:
            if err is not None:
                raise err
            return kjt, [batch]
        # agree over every rank this module exchanges with in forward or backward
        status = comm.all_gather_ints([batch, int(err is not None)], self._dp_group)
        by_rank = dict(zip(dist.get_process_group_ranks(self._dp_group), status))
        bad = sorted(r for r, (_, e) in by_rank.items() if e)
        if err is not None:
            raise err
        if bad:
            raise ValueError(f"ranks {bad} rejected their input (see the error raised there); stopping this rank too")
        return kjt, [by_rank[g][0] for g in self._global_ranks]

    def _check_weights(self, kjt: KeyedJaggedTensor) -> None:
        pass

    def _uses_weights(self) -> bool:
        return False

    def _table_param(self, ti: int) -> torch.Tensor:
        return getattr(self, self._attr)._modules[self._layout.tables[ti].name].weight

    def _check_fused(self, tables: list[BaseEmbeddingConfig], shards: dict[str, list[ShardMeta] | None]) -> None:
        """Refuse what fbgemm's fused kernel cannot hold, on every rank alike, before anything is allocated."""
        if self._attr != "embedding_bags":
            raise ValueError("embedding_optimizer (fused) supports pooled EmbeddingBagCollections only")
        kernel_dtypes: dict[object, dict[str, torch.dtype]] = {}  # kernel (a shard rank, or "dp") -> its tables
        for t in tables:
            if t.dtype not in (torch.float32, torch.float16):
                raise ValueError(
                    f"table {t.name!r}: embedding_optimizer (fused) needs float32 or float16 tables, got {t.dtype} "
                    "(fbgemm has no fused CPU kernel for it); use embedding_optimizer=None for this collection"
                )
            pieces = shards[t.name]
            widths = [t.embedding_dim] if pieces is None else [s.cols for s in pieces if s.rows > 0]
            bad = [w for w in widths if w % 4]
            if bad:
                what = "its embedding_dim" if pieces is None else "a column shard of it"
                raise ValueError(
                    f"table {t.name!r}: {what} is {bad[0]} wide; the fused fbgemm kernel needs a multiple of 4 "
                    "(choose other column shards, or use embedding_optimizer=None)"
                )
            for owner in ["dp"] if pieces is None else sorted({s.rank for s in pieces if s.rows > 0}):
                kernel_dtypes.setdefault(owner, {})[t.name] = t.dtype
        for owner, dtypes in kernel_dtypes.items():
            if len(set(dtypes.values())) > 1:
                where = "the data-parallel tables" if owner == "dp" else f"the shards held by shard rank {owner}"
                detail = ", ".join(f"{n!r}: {d}" for n, d in dtypes.items())
                raise ValueError(f"embedding_optimizer (fused): {where} share one kernel, which needs one dtype; got {detail}")

    def _build_fused_kernels(self, container: _TableContainer, spec) -> None:
        """One fused kernel for this rank's shards, one for the data-parallel tables, under the usual keys.

        Exact under replication: each kernel looks up the union of the batches of every rank that holds a
        copy of its tables (the replica group for shards, every data-parallel rank for replicated tables)
        and backward hands it the union's gradient, so every copy applies one identical update with the
        sum of all ranks' contributions (see ``_fused_lookup``).
        """
        tables = self._layout.tables

        def build(names: list[str], feature_table: list[int]) -> kernels.FusedPooledKernel:
            ws = [container[n].weight for n in names]
            return kernels.FusedPooledKernel(
                [(n, w.shape[0], w.shape[1], w.dtype) for n, w in zip(names, ws)], feature_table, spec,
                device=ws[0].device, weights=[w.detach() for w in ws],
            )

        if self._local_shards:
            object.__setattr__(self, "_fused", build([tables[ti].name for ti, _ in self._local_shards],
                                                     self._my_route_table))
        if self._dp_tables:
            pos = {ti: k for k, ti in enumerate(self._dp_tables)}
            ft = [pos[self._layout.feature_table[f]] for f in self._dp_features]
            object.__setattr__(self, "_dp_fused", build([tables[ti].name for ti in self._dp_tables], ft))
        # registered once, under the same keys as plain tables: <attr>.<table>.weight
        setattr(self, self._attr, kernels.FusedTables(self.fused_kernels(), [t.name for t in tables]))

    def fused_kernels(self) -> list[kernels.FusedPooledKernel]:
        """The fused kernels of this rank (shards first, then data-parallel tables); empty without a fused optimizer."""
        return [k for k in (self._fused, self._dp_fused) if k is not None]

    def _fused_lookup(
        self,
        kernel: kernels.FusedPooledKernel,
        lengths: torch.Tensor,
        values: torch.Tensor,
        weights: torch.Tensor | None,
        ids_per_feature: list[int],
        batch: int,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        """SUM-pooled ``[batch, width]`` from feature-major inputs; exact when ``group`` holds copies of the tables.

        A fused kernel updates in backward, so every copy must see the gradient of every rank's samples at
        once: each rank of ``group`` looks up the union batch (all ranks' bags, feature-major, ranks in
        group order), keeps its own rows of the output, and in backward all-gathers the rows' gradients
        into the union's gradient (``comm.own_rows_of_union``). Every copy then applies the same update
        (bitwise: same inputs, same kernel) and holds the same optimizer state. Cost: ``|group|`` x the
        lookup and its backward, plus an all-gather of lengths, ids (and weights) in forward and of the
        pooled gradient in backward. Without autograd (evaluation) only the local batch is looked up.
        ``embedding_grad`` scales the update once, in the kernel.
        """
        if group is None or not torch.is_grad_enabled():
            return kernel(values, _complete_cumsum(lengths), weights, grad_scale=self._scale)
        n = len(ids_per_feature)
        info = comm.all_gather_ints([batch, *ids_per_feature], group)
        batches = [row[0] for row in info]
        id_counts = [row[1:] for row in info]
        lengths = _regroup(comm.gather_union(lengths, [n * b for b in batches], group),
                           [b for b in batches for _ in range(n)], len(batches), n)
        seg = [c for row in id_counts for c in row]
        totals = [sum(row) for row in id_counts]
        values = _regroup(comm.gather_union(values, totals, group), seg, len(batches), n)
        if weights is not None:
            weights = _regroup(comm.gather_union(weights, totals, group), seg, len(batches), n)
        union = kernel(values, _complete_cumsum(lengths), weights, grad_scale=self._scale)
        return comm.own_rows_of_union(union, batches, group)

    def _dp_weights(self, kjt: KeyedJaggedTensor) -> list[torch.Tensor]:
        layout = self._layout
        opk = kjt.offset_per_key()
        ids = [torch.cat([kjt.values()[opk[f] : opk[f + 1]] for f, t in enumerate(layout.feature_table) if t == ti])
               for ti in self._dp_tables]
        return comm.embedding_grad([self._table_param(ti) for ti in self._dp_tables], ids, self._dp_group, self._scale)

    def _dp_subset(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        return kjt.permute(self._dp_features)

    def _input_dist(self, kjt: KeyedJaggedTensor, batches: list[int]):
        """Send every route's ids to the shard owner; return what this rank received, route-major."""
        b = kjt.stride()
        values, lengths, opk = kjt.values(), kjt.lengths(), kjt.offset_per_key()
        weights = kjt.weights_or_none() if self._uses_weights() else None
        per_feature: dict[int, tuple] = {}
        for lst in self._routes_to:
            for r in lst:
                if r.feature in per_feature:
                    continue
                f, ti = r.feature, r.table
                vals = values[opk[f] : opk[f + 1]].long()
                lens = lengths[f * b : (f + 1) * b]
                w = None if weights is None else weights[opk[f] : opk[f + 1]]
                starts = self._row_starts[ti]
                if len(starts) == 1:
                    per_feature[f] = (lens.view(1, b), [vals.numel()], vals - starts[0], w, None)
                    continue
                st = torch.tensor(starts, dtype=torch.long, device=vals.device)
                bucket = torch.searchsorted(st, vals, right=True) - 1
                order = torch.argsort(bucket, stable=True)
                bag = torch.repeat_interleave(torch.arange(b, device=vals.device), lens)
                counts = torch.bincount(bucket * b + bag, minlength=len(starts) * b).view(len(starts), b)
                sorted_vals = vals[order] - st[bucket[order]]
                per_feature[f] = (counts, counts.sum(1).tolist(), sorted_vals, None if w is None else w[order], order)
        send_lengths, send_values, send_weights, positions, value_counts = [], [], [], [], []
        for lst in self._routes_to:
            n = 0
            for r in lst:
                counts, seg, vals, w, order = per_feature[r.feature]
                blk = self._block_of[(r.table, r.shard.row_offset)]
                lo = sum(seg[:blk])
                hi = lo + seg[blk]
                send_lengths.append(counts[blk])
                send_values.append(vals[lo:hi])
                if w is not None:
                    send_weights.append(w[lo:hi])
                positions.append(torch.arange(lo, hi, device=vals.device) if order is None else order[lo:hi])
                n += hi - lo
            value_counts.append(n)
        dev = values.device
        cat = lambda xs, dt: torch.cat(xs) if xs else torch.zeros(0, dtype=dt, device=dev)  # noqa: E731
        send_l, send_v = cat(send_lengths, torch.long), cat(send_values, torch.long)
        group = self._group
        n_mine = len(self._my_routes)
        # sizes before payload: id counts per (source, destination), then lengths, ids, weights
        recv_counts = comm.all_to_all(torch.tensor(value_counts, dtype=torch.long, device=dev), [1] * self._group_size,
                                      [1] * self._group_size, group).tolist()
        len_in = [len(lst) * b for lst in self._routes_to]
        len_out = [n_mine * bs for bs in batches]
        recv_l = comm.all_to_all(send_l, len_out, len_in, group)
        recv_v = comm.all_to_all(send_v, recv_counts, value_counts, group)
        recv_w = None
        if weights is not None:
            recv_w = comm.all_to_all(cat(send_weights, weights.dtype), recv_counts, value_counts, group)
        # received layout is [source][route][bag]; the lookup wants [route][source][bag]
        seg_bags = [bs for bs in batches for _ in range(n_mine)]
        bounds = _complete_cumsum(torch.tensor(seg_bags, dtype=torch.long, device=dev))
        recv_offsets = _complete_cumsum(recv_l)
        seg_vals = (recv_offsets[bounds[1:]] - recv_offsets[bounds[:-1]]).tolist()
        lengths_rm = _regroup(recv_l, seg_bags, self._group_size, n_mine)
        values_rm = _regroup(recv_v, seg_vals, self._group_size, n_mine)
        weights_rm = None if recv_w is None else _regroup(recv_w, seg_vals, self._group_size, n_mine)
        return dict(
            lengths=lengths_rm, values=values_rm, weights=weights_rm, seg_vals=seg_vals,
            positions=positions, send_sizes=[v.numel() for v in send_values],
        )

    def _shard_weights(self, recv: dict) -> list[torch.Tensor]:
        n_mine = len(self._my_routes)
        ids = [torch.zeros(0, dtype=torch.long)] * len(self._local_shards)
        if self._replica_group is not None and self._local_shards:
            per_route = torch.tensor(recv["seg_vals"], dtype=torch.long).view(self._group_size, n_mine).sum(0)
            route_ids = torch.split(recv["values"], per_route.tolist())
            ids = [torch.cat([route_ids[j] for j, t in enumerate(self._my_route_table) if t == k] or [ids[k]])
                   for k in range(len(self._local_shards))]
        weights = [self._table_param(ti) for ti, _ in self._local_shards]
        return comm.embedding_grad(weights, ids, self._replica_group, self._scale)


def _sharded_state_dict_hook(module: ShardedCollection, state_dict, prefix, local_metadata):
    """Replace each sharded table's local piece by a ShardedTensor over the whole table (same key as unsharded)."""
    tables = module._layout.tables
    for i, t in enumerate(tables):
        shards = module._shards[t.name]
        if shards is None:
            continue
        key = f"{prefix}{module._attr}.{t.name}.weight"
        local = state_dict.pop(key, None)
        pieces = [(local, [s.row_offset, s.col_offset]) for j, s in module._local_shards if j == i and local is not None]
        state_dict[key] = _compat.make_sharded_tensor(
            pieces,
            [([s.row_offset, s.col_offset], [s.rows, s.cols], module._global_ranks[s.rank]) for s in shards],
            [t.num_embeddings, t.embedding_dim],
            module._table_dtypes[i],
            "cpu" if local is None else local.device.type,
            module._group,
        )
    return state_dict


def _load_hook_impl(module: ShardedCollection, state_dict, prefix) -> None:
    for i, t in enumerate(module._layout.tables):
        key = f"{prefix}{module._attr}.{t.name}.weight"
        shards = module._shards[t.name]
        if shards is None or key not in state_dict:
            if shards is None and key in state_dict and _compat.is_sharded_tensor(state_dict[key]):
                raise ValueError(
                    f"table {t.name!r} is data-parallel here but the state_dict holds it sharded; "
                    "gather it first with lightning_rec.sharding.full_state_dict"
                )
            continue
        value = state_dict.pop(key)
        mine = [s for j, s in module._local_shards if j == i]
        shape = [t.num_embeddings, t.embedding_dim]
        if _compat.is_sharded_tensor(value):
            if list(value.size()) != shape:
                raise ValueError(f"table {t.name!r}: state_dict holds shape {list(value.size())}, the model {shape}")
            if not mine:
                continue
            (s,) = mine
            found = [sh.tensor for sh in value.local_shards()
                     if list(sh.metadata.shard_offsets) == [s.row_offset, s.col_offset]
                     and list(sh.metadata.shard_sizes) == [s.rows, s.cols]]
            if not found:
                if s.rows == 0:
                    continue
                raise ValueError(
                    f"table {t.name!r}: the state_dict was sharded differently from this model; load it through "
                    "torch.distributed.checkpoint or pass full tensors (full_state_dict)"
                )
            state_dict[key] = found[0]
        else:
            if list(value.shape) != shape:
                raise ValueError(
                    f"table {t.name!r}: state_dict holds shape {list(value.shape)}, the model expects {shape}"
                )
            if mine:
                (s,) = mine
                state_dict[key] = value[s.row_offset : s.row_offset + s.rows, s.col_offset : s.col_offset + s.cols]


class ShardedEmbeddingBagCollection(ShardedCollection):
    """An ``EmbeddingBagCollection`` whose tables are spread over a process group by a plan.

    Same input (each rank its own local KJT; batch sizes may differ) and same output (a local KeyedTensor
    in config order) as the unsharded module. See the module docstring for the comm life cycle.
    """

    _attr = "embedding_bags"

    def __init__(self, module: EmbeddingBagCollection, shards, shard_group, **kw) -> None:
        super().__init__(module, shards, shard_group, **kw)
        self._is_weighted = module.is_weighted()

    def embedding_bag_configs(self):
        return list(self._layout.tables)

    def is_weighted(self) -> bool:
        return self._is_weighted

    def _uses_weights(self) -> bool:
        return self._is_weighted

    def _check_weights(self, kjt: KeyedJaggedTensor) -> None:
        if self._is_weighted and kjt.weights_or_none() is None:
            raise ValueError("this EmbeddingBagCollection is weighted (is_weighted=True) but the input has no weights")

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        layout = self._layout
        kjt, batches = self._checked_input(features)
        b = kjt.stride()
        dtype = self._out_dtype()
        parts = []
        if self._dp_tables:
            sub = self._dp_subset(kjt)
            psw = sub.weights_or_none() if self._is_weighted else None
            if self._dp_fused is not None:
                group = self._dp_group if dist.get_world_size(self._dp_group) > 1 else None
                parts.append(self._fused_lookup(self._dp_fused, sub.lengths(), sub.values(), psw,
                                                sub.length_per_key(), b, group).to(dtype))
            else:
                tables = self._dp_weights(kjt)
                table_pos = {ti: k for k, ti in enumerate(self._dp_tables)}
                ft = [table_pos[layout.feature_table[f]] for f in self._dp_features]
                parts.append(kernels.torch_pooled(tables, ft, sub.values(), sub.offsets(), b, psw,
                                                  self.sparse_grad).to(dtype))
        if self._has_mp:
            recv = self._input_dist(kjt, batches)
            tables = self._shard_weights(recv) if self._fused is None else []
            b_global = sum(batches)
            if self._fused is not None:
                n_mine = len(self._my_routes)
                per_route = torch.tensor(recv["seg_vals"], dtype=torch.long).view(self._group_size, n_mine).sum(0)
                pooled = self._fused_lookup(self._fused, recv["lengths"], recv["values"], recv["weights"],
                                            per_route.tolist(), b_global, self._replica_group).to(dtype)
            elif self._my_routes:
                pooled = kernels.torch_pooled(
                    tables, self._my_route_table, recv["values"], _complete_cumsum(recv["lengths"]), b_global,
                    recv["weights"], self.sparse_grad,
                ).to(dtype)
            else:
                pooled = torch.zeros(b_global, 0, dtype=dtype, device=kjt.device)
            width = self._cols_from[self._group_rank]
            flat = comm.all_to_all(
                pooled.reshape(-1), [b * w for w in self._cols_from], [bs * width for bs in batches], self._group,
                differentiable=torch.is_grad_enabled(),
            )
            blocks = torch.split(flat, [b * w for w in self._cols_from])
            parts.append(torch.cat([blk.view(b, w) for blk, w in zip(blocks, self._cols_from)], dim=1))
        data = torch.cat(parts, dim=1) if parts else torch.zeros(b, 0, dtype=dtype)
        total = self._feat_off[-1]
        out = torch.zeros(b, total, dtype=dtype, device=data.device).index_add(1, self._colmap, data)
        out = layout.apply_mean(out, kjt.lengths(), b)
        if self._output_dtype is not None:
            out = out.to(self._output_dtype)
        return KeyedTensor(layout.feature_names, layout.dims, out)


class ShardedEmbeddingCollection(ShardedCollection):
    """An ``EmbeddingCollection`` spread over a process group; returns ``{feature: JaggedTensor}`` per rank."""

    _attr = "embeddings"

    def embedding_configs(self):
        return list(self._layout.tables)

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        layout = self._layout
        kjt, batches = self._checked_input(features)
        b = kjt.stride()
        lpk = kjt.length_per_key()
        dtypes = [self._table_dtypes[ti] for ti in layout.feature_table]
        pieces: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in layout.feature_names]
        results: dict[int, torch.Tensor] = {}
        if self._dp_tables:
            sub = self._dp_subset(kjt)
            tables = self._dp_weights(kjt)
            table_pos = {ti: k for k, ti in enumerate(self._dp_tables)}
            ft = [table_pos[layout.feature_table[f]] for f in self._dp_features]
            embs = kernels.torch_sequence(tables, ft, sub.values(), sub.length_per_key(), self.sparse_grad)
            results.update(zip(self._dp_features, embs))
        if self._has_mp:
            wire = self._out_dtype()
            recv = self._input_dist(kjt, batches)
            tables = self._shard_weights(recv)
            n_mine, w_size = len(self._my_routes), self._group_size
            seg = torch.tensor(recv["seg_vals"], dtype=torch.long).view(w_size, n_mine)  # [source, route]
            per_route = seg.sum(0).tolist()
            embs = kernels.torch_sequence(tables, self._my_route_table, recv["values"], per_route, self.sparse_grad)
            cols = [r.shard.cols for r in self._my_routes]
            flat = torch.cat([e.to(wire).reshape(-1) for e in embs]) if embs else torch.zeros(0, dtype=wire)
            # route-major [route][source] -> source-major [source][route], in elements
            elems = [int(seg[s, k]) * cols[k] for k in range(n_mine) for s in range(w_size)]
            flat = _regroup(flat, elems, n_mine, w_size)
            send = [sum(int(seg[s, k]) * cols[k] for k in range(n_mine)) for s in range(w_size)]
            recv_sizes = [
                sum(n * r.shard.cols for n, r in zip(recv["send_sizes"][i0 : i0 + len(lst)], lst))
                for i0, lst in zip(offsets_of([len(x) for x in self._routes_to]), self._routes_to)
            ]
            back = comm.all_to_all(flat, recv_sizes, send, self._group, differentiable=torch.is_grad_enabled())
            all_routes = [r for lst in self._routes_to for r in lst]
            chunks = torch.split(back, [n * r.shard.cols for n, r in zip(recv["send_sizes"], all_routes)])
            for r, chunk, pos in zip(all_routes, chunks, recv["positions"]):
                d = layout.dims[r.feature]
                idx = (pos.unsqueeze(1) * d + r.shard.col_offset + torch.arange(r.shard.cols)).reshape(-1)
                pieces[r.feature].append((idx, chunk))
        out = {}
        for f, name in enumerate(layout.feature_names):
            if f in results:
                emb = results[f]
            else:
                d, n = layout.dims[f], lpk[f]
                idx = torch.cat([i for i, _ in pieces[f]]) if pieces[f] else torch.zeros(0, dtype=torch.long)
                src = torch.cat([c for _, c in pieces[f]]) if pieces[f] else torch.zeros(0, dtype=self._out_dtype())
                emb = torch.zeros(n * d, dtype=src.dtype, device=src.device).index_add(0, idx, src).view(n, d)
            out[name] = JaggedTensor(emb.to(self._output_dtype or dtypes[f]), lengths=kjt.lengths()[f * b : (f + 1) * b])
        return out


_ShardedCollection = ShardedCollection  # older name


def sharded_collections(model: nn.Module) -> Iterator[tuple[str, ShardedCollection]]:
    """``(module path, sharded collection)`` for every sharded collection in ``model``, in module order."""
    for path, m in model.named_modules():
        if isinstance(m, ShardedCollection):
            yield path, m


_SHARDED = {EmbeddingBagCollection: ShardedEmbeddingBagCollection, EmbeddingCollection: ShardedEmbeddingCollection}


def shard_modules(
    model: nn.Module,
    plan: ShardingPlan | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    replica_group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    embedding_grad: str = "sum",
    local_size: int | None = None,
    embedding_optimizer=None,
) -> nn.Module:
    """Replace every EmbeddingBagCollection / EmbeddingCollection in ``model`` by its sharded counterpart.

    Collective: every rank of the world calls it with the same model structure and plan.
    ``process_group`` is the model-parallel (shard) group the plan's ranks refer to (default: a new
    group over the whole world). Under 2D parallelism (see ``mesh.init_2d_mesh``) pass the shard group
    and the ``replica_group``: every replica group then holds one full sharded copy of the tables, shard
    gradients are summed across replicas, and data-parallel tables across the whole world, all under
    the one ``embedding_grad`` rule. Plans are validated for every collection before any shard is
    allocated. Returns ``model`` (or the sharded collection when ``model`` itself is one).

    ``embedding_optimizer`` (a ``FusedOptimizerSpec`` or a dict such as ``{"kind": "rowwise_adagrad",
    "lr": 0.05}``) makes every sharded table update inside backward with fbgemm's kernel; step it with
    ``fused_optimizer(model)``. Without it, tables are ordinary parameters for any torch optimizer.
    """
    from lightning_rec.sharding.planner import automatic_plan

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "shard_modules needs torch.distributed: call torch.distributed.init_process_group first "
            "(one process with world_size=1 is fine)"
        )
    comm.grad_scale(embedding_grad, 1)
    group = process_group if process_group is not None else dist.new_group()
    gsize = dist.get_world_size(group)
    local = local_size if local_size is not None else default_local_size(gsize)
    targets = [(p, m) for p, m in model.named_modules() if type(m) in _SHARDED]
    if plan is not None:
        # collections sharded by an earlier call (e.g. fit, then validate) keep their placement
        paths = {p for p, m in model.named_modules() if type(m) in _SHARDED or isinstance(m, ShardedCollection)}
        unknown = [p for p in plan.plan if p not in paths]
        if unknown:
            raise ValueError(f"the plan names modules {unknown} that are not embedding collections of the model; "
                             f"collections found: {sorted(paths)}")
    resolved, auto = [], None
    for path, m in targets:
        tables = list(m._layout.tables)
        module_plan = plan.get_plan_for_module(path) if plan is not None else None
        if module_plan is None:  # one plan for all unplanned collections: they share every rank's memory and time
            if auto is None:
                world = gsize * (1 if replica_group is None else dist.get_world_size(replica_group))
                auto = automatic_plan(model, gsize, local, world, embedding_optimizer).plan(model)
            module_plan = auto.get_plan_for_module(path)
        resolved.append((path, m, resolve_module_plan(tables, module_plan, gsize, local, path)))
    for path, m, shards in resolved:
        sharded = _SHARDED[type(m)](m, shards, group, embedding_grad=embedding_grad, device=device,
                                    replica_group=replica_group, embedding_optimizer=embedding_optimizer)
        if path == "":
            return sharded
        parent_path, _, name = path.rpartition(".")
        model.get_submodule(parent_path)._modules[name] = sharded
    return model


def full_state_dict(model: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded state_dict of ``model``: plain full tensors under the unsharded keys.

    Collective: every rank calls it. With ``rank0_only`` the result is returned on rank 0 and ``{}``
    elsewhere (less memory on the other ranks).
    """
    state = model.state_dict()
    out = {}
    for key, value in state.items():
        if not _compat.is_sharded_tensor(value):
            out[key] = value
            continue
        group = value._process_group
        dtype = value.metadata().tensor_properties.dtype
        wire = torch.float32 if dtype == torch.bfloat16 else dtype
        full = torch.zeros(list(value.size()), dtype=wire)
        for sh in value.local_shards():
            (r, c), (nr, nc) = sh.metadata.shard_offsets, sh.metadata.shard_sizes
            full[r : r + nr, c : c + nc] = sh.tensor.detach().to(wire)
        if rank0_only:
            dist.reduce(full, dst=dist.get_process_group_ranks(group)[0], group=group)
        else:
            dist.all_reduce(full, group=group)
        out[key] = full.to(dtype)
    if rank0_only and dist.get_rank() != 0:
        return {}
    return out


def fused_optimizer(model: nn.Module):
    """The ``FusedOptimizer`` driving every fused kernel in ``model`` (None if it has none).

    Its ``step()`` pushes learning rates into the kernels and closes the step; call it once per step, like
    any optimizer (the update itself already happened in backward).
    """
    from lightning_rec.optim import FusedOptimizer

    owned = [(k, f"{path}." if path else "") for path, m in model.named_modules()
             if isinstance(m, ShardedCollection) for k in m.fused_kernels()]
    if not owned:
        return None
    found = [k for k, _ in owned]
    # one optimizer owns a kernel (a newer one would take it over), so hand out the same one each time
    cached = getattr(model, "_lightning_rec_fused_optimizer", None)
    if cached is not None and cached.kernels == found:
        return cached
    opt = FusedOptimizer(found, prefixes=[prefix for _, prefix in owned])  # collections may share table names
    object.__setattr__(model, "_lightning_rec_fused_optimizer", opt)
    return opt
