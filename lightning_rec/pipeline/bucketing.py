"""The input dist's fixed state: how every route's ids are found in a batch (:class:`Bucketing`).

Derived once from a :class:`~lightning_rec.pipeline.routing.RoutingTable` by the pure function
:func:`build_bucketing`, when the input dist is built (``input_dist.InputDist``), and moved with it to another
device; the payload builders (``input_payload.py``) read it per batch. Nothing here talks to other processes,
so it is unit-tested on one process (``tests/unit/test_input_dist.py``, ``tests/unit/test_routing.py``).

A *bucket* is one row block of one feature, feature-major; a feature no route reads (a data-parallel table's)
is one bucket no route reads. Row blocks of every feature live in one key space,
``feature * KEY_SPAN + row`` (``routing.KEY_SPAN``), so one searchsorted buckets the ids of all features.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from lightning_rec.pipeline.routing import KEY_SPAN, RoutingTable

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
