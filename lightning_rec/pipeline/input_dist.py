"""Stage 1, the input dist: every route's ids to the shard's owner (:func:`start_input_dist`).

A plain function of a :class:`~lightning_rec.pipeline.routing.RoutingTable` and a process group; the sharded
collections call it from their ``input_dist`` stage (see docs/ARCHITECTURE.md, "One lookup, walked through").
Every tensor it creates lives on ``device``, the module's device, so the same code runs over gloo on CPU and
over NCCL (or gloo) on CUDA. Under ``torch.compile`` it runs eagerly (a graph break, see ``collectives``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from lightning_rec import transport
from lightning_rec.kernels import has_fbgemm_op, load_fbgemm
from lightning_rec.pipeline import collectives as comm
from lightning_rec.pipeline.routing import KEY_SPAN, RoutingTable
from lightning_rec.plans.shard_geometry import offsets_of
from lightning_rec.sparse import KeyedJaggedTensor, offsets_from_lengths, segment_gather_index

RowKey = Callable[[torch.Tensor], torch.Tensor]  # raw ids -> a global row of the block that owns each id


def regroup(x: torch.Tensor, seg_sizes: list[int], n_outer: int, n_inner: int) -> torch.Tensor:
    """Reorder contiguous segments laid out ``[outer][inner]`` into ``[inner][outer]`` order."""
    if n_outer == 1 or n_inner == 1:  # the transpose of a single row or column: already in order
        return x
    sizes = torch.tensor(seg_sizes, dtype=torch.long, device=x.device)
    starts = offsets_from_lengths(sizes)[:-1]
    perm = torch.arange(n_outer * n_inner, device=x.device).view(n_outer, n_inner).t().reshape(-1)
    return x[segment_gather_index(starts[perm], sizes[perm], sum(seg_sizes))]


@dataclass(frozen=True)
class Received:
    """What the input dist delivered to this rank, and what the output dist needs to send results back.

    ``lengths`` / ``values`` / ``weights`` are route-major (this rank's routes, each holding the bags of
    every source rank in group order), ready for the lookup. ``ids_from[s][k]``: ids rank ``s`` sent for
    this rank's route ``k``. ``positions[i]`` / ``sent[i]``: for route ``i`` of ``routing.all_routes``, where
    in the feature's local ids the ids this rank sent came from (None: all of them, in order; the list is
    empty when the caller did not ask for positions), and how many. ``batches``: every shard rank's batch
    size, in group order (they travelled with the ids).
    """

    lengths: torch.Tensor
    values: torch.Tensor
    weights: torch.Tensor | None
    ids_from: list[list[int]]
    positions: list[torch.Tensor | None]
    sent: list[int]
    batches: tuple[int, ...] = ()

    def ids_per_route(self) -> list[int]:
        """Ids this rank looks up for each of its routes (over all source ranks)."""
        return [sum(col) for col in zip(*self.ids_from)] if self.ids_from and self.ids_from[0] else []


class InputRejected(ValueError):
    """Some rank of the shard group rejected its input; raised on every rank, in the same collective step."""


@dataclass
class _Outgoing:
    """This rank's payload, destination-major: every route's bag lengths, ids (local to its row block), weights.

    Either flat (``lengths`` / ``values`` / ``weights``: all routes, concatenated) or, where every route's
    part is a slice of the input already, ``pieces``: per route, views of its lengths, ids and weights (the
    send buffer is then assembled from the input in one copy).
    """

    lengths: torch.Tensor | None
    values: torch.Tensor | None
    weights: torch.Tensor | None
    sent: list[int]  # ids per route of ``routing.all_routes``
    positions: list[torch.Tensor | None]
    pieces: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None] | None = None

    def per_route(self, b: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]:
        if self.pieces is not None:
            return self.pieces
        assert self.lengths is not None and self.values is not None
        n = len(self.sent)
        lengths = list(torch.split(self.lengths.long(), [b] * n)) if n else []
        ws = None if self.weights is None else list(torch.split(self.weights, self.sent))
        return lengths, list(torch.split(self.values.long(), self.sent)), ws

    def flat(self, b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if self.pieces is None:
            assert self.lengths is not None and self.values is not None
            return self.lengths.long(), self.values, self.weights
        lengths, values, ws = self.pieces

        def cat(xs: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
            return torch.cat(xs) if xs else torch.zeros(0, dtype=dtype, device=device)

        return cat(lengths, torch.long).long(), cat(values, torch.long), None if ws is None else cat(ws, torch.float32)


def _route_payload(kjt: KeyedJaggedTensor, weights: torch.Tensor | None, routing: RoutingTable) -> _Outgoing:
    """Every route's payload when no table needs bucketing: the KJT's features in route order.

    Ids stay as they are (every routed table is one row block from row 0): each route's part is a slice of
    the input, copied once on its way to another rank (not at all for this rank's own routes).
    """
    lpk = kjt.length_per_key()
    sent = [lpk[f] for f in routing.route_features]
    positions: list[torch.Tensor | None] = [None] * len(sent)
    if routing.routes_in_order:
        return _Outgoing(kjt.lengths(), kjt.values(), weights, sent, positions)
    opk = kjt.offset_per_key()
    by_feature = kjt.lengths().long().view(len(kjt.keys()), kjt.stride())
    values = kjt.values().long()
    order = routing.route_features
    return _Outgoing(
        None,
        None,
        None,
        sent,
        positions,
        pieces=(
            [by_feature[f] for f in order],
            [values[opk[f] : opk[f + 1]] for f in order],
            None if weights is None else [weights[opk[f] : opk[f + 1]] for f in order],
        ),
    )


def _keyed(kjt: KeyedJaggedTensor, row_keys: Mapping[int, RowKey] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What each id is bucketed by: the id itself, or for a raw-id feature (managed collision) the row of the
    block that owns it, ``row_keys[feature](ids)``; plus which ids are raw (they travel unchanged), or None."""
    values = kjt.values()
    if not row_keys:
        return values, None
    keyed, raw = values.clone(), torch.zeros(values.numel(), dtype=torch.bool, device=values.device)
    opk = kjt.offset_per_key()
    for f, row_key in row_keys.items():
        keyed[opk[f] : opk[f + 1]] = row_key(values[opk[f] : opk[f + 1]])
        raw[opk[f] : opk[f + 1]] = True
    return keyed, raw


def _bucket_ids(
    kjt: KeyedJaggedTensor, keyed: torch.Tensor, routing: RoutingTable
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Every id's bag (counted over all features), feature, bucket (its feature's row block), and rank among
    the earlier ids of its bag in the same bucket (None where a stable sort must find the order instead).

    With at most two row blocks per feature (row-wise over two ranks) no search or sort is needed: an id's
    block is whether it reaches its feature's cut, its rank a running count since its bag's start (ids of a
    bag are contiguous). The torch path, for ids fbgemm's bucketize cannot take (:func:`_fbgemm_payload`).
    """
    b, n_keys = kjt.stride(), len(kjt.keys())
    dev, n = keyed.device, keyed.numel()
    bag = torch.repeat_interleave(torch.arange(n_keys * b, device=dev), kjt.lengths(), output_size=n)
    feature = torch.div(bag, b, rounding_mode="floor") if b else bag
    n_cuts = routing.block_cuts.shape[1]
    if n_cuts > 1:
        bucket = torch.searchsorted(routing.bucket_bounds, feature * KEY_SPAN + keyed, right=True) - 1
        return bag, feature, bucket, None
    bucket = routing.feature_bucket.index_select(0, feature)
    in_bag = torch.arange(n, device=dev) - kjt.offsets().index_select(0, bag)
    if n_cuts == 0:
        return bag, feature, bucket, in_bag
    block = (keyed >= routing.block_cuts.view(-1).index_select(0, feature)).long()
    # rank among the bag's earlier ids of the same block: a running count of block-1 ids since the bag's start
    ones = torch.cumsum(block, 0) - block
    ones = ones - ones.index_select(0, torch.arange(n, device=dev) - in_bag)
    return bag, feature, bucket + block, torch.where(block.bool(), ones, in_bag - ones)


def _slot_order(slot: torch.Tensor, n_slots: int, rank: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """How many ids hold every slot, and the ids in stable slot order; ``rank``: each id's rank in its slot."""
    counts = torch.bincount(slot, minlength=n_slots)
    if rank is None:
        return counts, torch.argsort(slot.to(torch.int32), stable=True)  # int32 sorts several times faster
    dest = (torch.cumsum(counts, 0) - counts).index_select(0, slot) + rank
    order = torch.empty_like(slot)
    order[dest] = torch.arange(slot.numel(), device=slot.device)
    return counts, order


_BUCKETIZE = "fbgemm::block_bucketize_sparse_features"


def _fbgemm_payload(
    kjt: KeyedJaggedTensor, weights: torch.Tensor | None, routing: RoutingTable, with_positions: bool
) -> _Outgoing:
    """:func:`_bucketed_payload` in one pass of fbgemm's block bucketize kernel, for ids already checked.

    Only for checked ids: fbgemm hashes an id outside its table into some block instead of keeping it out of
    range. Its output is ``[block][feature][bag]``; every route's part is a slice of it. Weights are gathered
    here (fbgemm's copy of them has no gradient, FBGEMM_CPU.md F13), by the order it reports.
    """
    b, n_keys = kjt.stride(), len(kjt.keys())
    values = kjt.values()
    n = values.numel()
    n_blocks = routing.block_bounds[0].numel() - 1 if routing.block_bounds else 1
    ordered = with_positions or weights is not None
    load_fbgemm()
    lengths, ids, _, _, where = torch.ops.fbgemm.block_bucketize_sparse_features(
        kjt.lengths(),
        values,
        False,
        ordered,
        torch.ones(n_keys, dtype=values.dtype, device=values.device),
        n_blocks,
        None,
        block_bucketize_pos=list(routing.block_bounds),
    )
    seg_ids = lengths.view(n_blocks * n_keys, b).sum(1).tolist() if b else [0] * (n_blocks * n_keys)
    first = offsets_of(seg_ids)  # the one host sync of the send side: the all-to-all needs split sizes
    segs = routing.route_segment
    sent = [seg_ids[s] for s in segs]
    order = None
    if ordered:  # fbgemm gives every id's new place; the ids in their new order are its inverse
        order = torch.empty_like(where)
        order[where] = torch.arange(n, dtype=where.dtype, device=where.device)
    ws = None
    if weights is not None:
        assert order is not None  # ordered whenever there are weights
        ws = weights.index_select(0, order)
    positions: list[torch.Tensor | None] = []
    if with_positions:
        assert order is not None
        opk = kjt.offset_per_key()
        positions = [order[first[s] : first[s + 1]] - opk[f] for s, f in zip(segs, routing.route_features)]
    lengths = lengths.long()
    return _Outgoing(
        None,
        None,
        None,
        sent,
        positions,
        pieces=(
            [lengths[s * b : (s + 1) * b] for s in segs],
            [ids[first[s] : first[s + 1]] for s in segs],
            None if ws is None else [ws[first[s] : first[s + 1]] for s in segs],
        ),
    )


def _bucketed_payload(
    kjt: KeyedJaggedTensor,
    weights: torch.Tensor | None,
    routing: RoutingTable,
    with_positions: bool,
    row_keys: Mapping[int, RowKey] | None = None,
) -> _Outgoing:
    """Every route's payload, ids bucketed by row block and made local to it: the same few ops for all features.

    Ids are ordered by (bucket, bag) (:func:`_bucket_ids`), which keeps every bucket's ids in bag order; a
    route reads its bucket's segment (a bucket read by several routes, i.e. column shards of one row block,
    is copied).
    """
    b, n_keys = kjt.stride(), len(kjt.keys())
    values = kjt.values()
    dev = values.device
    if routing.bucket_route_rel is not None:
        return _sorted_payload(kjt, weights, routing, with_positions, row_keys)
    keyed, raw = _keyed(kjt, row_keys)
    bag, feature, bucket, rank = _bucket_ids(kjt, keyed, routing)
    local = keyed - routing.bucket_start[bucket]
    if raw is not None:
        local = torch.where(raw, values, local)
    n_buckets = routing.bucket_bounds.numel()
    counts, order = _slot_order(bucket * b + (bag - feature * b), n_buckets * b, rank)
    counts = counts.view(n_buckets, b)
    size = counts.sum(1)
    route_size = size[routing.route_bucket]
    sent = route_size.tolist()  # the one host sync of the send side: the all-to-all needs split sizes
    bucket_first = torch.cumsum(size, 0) - size
    gather = order[segment_gather_index(bucket_first[routing.route_bucket], route_size, total=sum(sent))]
    positions: list[torch.Tensor | None] = []
    if with_positions:
        feature_first = kjt.offsets()[torch.arange(n_keys, device=dev) * b]
        route_first = feature_first[torch.tensor(routing.route_features, dtype=torch.long, device=dev)]
        base = torch.repeat_interleave(route_first, route_size, output_size=gather.numel())
        positions = list(torch.split(gather - base, sent))
    return _Outgoing(
        counts[routing.route_bucket].reshape(-1),
        local[gather],
        None if weights is None else weights[gather],
        sent,
        positions,
    )


def _sorted_payload(
    kjt: KeyedJaggedTensor,
    weights: torch.Tensor | None,
    routing: RoutingTable,
    with_positions: bool,
    row_keys: Mapping[int, RowKey] | None = None,
) -> _Outgoing:
    """:func:`_bucketed_payload` when every row block is read by one route: ids ordered by (route, bag).

    Every id gets the slot ``route * b + bag within the feature`` (ids of unrouted features after all
    routes' slots); the ids in stable slot order are the payload, the slots' histogram the routes' bag lengths.
    """
    b, n_keys = kjt.stride(), len(kjt.keys())
    values = kjt.values()
    dev = values.device
    n_routes = routing.route_row_start.numel()
    keyed, raw = _keyed(kjt, row_keys)
    bag, _, bucket, rank = _bucket_ids(kjt, keyed, routing)
    assert routing.bucket_route_rel is not None  # the caller picks this path only where it exists
    slot = (routing.bucket_route_rel * b).index_select(0, bucket) + bag
    counts, order = _slot_order(slot, (n_routes + n_keys) * b, rank)
    counts = counts[: n_routes * b]
    route_size = counts.view(n_routes, b).sum(1)
    sent = route_size.tolist()  # the one host sync of the send side: the all-to-all needs split sizes
    total = sum(sent)
    order = order[:total]
    first_row = torch.repeat_interleave(routing.route_row_start, route_size, output_size=total)
    positions: list[torch.Tensor | None] = []
    if with_positions:
        feature_first = kjt.offsets()[torch.arange(n_keys, device=dev) * b]
        route_first = feature_first[torch.tensor(routing.route_features, dtype=torch.long, device=dev)]
        positions = list(torch.split(order - torch.repeat_interleave(route_first, route_size, output_size=total), sent))
    local = keyed.index_select(0, order) - first_row
    if raw is not None:
        local = torch.where(raw.index_select(0, order), values.index_select(0, order), local)
    return _Outgoing(counts, local, None if weights is None else weights.index_select(0, order), sent, positions)


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_HEADER = 4  # per rank pair: batch size, rejected, weights need a gradient, lengths and ids fit in int32
_INT32_END = 1 << 31


def as_int64(w: torch.Tensor) -> torch.Tensor:
    """Float weights as int64 words holding their bits (exact, reversible by :func:`from_int64`)."""
    bits = w.contiguous().view(_BITS[w.element_size()])
    return bits if bits.dtype == torch.long else bits.to(torch.long)


def from_int64(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    bits = _BITS[torch.empty(0, dtype=dtype).element_size()]
    return (x if bits == torch.long else x.to(bits)).view(dtype)


class PendingInputDist:
    """An input dist whose payload all-to-all is in flight; :meth:`wait` returns what arrived.

    Made by :func:`start_input_dist`; waiting twice returns the same :class:`Received`.
    """

    def __init__(self, received: Received | None = None, **parts: Any) -> None:
        self._received = received
        self._parts = parts

    @torch.compiler.disable
    def wait(self) -> Received:
        if self._received is None:
            self._received = _unpack(**self._parts)
            self._parts = {}
        return self._received


def start_input_dist(
    kjt: KeyedJaggedTensor | None,
    weights: torch.Tensor | None,
    routing: RoutingTable,
    group: dist.ProcessGroup,
    device: torch.device,
    *,
    rejected: bool = False,
    with_positions: bool = True,
    async_op: bool = True,
    ranks: list[int] | None = None,
    row_keys: Mapping[int, RowKey] | None = None,
    ids_checked: bool = False,
) -> PendingInputDist:
    """Send every route's ids (made local to the shard's row block) to the shard owner; the payload flies async.

    ``weights`` are the per-sample weights in the dtype every rank agreed on (or None); ``rejected``: this
    rank's input failed its checks (``kjt`` may then be None): it still joins the exchange, so that every
    rank raises :class:`InputRejected` together instead of waiting. Comm, two collectives: an all-to-all of
    a fixed-size header per rank pair (batch size, rejected flag, whether weights need a gradient, whether
    its lengths and ids fit in int32, id count of every route), then one all-to-all of lengths, ids and
    weights (their bits) in one int64 buffer; int32 instead when every rank's fit, there are no weights and
    the exchange goes through torch.distributed (half the bytes on the wire; widened back on arrival). Per-
    sample weights that need a gradient travel in a third, differentiable all-to-all instead.

    Example, 2 ranks, one row-wise table of 10 rows (0-4 | 5-9), rank 0's batch ``[[3, 7], [8]]``: rank 0
    sends rank 1 the header ``[2, 0, 0, 1, 2]`` and the payload ``[1, 1, 2, 3]`` (lengths, then ids 7-5, 8-5).
    ``ranks``: the global rank of every group rank, to name them in errors. ``row_keys``: for features fed
    raw ids (managed collision), ``{feature: ids -> a row of the block that owns each id}``; those ids are
    routed by that row and travel unchanged (their owner remaps them). ``ids_checked``: every id is known to
    lie in its table (checked by the caller), so fbgemm's bucketize kernel may split them by row block.
    """
    b = 0 if kjt is None else kjt.stride()
    n_ranks, n_mine, n_routes = routing.group_size, len(routing.my_routes), len(routing.route_features)
    if kjt is None or rejected:
        out = _Outgoing(
            torch.zeros(n_routes * b, dtype=torch.long, device=device),
            torch.zeros(0, dtype=torch.long, device=device),
            None,
            [0] * n_routes,
            [],
        )
    elif routing.single_block:
        out = _route_payload(kjt, weights, routing)
    elif ids_checked and not row_keys and has_fbgemm_op(_BUCKETIZE, device.type):
        out = _fbgemm_payload(kjt, weights, routing, with_positions)
    else:
        out = _bucketed_payload(kjt, weights, routing, with_positions, row_keys or {})
    if n_ranks == 1:  # this rank is the whole shard group: nothing to exchange
        if rejected:
            raise InputRejected("this rank rejected its input")
        lengths, values, ws = out.flat(b, device)
        recv = Received(
            lengths=lengths,
            values=values,
            weights=ws,
            ids_from=[out.sent],
            positions=out.positions,
            sent=out.sent,
            batches=(b,),
        )
        return PendingInputDist(recv)
    weighted = out.weights is not None or (out.pieces is not None and out.pieces[2] is not None)
    w_grad = weighted and weights is not None and weights.requires_grad and torch.is_grad_enabled()
    fits = (
        not weighted
        and not _through_shared_memory(group, device)
        and _fits_int32(out, kjt, ids_checked and not row_keys and routing.rows_fit_int32)
    )
    header, i = [], 0
    per_dest = [len(lst) for lst in routing.routes_to]
    for k in per_dest:
        header += [b, int(rejected), int(w_grad), int(fits), *out.sent[i : i + k]]
        i += k
    h = _HEADER + n_mine
    got = comm.all_to_all(
        torch.tensor(header, dtype=torch.long, device=device), [h] * n_ranks, [_HEADER + k for k in per_dest], group
    ).tolist()
    bad = [s if ranks is None else ranks[s] for s in range(n_ranks) if got[s * h + 1]]
    if bad:
        raise InputRejected(f"ranks {bad} rejected their input (see the error raised there); stopping this rank too")
    batches = tuple(got[s * h] for s in range(n_ranks))
    ids_from = [got[s * h + _HEADER : (s + 1) * h] for s in range(n_ranks)]
    w_apart = any(got[s * h + 2] for s in range(n_ranks))  # every rank sends weights the same way
    narrow = all(got[s * h + 3] for s in range(n_ranks))  # every rank's lengths and ids fit in int32
    packed = weighted and not w_apart
    # to each rank, its routes' lengths, then ids, then weight bits: pieces of one int64 all-to-all
    route_lengths, route_values, route_weights = out.per_route(b)
    sends: list[list[torch.Tensor]] = []
    value_counts = [sum(out.sent[i0 : i0 + k]) for i0, k in zip(_starts(per_dest), per_dest)]
    for r, i0 in enumerate(_starts(per_dest)):
        i1 = i0 + per_dest[r]
        sends.append(route_lengths[i0:i1] + route_values[i0:i1])
        if packed:
            assert route_weights is not None
            sends[-1] += [as_int64(w) for w in route_weights[i0:i1]]
    if narrow:
        sends = _narrowed(sends, device)
    recv_sizes = [[batches[s]] * n_mine + ids_from[s] + (ids_from[s] if packed else []) for s in range(n_ranks)]
    consume = partial(_route_major, n_mine=n_mine, packed=packed, device=device)
    work = transport.all_to_all_pieces(sends, recv_sizes, consume, group, device, async_op=async_op)
    separate = None
    if w_apart:
        w = out.flat(b, device)[2] if weighted else None
        w = w if w is not None else torch.zeros(0, device=device)
        separate = comm.all_to_all(w, [sum(x) for x in ids_from], value_counts, group, differentiable=True)
    return PendingInputDist(
        work=work,
        batches=batches,
        ids_from=ids_from,
        sent=out.sent,
        positions=out.positions,
        packed_dtype=weights.dtype if packed and weights is not None else None,
        separate_weights=separate,
        n_mine=n_mine,
    )


def _fits_int32(out: _Outgoing, kjt: KeyedJaggedTensor | None, ids_in_tables: bool) -> bool:
    """Whether every length and id this rank sends is an int32 (then int32 carries them exactly).
    ``ids_in_tables``: the ids were checked against tables of at most 2**31 rows (then no need to look)."""
    if kjt is None:
        return True
    values = out.values if out.pieces is None else kjt.values()  # pieces are slices of the input's ids
    if values is None or values.numel() == 0:
        return True
    if values.numel() >= _INT32_END:  # a bag could be that long
        return False
    if ids_in_tables:
        return True
    lo, hi = torch.stack(list(torch.aminmax(values))).tolist()  # one host sync for both bounds
    return lo >= -_INT32_END and hi < _INT32_END


def _through_shared_memory(group: dist.ProcessGroup, device: torch.device) -> bool:
    # the shared-memory transport copies each piece once either way: narrowing would add a pass, save no wire
    return device.type == "cpu" and transport.shared_group(group) is not None


def _narrowed(sends: list[list[torch.Tensor]], device: torch.device) -> list[list[torch.Tensor]]:
    """The int64 pieces as int32 views of one buffer (sent in place)."""
    flat = [t for lst in sends for t in lst]
    sizes = [t.numel() for t in flat]
    # a same-dtype cat, then one cast: the kernels every device has (no cat into another dtype)
    buf = torch.cat(flat).to(torch.int32) if flat else torch.zeros(0, dtype=torch.int32, device=device)
    views = iter(torch.split(buf, sizes))
    return [[next(views) for _ in lst] for lst in sends]


def _route_major(
    got: list[list[torch.Tensor]], n_mine: int, packed: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Every source's ``[lengths | ids | weights][route]`` pieces as route-major lengths, ids, weight bits
    (int64: pieces that travelled as int32 are widened)."""

    def cat(at: int) -> torch.Tensor:
        parts = [pieces[at + k] for k in range(n_mine) for pieces in got]
        return torch.cat(parts).long() if parts else torch.zeros(0, dtype=torch.long, device=device)

    return cat(0), cat(n_mine), cat(2 * n_mine) if packed else None


def _starts(sizes: list[int]) -> list[int]:
    return offsets_of(sizes)[:-1]


def _unpack(
    work: transport.PendingPieces[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    batches: tuple[int, ...],
    ids_from: list[list[int]],
    sent: list[int],
    positions: list[torch.Tensor | None],
    packed_dtype: torch.dtype | None,
    separate_weights: torch.Tensor | None,
    n_mine: int,
) -> Received:
    """What arrived, route-major (each route's bags from every source rank in group order)."""
    lengths, values, weights = work.wait()
    if packed_dtype is not None:
        # packed_dtype is set only where the weight bits travelled with the ids
        weights = from_int64(weights, packed_dtype)  # type: ignore[arg-type]
    if separate_weights is not None:
        weights = regroup(separate_weights, [c for row in ids_from for c in row], len(batches), n_mine)
    return Received(
        lengths=lengths,
        values=values,
        weights=weights,
        ids_from=ids_from,
        positions=positions,
        sent=sent,
        batches=batches,
    )
