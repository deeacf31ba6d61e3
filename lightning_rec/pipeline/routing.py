"""The routing table of a sharded collection: which (feature, shard) pairs exist, their row blocks and widths.

Built once, at sharding time, by the pure function :func:`build_routing` from the table layout and the
resolved shards; the lookups read it, and each dist derives its own fixed state from it once, when it is
built (the input dist's bucketing: ``input_payload.py``; the output dist's column placement: ``placement.py``).
Nothing here talks to other processes, so it is unit-tested on one process (``tests/unit/test_routing.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_rec.plans.shard_geometry import ShardMeta, offsets_of

# Row blocks of every feature live in one key space, ``feature * KEY_SPAN + row``, so that one searchsorted
# buckets the ids of all features at once. An id outside its table (only possible with checks off) keeps
# an out-of-range local id wherever it lands, so the owner's kernel still refuses it.
KEY_SPAN = 1 << 42


@dataclass(frozen=True)
class Route:
    """Feature ``feature`` (config order) looked up in the shard ``shard`` of table ``table``."""

    feature: int
    table: int
    shard: ShardMeta


@dataclass(frozen=True)
class RoutingTable:
    """The routing facts of one rank of the shard group: routes, row blocks, columns. Holds no tensor, so it
    is the same on every device; what a dist derives from it once (the input dist's bucketing, the output
    dist's column placement) is that dist's own (``input_payload.py``, ``placement.py``).

    ``routes_to[r]`` are the routes whose shard rank ``r`` owns, sorted by (table, feature): the order of
    the all-to-all payloads to (and back from) rank ``r``.
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

    @property
    def group_size(self) -> int:
        return len(self.routes_to)

    @property
    def num_features(self) -> int:
        return len(self.feat_off) - 1

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


def build_routing(
    feature_table: Sequence[int],
    dims: Sequence[int],
    table_shards: Sequence[Sequence[ShardMeta] | None],
    local_tables: Sequence[int],
    group_rank: int,
    group_size: int,
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
    if len(feature_table) >= (1 << 62) // KEY_SPAN or any(
        s.row_offset + s.rows > KEY_SPAN for shards in table_shards for s in shards or []
    ):
        raise ValueError(f"more than {(1 << 62) // KEY_SPAN} features or a table of more than {KEY_SPAN} rows")
    local_index = {ti: k for k, ti in enumerate(local_tables)}
    dp_tables = tuple(ti for ti, shards in enumerate(table_shards) if shards is None)
    return RoutingTable(
        group_rank=group_rank,
        routes_to=tuple(tuple(lst) for lst in routes_to),
        row_starts=row_starts,
        block_of=block_of,
        my_route_table=tuple(local_index[r.table] for r in routes_to[group_rank]),
        cols_from=tuple(sum(r.shard.cols for r in lst) for lst in routes_to),
        dp_tables=dp_tables,
        dp_features=tuple(f for f, ti in enumerate(feature_table) if ti in set(dp_tables)),
        feat_off=tuple(offsets_of(list(dims))),
    )
