"""What a rank sends in the input dist: every route's bag lengths, ids (local to the route's row block) and
weights, built by one of a few payload builders (:class:`PayloadKind`) from the layout's :class:`Bucketing`.

The :class:`Bucketing` (where every route's ids are found in a batch) is derived once from a
:class:`~lightning_rec.pipeline.routing.RoutingTable` by the pure function :func:`build_bucketing`, when the input
dist is built (``input_dist.InputDist``, which owns it and moves it to another device). Which builder serves a
collection follows from that bucketing (and whether ids were checked, and raw managed-collision ids), so
:func:`payload_kind` decides it then too; per batch only the KJT and its weights come in. Nothing here talks to
other processes: ``tests/unit/test_input_dist.py`` checks every builder against a loop over routes and bags, and
``tests/unit/test_routing.py`` the bucketing.

A *bucket* is one row block of one feature, feature-major; a feature no route reads (a data-parallel table's)
is one bucket no route reads. Row blocks of every feature live in one key space,
``feature * KEY_SPAN + row`` (``routing.KEY_SPAN``), so one searchsorted buckets the ids of all features.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from lightning_rec.kernels import has_fbgemm_op, load_fbgemm
from lightning_rec.pipeline.routing import KEY_SPAN, RoutingTable
from lightning_rec.plans.shard_geometry import offsets_of
from lightning_rec.sparse import KeyedJaggedTensor, segment_gather_index

RowKey = Callable[[torch.Tensor], torch.Tensor]  # raw ids -> a global row of the block that owns each id

_NO_END = (1 << 63) - 1  # the block end of a feature no route reads: every id lands in its first block


@dataclass(frozen=True)
class Bucketing:
    """Where every route's ids come from, for the payload builders; its tensors live on one device (:meth:`to`)."""

    route_features: tuple[int, ...]  # the feature of every route of ``routing.all_routes``, in that order
    single_block: bool  # every routed table is one row block from row 0: ids need no bucketing
    routes_in_order: bool  # the routes read every feature once, in order: the payload is the KJT itself
    rows_fit_int32: bool  # every routed table has at most 2**31 rows: its checked ids are int32s
    bucket_bounds: torch.Tensor  # first key of every bucket, ascending
    bucket_start: torch.Tensor  # first row of every bucket's block
    route_bucket: torch.Tensor  # the bucket of every route
    route_row_start: torch.Tensor  # first row of every route's block
    feature_bucket: torch.Tensor  # first bucket of every feature
    # [features, most row blocks of a feature - 1]: the first row of every block after a feature's first,
    # padded with KEY_SPAN: an id's block within its feature is how many of its row's cuts it reaches
    block_cuts: torch.Tensor
    # fbgemm's block bucketize: per feature, its blocks' first rows and end (as many entries for every feature:
    # fewer blocks end in empty ones), and per route the (block, feature) segment of its output it reads
    block_bounds: tuple[torch.Tensor, ...]
    route_segment: tuple[int, ...]
    # when no bucket is read by two routes (no column shards of a row block): per bucket, its route minus its
    # feature (unread buckets: the number of routes), so that ``value * batch + bag`` (bag counted over all
    # features) is an id's (route, bag) slot, every unread feature's slots after all routes' ones
    bucket_route_rel: torch.Tensor | None

    def to(self, device: torch.device | str) -> Bucketing:
        return dataclasses.replace(
            self,
            bucket_bounds=self.bucket_bounds.to(device),
            bucket_start=self.bucket_start.to(device),
            route_bucket=self.route_bucket.to(device),
            route_row_start=self.route_row_start.to(device),
            feature_bucket=self.feature_bucket.to(device),
            block_cuts=self.block_cuts.to(device),
            block_bounds=tuple(t.to(device) for t in self.block_bounds),
            bucket_route_rel=None if self.bucket_route_rel is None else self.bucket_route_rel.to(device),
        )


def build_bucketing(routing: RoutingTable, device: torch.device | str = "cpu") -> Bucketing:
    """The :class:`Bucketing` of ``routing``, its tensors made on ``device``."""
    n_features = routing.num_features
    all_routes = routing.all_routes
    # every feature of a table with a non-empty shard has a route to it: a feature's routes name its table
    table_of = {r.feature: r.table for r in all_routes}
    bounds: list[int] = []
    starts_of_buckets: list[int] = []
    first_bucket: list[int] = []
    for f in range(n_features):
        first_bucket.append(len(bounds))
        for start in routing.row_starts[table_of[f]] if f in table_of else (0,):
            bounds.append(f * KEY_SPAN + start)
            starts_of_buckets.append(start)
    route_bucket = [first_bucket[r.feature] + routing.block_of[(r.table, r.shard.row_offset)] for r in all_routes]
    ends_of_buckets = [*first_bucket[1:], len(bounds)]
    bucket_feature = [f for f in range(n_features) for _ in range(ends_of_buckets[f] - first_bucket[f])]
    rel = [len(all_routes)] * len(bucket_feature)
    for i, bk in enumerate(route_bucket):
        rel[bk] = i - bucket_feature[bk]
    per_feature = [
        [start for bf, start in zip(bucket_feature, starts_of_buckets) if bf == f][1:] for f in range(n_features)
    ]
    n_cuts = max((len(c) for c in per_feature), default=0)
    cuts = [c + [KEY_SPAN] * (n_cuts - len(c)) for c in per_feature]
    table_end: dict[int, int] = {}
    for r in all_routes:
        table_end[r.table] = max(table_end.get(r.table, 0), r.shard.row_offset + r.shard.rows)
    ends = [table_end[table_of[f]] if f in table_of else _NO_END for f in range(n_features)]

    def long(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return Bucketing(
        route_features=tuple(r.feature for r in all_routes),
        single_block=all(routing.row_starts[t] == (0,) for t in set(table_of.values())),
        routes_in_order=[r.feature for r in all_routes] == list(range(n_features)),
        rows_fit_int32=all(end <= 1 << 31 for end in table_end.values()),
        bucket_bounds=long(bounds),
        bucket_start=long(starts_of_buckets),
        route_bucket=long(route_bucket),
        route_row_start=long([r.shard.row_offset for r in all_routes]),
        feature_bucket=long(first_bucket),
        block_cuts=long(cuts).view(n_features, n_cuts),
        block_bounds=tuple(long([0, *c, *[e] * (1 + n_cuts - len(c))]) for c, e in zip(per_feature, ends)),
        route_segment=tuple(
            (bk - first_bucket[r.feature]) * n_features + r.feature for bk, r in zip(route_bucket, all_routes)
        ),
        bucket_route_rel=long(rel) if len(set(route_bucket)) == len(route_bucket) and rel else None,
    )


class PayloadKind(enum.Enum):
    """How a layout's payload is built (:func:`payload_kind`)."""

    #: no table needs bucketing and the routes read every feature once, in order: the KJT itself
    KJT = "kjt"
    #: no table needs bucketing: every route's part is a slice of the input (one copy, to other ranks only)
    FEATURE_SLICES = "feature_slices"
    #: checked ids of row blocks: one pass of fbgemm's block bucketize kernel
    FBGEMM_BUCKETIZE = "fbgemm_bucketize"
    #: row blocks each read by one route: ids in stable (route, bag) order, in torch
    ROUTE_SORT = "route_sort"
    #: row blocks, some read by several routes (column shards of a row block): by (bucket, bag), in torch
    BUCKET_SORT = "bucket_sort"


_BUCKETIZE = "fbgemm::block_bucketize_sparse_features"


def payload_kind(bk: Bucketing, ids_checked: bool, raw_ids: bool, device_type: str) -> PayloadKind:
    """The builder for this layout. ``ids_checked``: every id was checked against its table (fbgemm would hash
    one outside it into some block); ``raw_ids``: some features carry raw managed-collision ids."""
    if bk.single_block:
        return PayloadKind.KJT if bk.routes_in_order else PayloadKind.FEATURE_SLICES
    if ids_checked and not raw_ids and has_fbgemm_op(_BUCKETIZE, device_type):
        return PayloadKind.FBGEMM_BUCKETIZE
    return PayloadKind.ROUTE_SORT if bk.bucket_route_rel is not None else PayloadKind.BUCKET_SORT


class RoutePieces(NamedTuple):
    """Per route (``routing.all_routes`` order): its bag lengths, ids and weights (None: unweighted)."""

    lengths: list[torch.Tensor]
    values: list[torch.Tensor]
    weights: list[torch.Tensor] | None


class FlatPayload(NamedTuple):
    """Every route's bag lengths, ids and weights, concatenated in route order."""

    lengths: torch.Tensor
    values: torch.Tensor
    weights: torch.Tensor | None


@dataclass
class Outgoing:
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
    pieces: RoutePieces | None = None

    def per_route(self, b: int) -> RoutePieces:
        if self.pieces is not None:
            return self.pieces
        assert self.lengths is not None and self.values is not None
        n = len(self.sent)
        lengths = list(torch.split(self.lengths.long(), [b] * n)) if n else []
        ws = None if self.weights is None else list(torch.split(self.weights, self.sent))
        return RoutePieces(lengths, list(torch.split(self.values.long(), self.sent)), ws)

    def flat(self, b: int, device: torch.device) -> FlatPayload:
        if self.pieces is None:
            assert self.lengths is not None and self.values is not None
            return FlatPayload(self.lengths.long(), self.values, self.weights)
        lengths, values, ws = self.pieces

        def cat(xs: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
            return torch.cat(xs) if xs else torch.zeros(0, dtype=dtype, device=device)

        return FlatPayload(
            cat(lengths, torch.long).long(), cat(values, torch.long), None if ws is None else cat(ws, torch.float32)
        )


def kjt_payload(kjt: KeyedJaggedTensor, weights: torch.Tensor | None, bk: Bucketing) -> Outgoing:
    """The payload when the routes read every feature once, in order, from row 0: the KJT's own tensors."""
    lpk = kjt.length_per_key()
    sent = [lpk[f] for f in bk.route_features]
    return Outgoing(kjt.lengths(), kjt.values(), weights, sent, [None] * len(sent))


def route_payload(kjt: KeyedJaggedTensor, weights: torch.Tensor | None, bk: Bucketing) -> Outgoing:
    """Every route's payload when no table needs bucketing: the KJT's features in route order.

    Ids stay as they are (every routed table is one row block from row 0): each route's part is a slice of
    the input, copied once on its way to another rank (not at all for this rank's own routes).
    """
    lpk = kjt.length_per_key()
    sent = [lpk[f] for f in bk.route_features]
    positions: list[torch.Tensor | None] = [None] * len(sent)
    opk = kjt.offset_per_key()
    by_feature = kjt.lengths().long().view(len(kjt.keys()), kjt.stride())
    values = kjt.values().long()
    order = bk.route_features
    return Outgoing(
        None,
        None,
        None,
        sent,
        positions,
        pieces=RoutePieces(
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
    kjt: KeyedJaggedTensor, keyed: torch.Tensor, bk: Bucketing
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Every id's bag (counted over all features), feature, bucket (its feature's row block), and rank among
    the earlier ids of its bag in the same bucket (None where a stable sort must find the order instead).

    With at most two row blocks per feature (row-wise over two ranks) no search or sort is needed: an id's
    block is whether it reaches its feature's cut, its rank a running count since its bag's start (ids of a
    bag are contiguous). The torch path, for ids fbgemm's bucketize cannot take (:func:`fbgemm_payload`).
    """
    b, n_keys = kjt.stride(), len(kjt.keys())
    dev, n = keyed.device, keyed.numel()
    bag = torch.repeat_interleave(torch.arange(n_keys * b, device=dev), kjt.lengths(), output_size=n)
    feature = torch.div(bag, b, rounding_mode="floor") if b else bag
    n_cuts = bk.block_cuts.shape[1]
    if n_cuts > 1:
        bucket = torch.searchsorted(bk.bucket_bounds, feature * KEY_SPAN + keyed, right=True) - 1
        return bag, feature, bucket, None
    bucket = bk.feature_bucket.index_select(0, feature)
    in_bag = torch.arange(n, device=dev) - kjt.offsets().index_select(0, bag)
    if n_cuts == 0:
        return bag, feature, bucket, in_bag
    block = (keyed >= bk.block_cuts.view(-1).index_select(0, feature)).long()
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


def fbgemm_payload(
    kjt: KeyedJaggedTensor, weights: torch.Tensor | None, bk: Bucketing, with_positions: bool
) -> Outgoing:
    """:func:`bucketed_payload` in one pass of fbgemm's block bucketize kernel, for ids already checked.

    Only for checked ids: fbgemm hashes an id outside its table into some block instead of keeping it out of
    range. Its output is ``[block][feature][bag]``; every route's part is a slice of it. Weights are gathered
    here (fbgemm's copy of them has no gradient, FBGEMM_CPU.md F13), by the order it reports.
    """
    b, n_keys = kjt.stride(), len(kjt.keys())
    values = kjt.values()
    n = values.numel()
    n_blocks = bk.block_bounds[0].numel() - 1 if bk.block_bounds else 1
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
        block_bucketize_pos=list(bk.block_bounds),
    )
    seg_ids = lengths.view(n_blocks * n_keys, b).sum(1).tolist() if b else [0] * (n_blocks * n_keys)
    first = offsets_of(seg_ids)  # the one host sync of the send side: the all-to-all needs split sizes
    segs = bk.route_segment
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
        positions = [order[first[s] : first[s + 1]] - opk[f] for s, f in zip(segs, bk.route_features)]
    lengths = lengths.long()
    return Outgoing(
        None,
        None,
        None,
        sent,
        positions,
        pieces=RoutePieces(
            [lengths[s * b : (s + 1) * b] for s in segs],
            [ids[first[s] : first[s + 1]] for s in segs],
            None if ws is None else [ws[first[s] : first[s + 1]] for s in segs],
        ),
    )


def bucketed_payload(
    kjt: KeyedJaggedTensor,
    weights: torch.Tensor | None,
    bk: Bucketing,
    with_positions: bool,
    row_keys: Mapping[int, RowKey] | None = None,
) -> Outgoing:
    """Every route's payload, ids bucketed by row block and made local to it: the same few ops for all features.

    Ids are ordered by (bucket, bag) (:func:`_bucket_ids`), which keeps every bucket's ids in bag order; a
    route reads its bucket's segment (a bucket read by several routes, i.e. column shards of one row block,
    is copied).
    """
    b, n_keys = kjt.stride(), len(kjt.keys())
    values = kjt.values()
    dev = values.device
    keyed, raw = _keyed(kjt, row_keys)
    bag, feature, bucket, rank = _bucket_ids(kjt, keyed, bk)
    local = keyed - bk.bucket_start[bucket]
    if raw is not None:
        local = torch.where(raw, values, local)
    n_buckets = bk.bucket_bounds.numel()
    counts, order = _slot_order(bucket * b + (bag - feature * b), n_buckets * b, rank)
    counts = counts.view(n_buckets, b)
    size = counts.sum(1)
    route_size = size[bk.route_bucket]
    sent = route_size.tolist()  # the one host sync of the send side: the all-to-all needs split sizes
    bucket_first = torch.cumsum(size, 0) - size
    gather = order[segment_gather_index(bucket_first[bk.route_bucket], route_size, total=sum(sent))]
    positions: list[torch.Tensor | None] = []
    if with_positions:
        feature_first = kjt.offsets()[torch.arange(n_keys, device=dev) * b]
        route_first = feature_first[torch.tensor(bk.route_features, dtype=torch.long, device=dev)]
        base = torch.repeat_interleave(route_first, route_size, output_size=gather.numel())
        positions = list(torch.split(gather - base, sent))
    return Outgoing(
        counts[bk.route_bucket].reshape(-1),
        local[gather],
        None if weights is None else weights[gather],
        sent,
        positions,
    )


def sorted_payload(
    kjt: KeyedJaggedTensor,
    weights: torch.Tensor | None,
    bk: Bucketing,
    with_positions: bool,
    row_keys: Mapping[int, RowKey] | None = None,
) -> Outgoing:
    """:func:`bucketed_payload` when every row block is read by one route: ids ordered by (route, bag).

    Every id gets the slot ``route * b + bag within the feature`` (ids of unrouted features after all
    routes' slots); the ids in stable slot order are the payload, the slots' histogram the routes' bag lengths.
    """
    b, n_keys = kjt.stride(), len(kjt.keys())
    values = kjt.values()
    dev = values.device
    n_routes = bk.route_row_start.numel()
    keyed, raw = _keyed(kjt, row_keys)
    bag, _, bucket, rank = _bucket_ids(kjt, keyed, bk)
    assert bk.bucket_route_rel is not None  # the caller picks this path only where it exists
    slot = (bk.bucket_route_rel * b).index_select(0, bucket) + bag
    counts, order = _slot_order(slot, (n_routes + n_keys) * b, rank)
    counts = counts[: n_routes * b]
    route_size = counts.view(n_routes, b).sum(1)
    sent = route_size.tolist()  # the one host sync of the send side: the all-to-all needs split sizes
    total = sum(sent)
    order = order[:total]
    first_row = torch.repeat_interleave(bk.route_row_start, route_size, output_size=total)
    positions: list[torch.Tensor | None] = []
    if with_positions:
        feature_first = kjt.offsets()[torch.arange(n_keys, device=dev) * b]
        route_first = feature_first[torch.tensor(bk.route_features, dtype=torch.long, device=dev)]
        positions = list(torch.split(order - torch.repeat_interleave(route_first, route_size, output_size=total), sent))
    local = keyed.index_select(0, order) - first_row
    if raw is not None:
        local = torch.where(raw.index_select(0, order), values.index_select(0, order), local)
    return Outgoing(counts, local, None if weights is None else weights.index_select(0, order), sent, positions)


def build_payload(
    kind: PayloadKind,
    kjt: KeyedJaggedTensor,
    weights: torch.Tensor | None,
    bk: Bucketing,
    with_positions: bool,
    row_keys: Mapping[int, RowKey],
) -> Outgoing:
    """This rank's payload by the builder ``kind`` (:func:`payload_kind`)."""
    if kind is PayloadKind.KJT:
        return kjt_payload(kjt, weights, bk)
    if kind is PayloadKind.FEATURE_SLICES:
        return route_payload(kjt, weights, bk)
    if kind is PayloadKind.FBGEMM_BUCKETIZE:
        return fbgemm_payload(kjt, weights, bk, with_positions)
    if kind is PayloadKind.ROUTE_SORT:
        return sorted_payload(kjt, weights, bk, with_positions, row_keys)
    return bucketed_payload(kjt, weights, bk, with_positions, row_keys)


def empty_payload(n_routes: int, b: int, device: torch.device) -> Outgoing:
    """No ids on any route (a rejected input still joins the exchange): ``b`` empty bags per route."""
    return Outgoing(
        torch.zeros(n_routes * b, dtype=torch.long, device=device),
        torch.zeros(0, dtype=torch.long, device=device),
        None,
        [0] * n_routes,
        [],
    )
