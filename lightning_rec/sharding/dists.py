"""The two communication stages of the sharded pipeline: input dist (ids to shard owners) and output dist.

Both are plain functions of a :class:`~lightning_rec.sharding.routing.RoutingTable` and a process group;
the sharded collections call them as ``input_dist -> lookup -> output_dist`` (see
docs/ARCHITECTURE.md, "One lookup, walked through"). Every tensor they create lives on ``device``, the
module's device, so the same code runs over gloo on CPU and over NCCL (or gloo) on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_rec.sharding import comm
from lightning_rec.sharding.layout import offsets_of
from lightning_rec.sharding.routing import RoutingTable
from lightning_rec.sparse import KeyedJaggedTensor, offsets_from_lengths, segment_gather_index

RowKey = Callable[[torch.Tensor], torch.Tensor]  # raw ids -> a global row of the block that owns each id


def regroup(x: torch.Tensor, seg_sizes: list[int], n_outer: int, n_inner: int) -> torch.Tensor:
    """Reorder contiguous segments laid out ``[outer][inner]`` into ``[inner][outer]`` order."""
    if n_outer == 1 or n_inner == 1:  # the transpose of a single row or column: already in order
        return x
    sizes = torch.tensor(seg_sizes, dtype=torch.long, device=x.device)
    starts = offsets_from_lengths(sizes)[:-1]
    perm = torch.arange(n_outer * n_inner, device=x.device).view(n_outer, n_inner).t().reshape(-1)
    return x[segment_gather_index(starts[perm], sizes[perm])]


@dataclass(frozen=True)
class Received:
    """What the input dist delivered to this rank, and what the output dist needs to send results back.

    ``lengths`` / ``values`` / ``weights`` are route-major (this rank's routes, each holding the bags of
    every source rank in group order), ready for the lookup. ``ids_from[s][k]``: ids rank ``s`` sent for
    this rank's route ``k``. ``positions[i]`` / ``sent[i]``: for route ``i`` of ``routing.all_routes``, where
    in the feature's local ids the ids this rank sent came from (None: all of them, in order), and how many.
    """

    lengths: torch.Tensor
    values: torch.Tensor
    weights: torch.Tensor | None
    ids_from: list[list[int]]
    positions: list[torch.Tensor | None]
    sent: list[int]

    def ids_per_route(self) -> list[int]:
        """Ids this rank looks up for each of its routes (over all source ranks)."""
        return [sum(col) for col in zip(*self.ids_from)] if self.ids_from and self.ids_from[0] else []


def _bucketize(vals: torch.Tensor, lens: torch.Tensor, starts: tuple[int, ...], b: int, device: torch.device,
               row_key: RowKey | None = None):
    """Split one feature's ids by row block: per-block bag lengths, id counts, block-local ids, permutation.

    With ``row_key`` (raw ids of a managed-collision table) the block is the one holding row ``row_key(ids)``
    and the ids travel unchanged (the owner remaps them after the input dist).
    """
    st = torch.tensor(starts, dtype=torch.long, device=device)
    bucket = torch.searchsorted(st, vals if row_key is None else row_key(vals), right=True) - 1
    order = torch.argsort(bucket, stable=True)
    bag = torch.repeat_interleave(torch.arange(b, device=device), lens, output_size=vals.numel())
    counts = torch.bincount(bucket * b + bag, minlength=len(starts) * b).view(len(starts), b)
    return counts, counts.sum(1), vals[order] - st[bucket[order]] if row_key is None else vals[order], order


def input_dist(
    kjt: KeyedJaggedTensor,
    weights: torch.Tensor | None,
    routing: RoutingTable,
    batches: list[int],
    group: dist.ProcessGroup,
    device: torch.device,
    row_keys: Mapping[int, RowKey] | None = None,
) -> Received:
    """Send every route's ids (made local to the shard's row block) to the shard owner; return what came in.

    ``weights`` are the per-sample weights in the dtype every rank agreed on (or None). ``row_keys``: for
    tables fed raw ids (managed collision), ``{table index: ids -> a row of the block that owns each id}``;
    those ids travel unchanged. Comm: an all-to-all of id counts, then of lengths, ids and weights.
    """
    b = kjt.stride()
    if routing.single_block:
        send_l, send_v, send_w, sent, value_counts = _route_payload(kjt, weights, routing)
        positions: list[torch.Tensor | None] = [None] * len(sent)
    else:
        send_l, send_v, send_w, sent, value_counts, positions = _bucketed_payload(kjt, weights, routing, device,
                                                                                  row_keys or {})
    n_ranks, n_mine = routing.group_size, len(routing.my_routes)
    if n_ranks == 1:  # this rank is the whole shard group: nothing to exchange
        return Received(lengths=send_l, values=send_v, weights=send_w, ids_from=[sent], positions=positions,
                        sent=sent)
    # lengths first: their sizes follow from the batch sizes, and every id count follows from them
    len_in = [len(lst) * b for lst in routing.routes_to]
    len_out = [n_mine * bs for bs in batches]
    recv_l = comm.all_to_all(send_l, len_out, len_in, group)
    seg_bags = [bs for bs in batches for _ in range(n_mine)]
    bounds = offsets_from_lengths(torch.tensor(seg_bags, dtype=torch.long, device=device))
    recv_offsets = offsets_from_lengths(recv_l)
    seg_vals = (recv_offsets[bounds[1:]] - recv_offsets[bounds[:-1]]).tolist()
    recv_counts = [sum(seg_vals[s * n_mine : (s + 1) * n_mine]) for s in range(n_ranks)]
    recv_v = comm.all_to_all(send_v, recv_counts, value_counts, group)
    recv_w = None if send_w is None else comm.all_to_all(send_w, recv_counts, value_counts, group)
    # received layout is [source][route][bag]; the lookup wants [route][source][bag]
    return Received(
        lengths=regroup(recv_l, seg_bags, n_ranks, n_mine),
        values=regroup(recv_v, seg_vals, n_ranks, n_mine),
        weights=None if recv_w is None else regroup(recv_w, seg_vals, n_ranks, n_mine),
        ids_from=[seg_vals[s * n_mine : (s + 1) * n_mine] for s in range(n_ranks)],
        positions=positions,
        sent=sent,
    )


def _route_payload(kjt: KeyedJaggedTensor, weights: torch.Tensor | None, routing: RoutingTable):
    """Every route's lengths, ids and weights when no table needs bucketing: the KJT's features in route order.

    Ids stay as they are (every routed table is one row block from row 0), so this is one gather, or
    nothing when the routes already read the features in order.
    """
    order = list(routing.route_features)
    lpk = kjt.length_per_key()
    sent = [lpk[f] for f in order]
    value_counts, i = [], 0
    for lst in routing.routes_to:
        value_counts.append(sum(sent[i : i + len(lst)]))
        i += len(lst)
    if order == list(range(len(kjt.keys()))):
        return kjt.lengths(), kjt.values(), weights, sent, value_counts
    opk = kjt.offset_per_key()
    dev = kjt.values().device
    gather = segment_gather_index(torch.tensor([opk[f] for f in order], dtype=torch.long, device=dev),
                                  torch.tensor(sent, dtype=torch.long, device=dev), total=sum(sent))
    b = kjt.stride()
    lengths = kjt.lengths().view(len(kjt.keys()), b)[torch.tensor(order, dtype=torch.long, device=dev)].reshape(-1)
    return lengths, kjt.values()[gather], None if weights is None else weights[gather], sent, value_counts


def _bucketed_payload(kjt: KeyedJaggedTensor, weights: torch.Tensor | None, routing: RoutingTable,
                      device: torch.device, row_keys: Mapping[int, RowKey]):
    """Every route's lengths, ids (local to the route's row block) and weights, bucketed by row block."""
    b = kjt.stride()
    values, lengths, opk = kjt.values(), kjt.lengths(), kjt.offset_per_key()
    per_feature: dict[int, tuple] = {}
    for r in routing.all_routes:
        if r.feature in per_feature:
            continue
        f, ti = r.feature, r.table
        vals = values[opk[f] : opk[f + 1]]
        lens = lengths[f * b : (f + 1) * b]
        w = None if weights is None else weights[opk[f] : opk[f + 1]]
        starts = routing.row_starts[ti]
        if len(starts) == 1:
            per_feature[f] = (lens.view(1, b), [vals.numel()], vals - starts[0] if starts[0] else vals, w, None)
            continue
        counts, seg, local_vals, order = _bucketize(vals, lens, starts, b, device, row_keys.get(ti))
        per_feature[f] = (counts, seg, local_vals, None if w is None else w[order], order)
    # every feature's id count per row block, read back in one host sync
    bucketed = [f for f, v in per_feature.items() if isinstance(v[1], torch.Tensor)]
    if bucketed:
        flat = torch.cat([per_feature[f][1] for f in bucketed]).tolist()
        i = 0
        for f in bucketed:
            counts, seg, local_vals, w, order = per_feature[f]
            per_feature[f] = (counts, flat[i : i + seg.numel()], local_vals, w, order)
            i += seg.numel()
    send_lengths, send_values, send_weights, positions, value_counts, sent = [], [], [], [], [], []
    for lst in routing.routes_to:
        n = 0
        for r in lst:
            counts, seg, vals, w, order = per_feature[r.feature]
            blk = routing.block_of[(r.table, r.shard.row_offset)]
            lo = sum(seg[:blk])
            hi = lo + seg[blk]
            send_lengths.append(counts[blk])
            send_values.append(vals[lo:hi])
            if w is not None:
                send_weights.append(w[lo:hi])
            positions.append(None if order is None else order[lo:hi])
            sent.append(hi - lo)
            n += hi - lo
        value_counts.append(n)

    def cat(xs: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return torch.cat(xs) if xs else torch.zeros(0, dtype=dtype, device=device)

    send_w = None if weights is None else cat(send_weights, weights.dtype)
    return cat(send_lengths, torch.long), cat(send_values, torch.long), send_w, sent, value_counts, positions


def pooled_output_dist(
    pooled: torch.Tensor, routing: RoutingTable, batches: list[int], b: int, group: dist.ProcessGroup
) -> list[torch.Tensor]:
    """Send each source rank its samples' pooled rows; return one ``[b, cols_from[r]]`` block per rank ``r``.

    ``pooled`` is ``[sum(batches), this rank's route columns]`` (the lookup's output). Backward is the
    reverse all-to-all, run on every rank (see ``comm.all_to_all``).
    """
    cols_from = routing.cols_from
    if routing.group_size == 1:
        return [pooled]
    width = cols_from[routing.group_rank]
    flat = comm.all_to_all(
        pooled.reshape(-1), [b * w for w in cols_from], [bs * width for bs in batches], group,
        differentiable=torch.is_grad_enabled(),
    )
    return [blk.view(b, w) for blk, w in zip(torch.split(flat, [b * w for w in cols_from]), cols_from)]


def sequence_output_dist(
    embs: list[torch.Tensor],
    recv: Received,
    routing: RoutingTable,
    dims: list[int],
    wire: torch.dtype,
    group: dist.ProcessGroup,
    device: torch.device,
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Send every id's embedding (columns of its shard) back to the id's rank.

    ``embs[k]`` holds route ``k``'s per-id rows (source-major). Returns, per feature, ``(flat index into the
    feature's [ids, dim] output, values)`` pieces to be summed into place.
    """
    mine = routing.my_routes
    n_mine, n_ranks = len(mine), routing.group_size
    cols = [r.shard.cols for r in mine]
    flat = torch.cat([e.to(wire).reshape(-1) for e in embs]) if embs else torch.zeros(0, dtype=wire, device=device)
    # route-major [route][source] -> source-major [source][route], in elements
    elems = [recv.ids_from[s][k] * cols[k] for k in range(n_mine) for s in range(n_ranks)]
    flat = regroup(flat, elems, n_mine, n_ranks)
    send = [sum(recv.ids_from[s][k] * cols[k] for k in range(n_mine)) for s in range(n_ranks)]
    all_routes = routing.all_routes
    starts = offsets_of([len(x) for x in routing.routes_to])
    recv_sizes = [sum(n * r.shard.cols for n, r in zip(recv.sent[i0 : i0 + len(lst)], lst))
                  for i0, lst in zip(starts, routing.routes_to)]
    back = comm.all_to_all(flat, recv_sizes, send, group, differentiable=torch.is_grad_enabled())
    chunks = torch.split(back, [n * r.shard.cols for n, r in zip(recv.sent, all_routes)])
    pieces: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in dims]
    for r, chunk, pos, n in zip(all_routes, chunks, recv.positions, recv.sent):
        d = dims[r.feature]
        if pos is None:
            pos = torch.arange(n, device=device)
        cols_r = torch.arange(r.shard.cols, device=device)
        idx = (pos.unsqueeze(1) * d + r.shard.col_offset + cols_r).reshape(-1)
        pieces[r.feature].append((idx, chunk))
    return pieces
