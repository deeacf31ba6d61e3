"""What a rank sends in the input dist: every route's bag lengths, ids (local to the route's row block) and
weights, built by one of a few payload builders (:class:`PayloadKind`).

Which builder serves a collection follows from its layout (and whether ids were checked, and raw managed-
collision ids), so :func:`payload_kind` decides it once, when the input dist is built
(``input_dist.InputDist``); per batch only the KJT and its weights come in. The builders read the layout's
:class:`~lightning_rec.pipeline.bucketing.Bucketing`, which the input dist owns. Nothing here talks to other
processes: ``tests/unit/test_input_dist.py`` checks every builder against a loop over routes and bags.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from lightning_rec.kernels import has_fbgemm_op, load_fbgemm
from lightning_rec.pipeline.bucketing import Bucketing
from lightning_rec.pipeline.routing import KEY_SPAN
from lightning_rec.plans.shard_geometry import offsets_of
from lightning_rec.sparse import KeyedJaggedTensor, segment_gather_index

RowKey = Callable[[torch.Tensor], torch.Tensor]  # raw ids -> a global row of the block that owns each id


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
