"""Where a sharded collection's rows and columns go: the routing table of its layout, and the pooled output
dist's column placement derived from it.

The routing table (which (feature, shard) pairs exist, their row blocks and widths) is built once, at sharding
time, by the pure function :func:`build_routing` from the table layout and the resolved shards; the lookups read
it, and each dist derives its own fixed state from it once, when it is built (the input dist's bucketing:
``input_payload.py``; the output dist's column placement: :func:`column_placement`, here).

The column placement says where each block of pooled rows lands in the output: a block's columns land as
:class:`ColumnGroup` s (runs of adjacent columns a fixed step apart), each group one strided copy, or add where
an earlier block wrote those columns. :func:`_put` places blocks, :func:`_take` and :func:`gathered` gather their
gradients back; the flat output dist and the hierarchical one (``output_dist.py``, ``host_output_dist.py``,
which also places rows into a host's block with them) share them.

Nothing here talks to other processes, so it is unit-tested on one process (``tests/unit/test_routing.py``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

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
    is the same on every device; what a dist derives from it once (the input dist's ``input_payload.Bucketing``,
    the output dist's :class:`ColumnPlacement`) is that dist's own.

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


class ColumnMap(str, enum.Enum):
    """How the output dist's blocks cover the output's columns (a member compares equal to its string)."""

    #: the blocks side by side are the output, column for column
    IDENTITY = "identity"
    #: every output column is written by exactly one block column, in another order
    PERMUTATION = "permutation"
    #: row blocks without a zero fill: one group writes each column first, the groups that follow add
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
class ColumnPlacement:
    """Where the blocks ``[data-parallel features], [pooled rows back from rank 0], ..., [... from rank n-1]``
    land in the collection's ``[batch, sum of dims]`` output: per block, its column groups and whether each adds
    (else copies). Tables interleaved over ranks make one group of many runs per block: one strided copy."""

    kind: ColumnMap
    runs: tuple[tuple[ColumnGroup, ...], ...]
    adds: tuple[tuple[bool, ...], ...]

    @property
    def zero_fill(self) -> bool:
        """Whether the output starts from zeros (else every column is first written by a copy)."""
        return self.kind is ColumnMap.SUM


def column_placement(routing: RoutingTable) -> ColumnPlacement:
    """The output columns of every block of ``routing``'s output dist, as column groups."""
    feat_off = routing.feat_off
    cols = [list(range(feat_off[f], feat_off[f + 1])) for f in routing.dp_features]
    for lst in routing.routes_to:
        for r in lst:
            first = feat_off[r.feature] + r.shard.col_offset
            cols.append(list(range(first, first + r.shard.cols)))
    flat_cols = [c for block in cols for c in block]
    width = feat_off[-1]
    if flat_cols == list(range(width)):
        kind = ColumnMap.IDENTITY
    elif sorted(flat_cols) == list(range(width)):
        kind = ColumnMap.PERMUTATION
    else:
        kind = ColumnMap.SUM  # row blocks of one table add up
    part_widths = [feat_off[f + 1] - feat_off[f] for f in routing.dp_features]
    sizes = [sum(part_widths), *routing.cols_from]
    runs = tuple(_runs(flat_cols[a : a + n]) for a, n in zip(offsets_of(sizes), sizes))
    adds, clean, covered = _adds(runs)
    if kind is ColumnMap.SUM and clean and covered == width:
        kind = ColumnMap.OVERLAY  # row blocks: the first block's groups are copied, no zero fill, one add fewer
    elif kind is ColumnMap.SUM:
        adds = tuple((True,) * len(groups) for groups in runs)  # all add onto zeros
    return ColumnPlacement(kind, runs, adds)


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
    blocks are laid out with the same rule as :func:`column_placement`)."""
    return _runs(cols)


def group_adds(parts: tuple[tuple[ColumnGroup, ...], ...]) -> tuple[tuple[tuple[bool, ...], ...], bool, int]:
    """Per group of ``parts`` (placed in order), whether it adds; whether no zero fill is needed where every
    column is covered; how many columns are covered (as :func:`column_placement` derives its adds)."""
    return _adds(parts)


def _group_view(t: torch.Tensor, first: int, n: int, count: int, step: int) -> torch.Tensor:
    """``[rows, count, n]`` view of ``count`` runs of ``n`` columns of the 2-D ``t``, ``step`` columns apart."""
    s0, s1 = t.stride()
    return t.as_strided((t.shape[0], count, n), (s0, step * s1, s1), t.storage_offset() + first * s1)


def _put(out: torch.Tensor, blocks: list[tuple[torch.Tensor, tuple[ColumnGroup, ...], tuple[bool, ...]]]) -> None:
    """Each ``(block, groups, adds)``'s column groups copied (or added) into ``out``, in order. A copy that the
    next group adds onto (the same columns: row blocks of a table) is one ``add`` of the two, one pass fewer
    over those columns, with the same bits (where the blocks already have ``out``'s dtype: a quantized block is
    widened by the copy, then added in ``out``'s dtype)."""
    ops = [
        (geom, _group_view(block, geom[0], geom[2], geom[3], geom[2]), add)
        for block, groups, adds in blocks
        for geom, add in zip(groups, adds)
    ]
    i = 0
    while i < len(ops):
        (_, dst, n, count, step), piece, add = ops[i]
        place = _group_view(out, dst, n, count, step)
        if (
            not add
            and i + 1 < len(ops)
            and ops[i + 1][2]
            and ops[i + 1][0][1:] == ops[i][0][1:]
            and piece.dtype == ops[i + 1][1].dtype == out.dtype
        ):
            torch.add(piece, ops[i + 1][1], out=place)
            i += 2
            continue
        if add:
            place += piece
        else:
            place.copy_(piece)
        i += 1


def _take(block: torch.Tensor, grad: torch.Tensor, groups: tuple[ColumnGroup, ...]) -> None:
    """The gradient of ``block``'s column groups, gathered from the output's gradient."""
    for src, dst, n, count, step in groups:
        _group_view(block, src, n, count, n).copy_(_group_view(grad, dst, n, count, step))


def gathered(grad: torch.Tensor, groups: tuple[ColumnGroup, ...], width: int) -> torch.Tensor:
    """The ``[rows, width]`` gradient of a block whose columns are ``groups`` of ``grad``: a strided view of
    ``grad`` where the block is one group in its own column order (no copy), else gathered into a new block."""
    if len(groups) == 1 and groups[0].src == 0 and groups[0].n * groups[0].runs == width:
        _, dst, n, count, step = groups[0]
        return _group_view(grad, dst, n, count, step)
    block = torch.empty(grad.shape[0], width, dtype=grad.dtype, device=grad.device)
    _take(block, grad, groups)
    return block
