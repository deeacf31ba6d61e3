"""The hierarchical pooled output dist: a host's row blocks added within the host before they cross to another.

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

The layouts (:class:`HostBlocks`, :func:`plan_host_blocks`) are pure functions of the routing table and the
ranks' hosts, unit-tested without processes (``tests/unit/test_host_blocks.py``). The plan is made once per
output dist (:func:`host_plan`, called by ``output_dist.PooledOutputDist`` when the collection is built, with
the mode it read from ``LIGHTNING_REC_OUTPUT_DIST``: ``flat`` on every rank keeps the flat exchange for
comparison). A rank's host is its global rank over ``LOCAL_WORLD_SIZE`` (the launchers' layout,
``transport.host_of``).

Forward, two exchanges: within the host (the host's own group, shared memory where the transport allows), each
rank sends every rank of its host its rows for that rank's samples (placed as the flat exchange places them) and
its rows for the other hosts' ranks that rank aggregates for (added into a host block there); then over the
shard group each aggregator sends its host blocks to their destinations, which place them after their own host's
blocks. Backward runs the reverse: each host block's gradient crosses once, to its aggregator, which fans it out
within the host to every block that contributed, alongside the direct gradients. Both cross-host exchanges go,
as every exchange of a group spanning hosts, as point-to-point messages with every receive posted first
(``transport.pairwise``). Blocks add in a fixed order (the data-parallel block, the own host's ranks, the other
hosts host by host; within a host block, its ranks in order), so every run gives the same bits.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from lightning_rec import _compat, transport
from lightning_rec.pipeline.routing import (
    ColumnGroup,
    ColumnPlacement,
    RoutingTable,
    _put,
    _take,
    column_groups,
    column_placement,
    gathered,
    group_adds,
)
from lightning_rec.plans.shard_geometry import offsets_of

MODES = ("auto", "flat", "hierarchical")  # plan_host_blocks's, so the values LIGHTNING_REC_OUTPUT_DIST accepts


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


Plan = tuple[HostBlocks, dist.ProcessGroup | None]
# id of shard group -> (it, weakly, and its hosts' groups by global ranks): one per host, shared by collections
_HOST_GROUPS: dict[int, tuple[weakref.ref, dict[tuple[int, ...], dist.ProcessGroup]]] = {}


def host_plan(routing: RoutingTable, placement: ColumnPlacement, group: dist.ProcessGroup, mode: str) -> Plan | None:
    """This rank's hierarchical plan and its host's group (None where the host is this rank alone), or None
    for the flat exchange (``mode``: ``LIGHTNING_REC_OUTPUT_DIST``, as the output dist read it). Called once,
    when the output dist is built; it makes the host's group (or takes the one an earlier collection of this
    shard group made), which every rank of the host reaches at the same step: building the collection."""
    ranks = dist.get_process_group_ranks(group)
    blocks = plan_host_blocks(routing, [transport.host_of(g) for g in ranks], mode, placement)
    return None if blocks is None else (blocks, _host_group(group, tuple(ranks[s] for s in blocks.members)))


def _host_group(group: dist.ProcessGroup, members: tuple[int, ...]) -> dist.ProcessGroup | None:
    if len(members) == 1:
        return None
    hit = _HOST_GROUPS.get(id(group))
    if hit is None or hit[0]() is not group:
        hit = (weakref.ref(group), {})
        _HOST_GROUPS[id(group)] = hit
    made = hit[1].get(members)
    if made is None:
        # only the host's ranks take part (the other hosts make theirs at the same forward)
        new = dist.new_group(list(members), timeout=_compat.group_timeout(group), use_local_synchronization=True)
        made = hit[1][members] = cast(dist.ProcessGroup, new)
    return made


def _within_host(
    sends: list[list[torch.Tensor]],
    sizes: list[list[int]],
    consume: Any,
    host_group: dist.ProcessGroup | None,
    device: torch.device,
) -> Any:
    if host_group is None:
        return consume([list(sends[0])])
    return transport.all_to_all_pieces(sends, sizes, consume, host_group, device).wait()


def hierarchical_output_dist(
    pooled: torch.Tensor,
    dp_pooled: torch.Tensor | None,
    routing: RoutingTable,
    plan: Plan,
    batches: Sequence[int],
    b: int,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """A call of ``output_dist.PooledOutputDist`` through the host blocks of ``plan`` (the same result as its flat
    exchange up to the order of additions)."""
    anchor = torch.zeros(0, device=pooled.device, requires_grad=torch.is_grad_enabled())
    dp = () if dp_pooled is None else (dp_pooled,)
    return _HostOutputDist.apply(pooled, anchor, routing, plan, tuple(batches), b, group, *dp)


class _HostOutputDist(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        pooled: torch.Tensor,
        anchor: torch.Tensor,
        routing: RoutingTable,
        plan: Plan,
        batches: tuple[int, ...],
        b: int,
        group: dist.ProcessGroup,
        *dp: torch.Tensor,
    ) -> torch.Tensor:
        hb, host_group = plan
        members, cols_from, device = hb.members, routing.cols_from, pooled.device
        me = members.index(routing.group_rank)
        mine_gathers = hb.gathers[me]
        width = hb.width[hb.my_host]
        out = (torch.zeros if hb.out_zero else torch.empty)(b, routing.feat_off[-1], dtype=pooled.dtype, device=device)
        flat, mine, starts = pooled.reshape(-1), pooled.shape[1], offsets_of(list(batches))

        def rows(d: int) -> torch.Tensor:
            return flat[starts[d] * mine : (starts[d] + batches[d]) * mine]

        sends = [[rows(q), *(rows(d) for d in hb.gathers[i])] for i, q in enumerate(members)]
        sizes = [[b * cols_from[s], *(batches[d] * cols_from[s] for d in mine_gathers)] for s in members]

        def place_within(got: list[list[torch.Tensor]]) -> list[torch.Tensor]:
            blocks = [(dp[0], hb.out_runs[0], hb.out_add[0])] if dp else []
            blocks += [
                (pieces[0].view(b, cols_from[s]), hb.out_runs[i + 1], hb.out_add[i + 1])
                for i, (s, pieces) in enumerate(zip(members, got))
            ]
            _put(out, blocks)
            sums = []
            for k, d in enumerate(mine_gathers):
                fill = torch.zeros if hb.block_zero else torch.empty
                block = fill(batches[d], width, dtype=out.dtype, device=device)
                parts = [
                    (pieces[1 + k].view(batches[d], cols_from[s]), hb.into[i], hb.into_add[i])
                    for i, (s, pieces) in enumerate(zip(members, got))
                ]
                _put(block, parts)
                sums.append(block)
            return sums

        n = routing.group_size
        # a piece of nothing to itself: a rank that aggregates for nobody still names the exchange's dtype
        cross: list[list[torch.Tensor]] = [[] for _ in range(n)]
        cross[routing.group_rank] = [flat[:0]]
        cross_sizes: list[list[int]] = [[] for _ in range(n)]
        cross_sizes[routing.group_rank] = [0]
        first_remote = 1 + len(members)
        with transport.stage("output_dist_fwd"):
            sums = _within_host(sends, sizes, place_within, host_group, device)
            for d, block in zip(mine_gathers, sums):
                cross[d] = [block.view(-1)]
            for h, src in hb.remote:
                cross_sizes[src] = [b * hb.width[h]]

            def place_across(got: list[list[torch.Tensor]]) -> torch.Tensor:
                _put(
                    out,
                    [
                        (got[src][0].view(b, hb.width[h]), hb.out_runs[first_remote + k], hb.out_add[first_remote + k])
                        for k, (h, src) in enumerate(hb.remote)
                    ],
                )
                return out

            transport.all_to_all_pieces(cross, cross_sizes, place_across, group, device).wait()
        ctx.routing, ctx.plan, ctx.batches, ctx.b, ctx.group, ctx.shape = routing, plan, batches, b, group, pooled.shape
        ctx.dp_shape = dp[0].shape if dp else None
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        routing, (hb, host_group), batches, b = ctx.routing, ctx.plan, ctx.batches, ctx.b
        members, cols_from, n = hb.members, routing.cols_from, routing.group_size
        me = members.index(routing.group_rank)
        width = hb.width[hb.my_host]
        first_remote = 1 + len(members)
        # across: each other host's block gradient to its aggregator; this rank's aggregated blocks come back
        cross: list[list[torch.Tensor]] = [[] for _ in range(n)]
        for k, (h, src) in enumerate(hb.remote):
            cross[src] = [gathered(grad, hb.out_runs[first_remote + k], hb.width[h])]
        back: list[list[torch.Tensor]] = [[] for _ in range(n)]
        sums = []
        for d in hb.gathers[me]:
            block = torch.empty(batches[d], width, dtype=grad.dtype, device=grad.device)
            back[d] = [block]
            sums.append(block)
        grad_pooled = torch.empty(ctx.shape, dtype=grad.dtype, device=grad.device)
        starts = offsets_of(list(batches))

        def rows(d: int) -> torch.Tensor:
            return grad_pooled[starts[d] : starts[d] + batches[d]]

        with transport.stage("output_dist_bwd"):
            transport.all_to_all_views(cross, back, ctx.group)
            # within the host: each rank's direct gradient and its share of every aggregated block
            sends = [
                [
                    gathered(grad, hb.out_runs[1 + i], cols_from[q]),
                    *(gathered(block, hb.into[i], cols_from[q]) for block in sums),
                ]
                for i, q in enumerate(members)
            ]
            recvs = [[rows(s), *(rows(d) for d in hb.gathers[i])] for i, s in enumerate(members)]
            if host_group is None:
                for got, want in zip(sends[0], recvs[0]):
                    want.copy_(got.reshape(want.shape))
            else:
                transport.all_to_all_views(sends, recvs, host_group)
        grad_dp = None
        if ctx.dp_shape is not None:
            dp_runs = hb.out_runs[0]  # the flat placement's data-parallel block
            whole = b * sum(g.n * g.runs for g in dp_runs) == ctx.dp_shape.numel()
            grad_dp = (torch.empty if whole else torch.zeros)(ctx.dp_shape, dtype=grad.dtype, device=grad.device)
            _take(grad_dp, grad, dp_runs)
        return (grad_pooled if ctx.needs_input_grad[0] else None), None, None, None, None, None, None, grad_dp
