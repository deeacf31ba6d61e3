"""The routing table of a sharded collection: which (feature, shard) pairs exist and where their columns go.

Built once, at sharding time, by the pure function :func:`build_routing` from the table layout and the
resolved shards; the input dist, lookup and output dist only read it. Nothing here talks to other
processes, so it is unit-tested on one process (``tests/unit/test_routing.py``).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from lightning_rec.plans.shard_geometry import ShardMeta, offsets_of

# Row blocks of every feature live in one key space, ``feature * KEY_SPAN + row``, so that one searchsorted
# buckets the ids of all features at once. An id outside its table (only possible with checks off) keeps
# an out-of-range local id wherever it lands, so the owner's kernel still refuses it.
KEY_SPAN = 1 << 42
_NO_END = (1 << 63) - 1  # the block end of a feature no route reads: every id lands in its first block


def _empty_long() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.long)


class ColumnMap(str, enum.Enum):
    """How the output dist's blocks cover the output's columns (a member compares equal to its string)."""

    #: the blocks side by side are the output, column for column
    IDENTITY = "identity"
    #: every output column is written by exactly one block column, in another order
    PERMUTATION = "permutation"
    #: row blocks without a zero fill: one group writes each column first, the groups in ``colmap_add`` add
    OVERLAY = "overlay"
    #: every group adds onto a zero-filled output
    SUM = "sum"


class ColumnGroup(NamedTuple):
    """``runs`` runs of ``n`` adjacent columns of a block, consecutive there, landing ``step`` columns apart in
    the output: one strided copy (or add)."""

    src: int  # first column in the block
    dst: int  # first column in the output
    n: int
    runs: int
    step: int


@dataclass(frozen=True)
class Route:
    """Feature ``feature`` (config order) looked up in the shard ``shard`` of table ``table``."""

    feature: int
    table: int
    shard: ShardMeta


@dataclass(frozen=True)
class RoutingTable:
    """Everything the pipeline needs to know about routes, for one rank of the shard group.

    ``routes_to[r]`` are the routes whose shard rank ``r`` owns, sorted by (table, feature): the order of
    the all-to-all payloads to (and back from) rank ``r``. ``colmap_runs`` maps the columns of the blocks
    ``[data-parallel features], [pooled rows back from rank 0], ..., [... from rank n-1]`` onto the columns
    of the collection's output. Its tensors live on the module's device (:meth:`to`).
    """

    group_rank: int
    routes_to: tuple[tuple[Route, ...], ...]
    row_starts: Mapping[int, tuple[int, ...]]  # table -> first row of each non-empty row block, ascending
    block_of: Mapping[tuple[int, int], int]  # (table, row_offset) -> index of the row block
    my_route_table: tuple[int, ...]  # for each of this rank's routes: index of the local shard it reads
    cols_from: tuple[int, ...]  # width of the pooled rows each rank sends back per sample
    dp_tables: tuple[int, ...]  # data-parallel tables, config order
    dp_features: tuple[int, ...]  # features of data-parallel tables, config order
    feat_off: tuple[int, ...]  # first output column of each feature, plus the total width
    # static maps of the hot path, computed here once rather than per step:
    route_features: tuple[int, ...] = ()  # the feature of every route of ``all_routes``, in that order
    single_block: bool = False  # every routed table is one row block from row 0: ids need no bucketing
    colmap_kind: ColumnMap = ColumnMap.SUM
    # where each block's columns land in the output (data-parallel block, then each rank's), as column groups
    # (tables interleaved over ranks make one group of many runs: one strided copy)
    colmap_runs: tuple[tuple[ColumnGroup, ...], ...] = ()
    colmap_add: tuple[tuple[bool, ...], ...] = ()  # per group of ``colmap_runs``: adds (else copies)
    # vectorised bucketing (row blocks): a *bucket* is one row block of one feature, feature-major; a feature
    # of a data-parallel table is one bucket no route reads
    bucket_bounds: torch.Tensor = field(default_factory=_empty_long)  # first key of every bucket, ascending
    bucket_start: torch.Tensor = field(default_factory=_empty_long)  # first row of every bucket's block
    route_bucket: torch.Tensor = field(default_factory=_empty_long)  # the bucket of every route of all_routes
    route_row_start: torch.Tensor = field(default_factory=_empty_long)  # first row of every route's block
    feature_bucket: torch.Tensor = field(default_factory=_empty_long)  # first bucket of every feature
    # [features, most row blocks of a feature - 1]: the first row of every block after a feature's first,
    # padded with KEY_SPAN: an id's block within its feature is how many of its row's cuts it reaches
    block_cuts: torch.Tensor = field(default_factory=_empty_long)
    # fbgemm's block bucketize: per feature, its blocks' first rows and end (as many entries for every feature:
    # fewer blocks end in empty ones), and per route the (block, feature) segment of its output it reads
    block_bounds: tuple[torch.Tensor, ...] = ()
    route_segment: tuple[int, ...] = ()
    # when no bucket is read by two routes (no column shards of a row block): per bucket, its route minus its
    # feature (unread buckets: the number of routes), so that ``value * batch + bag`` (bag counted over all
    # features) is an id's (route, bag) slot, every unread feature's slots after all routes' ones
    bucket_route_rel: torch.Tensor | None = None
    routes_in_order: bool = False  # the routes read every feature once, in order: the payload is the KJT itself
    rows_fit_int32: bool = False  # every sharded table has at most 2**31 rows: its checked ids are int32s

    @property
    def group_size(self) -> int:
        return len(self.routes_to)

    @property
    def my_routes(self) -> tuple[Route, ...]:
        return self.routes_to[self.group_rank]

    @property
    def has_model_parallel(self) -> bool:
        """Whether any feature reads a shard (otherwise the dists are skipped)."""
        return any(self.routes_to)

    @property
    def all_routes(self) -> list[Route]:
        """Every route, destination-rank-major (the order of the senders' payloads)."""
        return [r for lst in self.routes_to for r in lst]

    def to(self, device: torch.device | str) -> RoutingTable:
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


def build_routing(
    feature_table: Sequence[int],
    dims: Sequence[int],
    table_shards: Sequence[Sequence[ShardMeta] | None],
    local_tables: Sequence[int],
    group_rank: int,
    group_size: int,
    device: torch.device | str = "cpu",
) -> RoutingTable:
    """The routing table of one rank.

    ``feature_table[f]`` is feature ``f``'s table, ``dims[f]`` its width; ``table_shards[t]`` every shard
    of table ``t`` (``None`` for a data-parallel table); ``local_tables`` the table of each shard this rank
    holds, in the order of its local shards. Zero-row shards get no route: they receive no ids.
    """
    row_starts: dict[int, tuple[int, ...]] = {}
    block_of: dict[tuple[int, int], int] = {}
    for ti, shards in enumerate(table_shards):
        if shards is None:
            continue
        starts = tuple(sorted({s.row_offset for s in shards if s.rows > 0}))
        row_starts[ti] = starts
        for b, start in enumerate(starts):
            block_of[(ti, start)] = b
    routes_to: list[list[Route]] = [[] for _ in range(group_size)]
    for f, ti in enumerate(feature_table):
        for s in table_shards[ti] or []:
            if s.rows > 0:
                if not 0 <= s.rank < group_size:
                    raise ValueError(f"a shard of table {ti} sits on rank {s.rank}, outside the group of {group_size}")
                routes_to[s.rank].append(Route(f, ti, s))
    for lst in routes_to:
        lst.sort(key=lambda r: (r.table, r.feature))
    local_index = {ti: k for k, ti in enumerate(local_tables)}
    mine = routes_to[group_rank]
    dp_tables = tuple(ti for ti, shards in enumerate(table_shards) if shards is None)
    dp_features = tuple(f for f, ti in enumerate(feature_table) if ti in set(dp_tables))
    feat_off = tuple(offsets_of(list(dims)))
    cols = [list(range(feat_off[f], feat_off[f + 1])) for f in dp_features]
    for lst in routes_to:
        for r in lst:
            first = feat_off[r.feature] + r.shard.col_offset
            cols.append(list(range(first, first + r.shard.cols)))
    flat_cols = [c for block in cols for c in block]
    width = feat_off[-1]
    if flat_cols == list(range(width)):
        colmap_kind = ColumnMap.IDENTITY
    elif sorted(flat_cols) == list(range(width)):
        colmap_kind = ColumnMap.PERMUTATION
    else:
        colmap_kind = ColumnMap.SUM  # row blocks of one table add up
    part_widths = [feat_off[f + 1] - feat_off[f] for f in dp_features]
    sizes = [sum(part_widths)] + [sum(r.shard.cols for r in lst) for lst in routes_to]
    colmap_runs = tuple(_runs(flat_cols[a : a + n]) for a, n in zip(offsets_of(sizes), sizes))
    colmap_add, clean, covered = _adds(colmap_runs)
    if colmap_kind is ColumnMap.SUM and clean and covered == width:
        colmap_kind = ColumnMap.OVERLAY  # row blocks: the first block's groups are copied, no zero fill, one add fewer
    elif colmap_kind is ColumnMap.SUM:
        colmap_add = tuple((True,) * len(groups) for groups in colmap_runs)  # all add onto zeros
    cols_from = tuple(sum(r.shard.cols for r in lst) for lst in routes_to)
    routed_tables = {r.table for lst in routes_to for r in lst}
    single_block = all(row_starts[t] == (0,) for t in routed_tables)
    bounds: list[int] = []
    starts_of_buckets: list[int] = []
    first_bucket: list[int] = []
    for f, ti in enumerate(feature_table):
        first_bucket.append(len(bounds))
        for start in row_starts.get(ti, (0,)) if ti in routed_tables else (0,):
            bounds.append(f * KEY_SPAN + start)
            starts_of_buckets.append(start)
    all_routes = [r for lst in routes_to for r in lst]
    route_bucket = [first_bucket[r.feature] + block_of[(r.table, r.shard.row_offset)] for r in all_routes]
    bucket_feature = [
        f for f in range(len(feature_table)) for _ in range((first_bucket + [len(bounds)])[f + 1] - first_bucket[f])
    ]
    rel = [len(all_routes)] * len(bucket_feature)
    for i, bk in enumerate(route_bucket):
        rel[bk] = i - bucket_feature[bk]
    per_feature = [
        [start for bf, start in zip(bucket_feature, starts_of_buckets) if bf == f][1:]
        for f in range(len(feature_table))
    ]
    n_cuts = max((len(c) for c in per_feature), default=0)
    cuts = [c + [KEY_SPAN] * (n_cuts - len(c)) for c in per_feature]
    ends = [max((s.row_offset + s.rows for s in table_shards[ti] or []), default=_NO_END) for ti in feature_table]
    ends = [e if ti in routed_tables else _NO_END for e, ti in zip(ends, feature_table)]
    block_bounds = tuple(
        torch.tensor([0, *c, *[e] * (1 + n_cuts - len(c))], dtype=torch.long, device=device)
        for c, e in zip(per_feature, ends)
    )
    route_segment = tuple(
        (bk - first_bucket[r.feature]) * len(feature_table) + r.feature for bk, r in zip(route_bucket, all_routes)
    )
    unique = len(set(route_bucket)) == len(route_bucket)
    if len(feature_table) >= (1 << 62) // KEY_SPAN or any(
        s.row_offset + s.rows > KEY_SPAN for shards in table_shards for s in shards or []
    ):
        raise ValueError(f"more than {(1 << 62) // KEY_SPAN} features or a table of more than {KEY_SPAN} rows")
    return RoutingTable(
        group_rank=group_rank,
        routes_to=tuple(tuple(lst) for lst in routes_to),
        row_starts=row_starts,
        block_of=block_of,
        my_route_table=tuple(local_index[r.table] for r in mine),
        cols_from=cols_from,
        dp_tables=dp_tables,
        dp_features=dp_features,
        feat_off=feat_off,
        route_features=tuple(r.feature for lst in routes_to for r in lst),
        single_block=single_block,
        colmap_kind=colmap_kind,
        colmap_runs=colmap_runs,
        colmap_add=colmap_add,
        bucket_bounds=torch.tensor(bounds, dtype=torch.long, device=device),
        bucket_start=torch.tensor(starts_of_buckets, dtype=torch.long, device=device),
        route_bucket=torch.tensor(route_bucket, dtype=torch.long, device=device),
        route_row_start=torch.tensor([r.shard.row_offset for r in all_routes], dtype=torch.long, device=device),
        feature_bucket=torch.tensor(first_bucket, dtype=torch.long, device=device),
        block_bounds=block_bounds,
        route_segment=route_segment,
        rows_fit_int32=all(s.row_offset + s.rows <= 1 << 31 for shards in table_shards for s in shards or []),
        block_cuts=torch.tensor(cuts, dtype=torch.long, device=device).view(len(feature_table), n_cuts),
        bucket_route_rel=torch.tensor(rel, dtype=torch.long, device=device) if unique and rel else None,
        routes_in_order=[r.feature for r in all_routes] == list(range(len(feature_table))),
    )


def _runs(cols: list[int]) -> tuple[ColumnGroup, ...]:
    """``cols[i]`` (where column ``i`` of a part goes) as column groups: ``count`` equal runs of adjacent
    columns whose starts lie ``step`` apart in the output."""
    runs: list[list[int]] = []
    for i, c in enumerate(cols):
        if runs and runs[-1][1] + runs[-1][2] == c:
            runs[-1][2] += 1
        else:
            runs.append([i, c, 1])
    groups: list[list[int]] = []
    for a, c, n in runs:
        g = groups[-1] if groups else None
        # a run joins the group before it if it has the group's width and lands one step further (a group
        # of one run takes its step from the second)
        if g is not None and g[2] == n and ((g[3] == 1 and c > g[1] + n) or c == g[1] + g[3] * g[4]):
            if g[3] == 1:
                g[4] = c - g[1]
            g[3] += 1
        else:
            groups.append([a, c, n, 1, n])
    return tuple(ColumnGroup(a, c, n, k, step) for a, c, n, k, step in groups)


def _adds(groups_per_part: tuple[tuple[ColumnGroup, ...], ...]) -> tuple[tuple[tuple[bool, ...], ...], bool, int]:
    """Per group, whether its columns were written by an earlier group (in part order): it must add. Also
    whether every group's columns were either all written or all fresh, and how many columns the groups
    cover: with both, the output needs no zero fill (fresh groups copy, the others add)."""
    written: set[int] = set()
    adds, clean = [], True
    for groups in groups_per_part:
        part = []
        for _, dst, n, count, step in groups:
            cols = {dst + j * step + i for j in range(count) for i in range(n)}
            hit = len(cols & written)
            clean = clean and hit in (0, len(cols))
            part.append(hit > 0)
            written |= cols
        adds.append(tuple(part))
    return tuple(adds), clean, len(written)


def column_groups(cols: list[int]) -> tuple[ColumnGroup, ...]:
    """Where each column of a block goes (``cols[i]``), as column groups (the hierarchical output dist's host
    blocks are laid out with the same rule as ``colmap_runs``)."""
    return _runs(cols)


def group_adds(parts: tuple[tuple[ColumnGroup, ...], ...]) -> tuple[tuple[tuple[bool, ...], ...], bool, int]:
    """Per group of ``parts`` (placed in order), whether it adds; whether no zero fill is needed where every
    column is covered; how many columns are covered (as ``colmap_add`` is derived)."""
    return _adds(parts)
