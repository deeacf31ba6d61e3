"""The layouts of the hierarchical pooled output dist: which columns each host sends another host's ranks.

Row blocks of one table held by several ranks of one host each send a destination on another host their
partial pooled rows for the same output columns; the flat exchange sends every one of them across. The
hierarchical exchange adds them on the source host first, so each (feature, column) crosses once per host
pair and destination sample (docs/ARCHITECTURE.md, "What crosses between hosts"):

* a *host block* of host ``H`` is, per sample, every output column some rank of ``H`` holds a shard of,
  in output-column order (the same for every destination: routes do not depend on the sample's rank);
* for destination rank ``d`` on another host, the *aggregator* of ``H`` is ``H``'s rank with ``d``'s index
  within its own host: every rank of ``H`` sends it its rows for ``d`` (within the host), it adds them into
  the host block and sends that to ``d`` (the one cross-host message of the pair ``(H, d)``);
* ``d`` places its own host's blocks as the flat exchange does, then each other host's block, host by host.

Everything here is a pure function of the routing table and the ranks' hosts, built once per collection and
unit-tested without processes (``tests/unit/test_host_blocks.py``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_rec.pipeline.routing import (
    ColumnGroup,
    ColumnPlacement,
    RoutingTable,
    column_groups,
    column_placement,
    group_adds,
)

ENV = "LIGHTNING_REC_OUTPUT_DIST"  # "flat" | "hierarchical" | "auto" (default); the same on every rank
MODES = ("auto", "flat", "hierarchical")


@dataclass(frozen=True)
class HostBlocks:
    """One rank's part of the hierarchical exchange. Ranks are ranks of the shard group; a *member* is a rank
    of this rank's host, indexed by its position there (the host group's rank)."""

    hosts: tuple[tuple[int, ...], ...]  # each host's ranks, ascending; hosts ordered by their lowest rank
    my_host: int
    # per member: the destinations on other hosts it aggregates for, ascending (the order of their pieces)
    gathers: tuple[tuple[int, ...], ...]
    width: tuple[int, ...]  # each host block's width
    # per member: its block's columns -> this host's block, and whether each group adds (member order)
    into: tuple[tuple[ColumnGroup, ...], ...]
    into_add: tuple[tuple[bool, ...], ...]
    block_zero: bool  # the host block needs a zero fill (column ranges of members overlap partly)
    # the output's parts in placement order: the data-parallel block, each member's block, then every
    # other host's block (host order); each part's column groups and adds, as ColumnPlacement's
    out_runs: tuple[tuple[ColumnGroup, ...], ...]
    out_add: tuple[tuple[bool, ...], ...]
    out_zero: bool
    # per other host, in placement order: (host index, the rank that sends this rank that host's block)
    remote: tuple[tuple[int, int], ...]

    @property
    def members(self) -> tuple[int, ...]:
        return self.hosts[self.my_host]


def host_index(hosts: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """``hosts[r]`` (any host label of rank ``r``) -> the ranks of each host, hosts ordered by lowest rank."""
    order: dict[int, list[int]] = {}
    for r, h in enumerate(hosts):
        order.setdefault(h, []).append(r)
    return tuple(tuple(rs) for rs in order.values())


def _cols_of(routing: RoutingTable, rank: int) -> list[int]:
    """The output columns of rank ``rank``'s pooled block, in its column order."""
    out: list[int] = []
    for r in routing.routes_to[rank]:
        first = routing.feat_off[r.feature] + r.shard.col_offset
        out.extend(range(first, first + r.shard.cols))
    return out


def host_columns(routing: RoutingTable, ranks: Sequence[int]) -> list[int]:
    """The output columns a host of ``ranks`` holds a shard of, ascending: its host block's columns."""
    return sorted({c for s in ranks for c in _cols_of(routing, s)})


def aggregator(members: Sequence[int], index_of_dest: int) -> int:
    """The rank of a host (``members``) that adds up the host's rows for a destination with that index in its
    own host (hosts of unequal size wrap around)."""
    return members[index_of_dest % len(members)]


def cross_host_elements(routing: RoutingTable, hosts: Sequence[int], batches: Sequence[int], flat: bool) -> int:
    """Elements the pooled output dist sends between hosts, one direction (backward sends as many back):
    flat, every rank's block to every destination on another host; hierarchical, one host block each."""
    groups = host_index(hosts)
    total = 0
    for d, b in enumerate(batches):
        for members in groups:
            if hosts[members[0]] == hosts[d]:
                continue
            if flat:
                total += b * sum(routing.cols_from[s] for s in members)
            else:
                total += b * len(host_columns(routing, members))
    return total


def saves_bytes(routing: RoutingTable, hosts: Sequence[int]) -> bool:
    """Whether some host holds a column twice (row blocks on two of its ranks) and another host exists to
    send it to: only then does adding within the host first cross fewer bytes."""
    groups = host_index(hosts)
    if len(groups) < 2:
        return False
    return any(sum(routing.cols_from[s] for s in m) > len(host_columns(routing, m)) for m in groups)


def mode_from_env() -> str:
    """``LIGHTNING_REC_OUTPUT_DIST`` now (empty: ``auto``); raises naming the accepted values for any other.
    Sharding reads it first, on every rank, to check that all ranks agree (``agreement.settings``)."""
    mode = os.environ.get(ENV, "auto") or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def plan_host_blocks(
    routing: RoutingTable, hosts: Sequence[int], mode: str = "auto", placement: ColumnPlacement | None = None
) -> HostBlocks | None:
    """This rank's :class:`HostBlocks`, or None where the flat exchange is used: one host, ``mode="flat"``, or
    (``"auto"``) no host holds a column twice. ``hosts[r]``: the host of shard-group rank ``r``; every rank
    must pass the same ``hosts`` and ``mode`` (the choice is then the same everywhere). ``placement``: the flat
    exchange's (:func:`~lightning_rec.pipeline.routing.column_placement` of ``routing``, derived if not given)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    groups = host_index(hosts)
    if mode == "flat" or len(groups) < 2 or (mode == "auto" and not saves_bytes(routing, hosts)):
        return None
    me = routing.group_rank
    my_host = next(h for h, m in enumerate(groups) if me in m)
    members = groups[my_host]
    index_in_host = {r: i for m in groups for i, r in enumerate(m)}
    gathers = tuple(
        tuple(d for d in range(len(hosts)) if d not in members and aggregator(members, index_in_host[d]) == q)
        for q in members
    )
    block_cols = [host_columns(routing, m) for m in groups]
    pos = {c: i for i, c in enumerate(block_cols[my_host])}
    into = tuple(column_groups([pos[c] for c in _cols_of(routing, s)]) for s in members)
    into_add, clean, _ = group_adds(into)
    block_zero = not clean
    if block_zero:
        into_add = tuple((True,) * len(g) for g in into)
    others = [h for h in range(len(groups)) if h != my_host]
    runs = (placement or column_placement(routing)).runs
    out_runs = (
        runs[0],
        *(runs[s + 1] for s in members),
        *(column_groups(block_cols[h]) for h in others),
    )
    out_add, clean, covered = group_adds(out_runs)
    out_zero = not clean or covered != routing.feat_off[-1]
    if out_zero:
        out_add = tuple((True,) * len(g) for g in out_runs)
    return HostBlocks(
        hosts=groups,
        my_host=my_host,
        gathers=gathers,
        width=tuple(len(c) for c in block_cols),
        into=into,
        into_add=into_add,
        block_zero=block_zero,
        out_runs=out_runs,
        out_add=out_add,
        out_zero=out_zero,
        remote=tuple((h, aggregator(groups[h], index_in_host[me])) for h in others),
    )
