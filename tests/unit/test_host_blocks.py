"""The hierarchical output dist's host-block layouts (``pipeline/host_output_dist.py``): pure functions of the routing
and the ranks' hosts, checked on one process. The exchange is played out here with plain tensors (every rank's
pooled blocks, each aggregator's sums, each destination's placement) against adding every block into its
columns directly."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_rec.pipeline.host_output_dist import (
    aggregator,
    cross_host_elements,
    host_columns,
    host_index,
    plan_host_blocks,
    saves_bytes,
)
from lightning_rec.pipeline.routing import ColumnGroup, _put, _take, build_routing, column_placement
from lightning_rec.plans.shard_geometry import ShardMeta

HOSTS = [0, 0, 1, 1]  # 2 hosts x 2 ranks


def _routings(dims: list[int], table_shards: list, n: int) -> list:
    feature_table = list(range(len(dims)))
    out = []
    for r in range(n):
        local = sorted({t for t, shards in enumerate(table_shards) for s in shards or [] if s.rank == r})
        out.append(build_routing(feature_table, dims, table_shards, local, group_rank=r, group_size=n))
    return out


def _row_wise(rows: int, dim: int, ranks: list[int], col: int = 0) -> list[ShardMeta]:
    cuts = [rows * i // len(ranks) for i in range(len(ranks) + 1)]
    return [ShardMeta(a, b - a, col, dim, r) for a, b, r in zip(cuts, cuts[1:], ranks)]


def test_row_wise_host_blocks_add_each_hosts_two_row_blocks() -> None:
    rts = _routings([4], [_row_wise(8, 4, [0, 1, 2, 3])], 4)
    assert host_index(HOSTS) == ((0, 1), (2, 3))
    assert host_columns(rts[0], (0, 1)) == [0, 1, 2, 3]
    assert saves_bytes(rts[0], HOSTS)
    hb = plan_host_blocks(rts[0], HOSTS)
    assert hb is not None and hb.members == (0, 1) and hb.my_host == 0
    # rank 0 (index 0 on host 0) aggregates for rank 2 (index 0 on host 1); rank 1 for rank 3
    assert hb.gathers == ((2,), (3,))
    assert hb.width == (4, 4)
    # both row blocks land on the host block's 4 columns: the first is copied, the second adds
    assert hb.into == ((ColumnGroup(0, 0, 4, 1, 4),), (ColumnGroup(0, 0, 4, 1, 4),))
    assert hb.into_add == ((False,), (True,)) and not hb.block_zero
    # output: own ranks 0 and 1 (copy, add), then host 1's block (add)
    assert hb.out_add == ((), (False,), (True,), (True,)) and not hb.out_zero
    assert hb.remote == ((1, 2),)
    assert plan_host_blocks(rts[3], HOSTS).remote == ((0, 1),)  # type: ignore[union-attr]
    # flat: 2 blocks of 4 columns per remote sample; hierarchical: one
    assert cross_host_elements(rts[0], HOSTS, [5, 1, 2, 3], flat=True) == 2 * 4 * 11
    assert cross_host_elements(rts[0], HOSTS, [5, 1, 2, 3], flat=False) == 4 * 11


def test_flat_where_nothing_is_held_twice_on_a_host_or_one_host_only() -> None:
    tw = [[ShardMeta(0, 5, 0, 4, r)] for r in range(4)]
    cw = [[ShardMeta(0, 5, 2 * r, 2, r) for r in range(4)]]
    for dims, shards in (([4, 4, 4, 4], tw), ([8], cw)):
        rts = _routings(dims, shards, 4)
        assert not saves_bytes(rts[0], HOSTS)
        assert plan_host_blocks(rts[0], HOSTS) is None
        assert plan_host_blocks(rts[0], HOSTS, "hierarchical") is not None  # forced: still a valid layout
        assert cross_host_elements(rts[0], HOSTS, [1] * 4, True) == cross_host_elements(rts[0], HOSTS, [1] * 4, False)
    rts = _routings([4], [_row_wise(8, 4, [0, 1, 2, 3])], 4)
    assert plan_host_blocks(rts[0], [0, 0, 0, 0]) is None  # one host
    assert plan_host_blocks(rts[0], [0, 1, 2, 3], "hierarchical") is not None  # one rank per host: forced only
    assert plan_host_blocks(rts[0], [0, 1, 2, 3]) is None
    assert plan_host_blocks(rts[0], HOSTS, "flat") is None
    with pytest.raises(ValueError, match="mode"):
        plan_host_blocks(rts[0], HOSTS, "tree")


def test_unequal_hosts_wrap_the_aggregator_index() -> None:
    assert aggregator((4,), 1) == 4 and aggregator((0, 1), 3) == 1
    rts = _routings([4], [_row_wise(9, 4, [0, 1, 2])], 3)
    hosts = [0, 0, 1]
    # host 1 is rank 2 alone: it aggregates (for itself) both host-0 destinations
    assert plan_host_blocks(rts[2], hosts).gathers == ((0, 1),)  # type: ignore[union-attr]
    # on host 0, rank 0 (index 0) aggregates for rank 2 (index 0); rank 1 for nobody
    assert plan_host_blocks(rts[1], hosts).gathers == ((2,), ())  # type: ignore[union-attr]


def _random_layout(rng: random.Random, n: int) -> tuple[list[int], list]:
    dims, shards = [], []
    for _ in range(rng.randint(1, 5)):
        dim = rng.choice([2, 4, 6, 8])
        kind = rng.choice(["dp", "table", "row", "col", "table_row", "grid", "ragged"])
        rows = 12
        if kind == "dp":
            shards.append(None)
        elif kind == "table":
            shards.append([ShardMeta(0, rows, 0, dim, rng.randrange(n))])
        elif kind == "row":
            shards.append(_row_wise(rows, dim, list(range(n))))
        elif kind == "col":
            shards.append([ShardMeta(0, rows, c, 1, rng.randrange(n)) for c in range(dim)])
        elif kind == "table_row":
            h = rng.randrange(n // 2)
            shards.append(_row_wise(rows, dim, [2 * h, 2 * h + 1]))
        elif kind == "grid":
            half = dim // 2
            shards.append(_row_wise(rows, half, [0, 1], 0) + _row_wise(rows, dim - half, [2, 3], half))
        else:  # row blocks whose column splits differ: host blocks overlap partly (zero fill)
            shards.append(
                [ShardMeta(0, 6, 0, dim, 0), ShardMeta(6, 6, 0, 1, 1), ShardMeta(6, 6, 1, dim - 1, 2)]
                + [ShardMeta(0, 0, 0, dim, 3)]
            )
        dims.append(dim)
    return dims, shards


def _unfilled(rows: int, cols: int, zero: bool) -> torch.Tensor:
    """Zeros where the layout asks for a fill, else NaN: a column no group writes would show."""
    return torch.zeros(rows, cols) if zero else torch.full((rows, cols), float("nan"))


def _cols(rt, s: int) -> list[int]:
    return [rt.feat_off[r.feature] + r.shard.col_offset + c for r in rt.routes_to[s] for c in range(r.shard.cols)]


@pytest.mark.parametrize("seed", range(40))
def test_the_exchange_played_out_equals_every_block_added_into_its_columns(seed: int) -> None:
    rng = random.Random(seed)
    n = 4
    dims, shards = _random_layout(rng, n)
    rts = _routings(dims, shards, n)
    batches = [rng.choice([0, 1, 3]) for _ in range(n)]
    width = rts[0].feat_off[-1]
    dp_runs = column_placement(rts[0]).runs[0]
    dp_width = sum(g.n * g.runs for g in dp_runs)
    g = torch.Generator().manual_seed(seed)
    # blocks[s][d]: rank s's pooled rows for rank d's samples
    blocks = [[torch.randn(batches[d], rts[0].cols_from[s], generator=g) for d in range(n)] for s in range(n)]
    dps = [torch.randn(batches[d], dp_width, generator=g) for d in range(n)]
    plans = [plan_host_blocks(rt, HOSTS, "hierarchical") for rt in rts]
    for d in range(n):
        want = torch.zeros(batches[d], width, dtype=torch.float64)
        for s in range(n):
            for i, c in enumerate(_cols(rts[0], s)):
                want[:, c] += blocks[s][d][:, i].double()
        dp_cols = [
            c
            for grp in dp_runs
            for j in range(grp.runs)
            for c in range(grp.dst + j * grp.step, grp.dst + j * grp.step + grp.n)
        ]
        want[:, dp_cols] += dps[d].double()
        hb = plans[d]
        assert hb is not None
        out = _unfilled(batches[d], width, hb.out_zero)
        parts = [(dps[d], hb.out_runs[0], hb.out_add[0])]
        parts += [(blocks[s][d], hb.out_runs[1 + i], hb.out_add[1 + i]) for i, s in enumerate(hb.members)]
        for k, (h, a) in enumerate(hb.remote):
            agg = plans[a]
            assert agg is not None and d in agg.gathers[agg.members.index(a)]
            block = _unfilled(batches[d], agg.width[h], agg.block_zero)
            _put(block, [(blocks[s][d], agg.into[i], agg.into_add[i]) for i, s in enumerate(agg.members)])
            parts.append((block, hb.out_runs[1 + len(hb.members) + k], hb.out_add[1 + len(hb.members) + k]))
        _put(out, parts)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)
        # backward: the host block's gradient fanned out to a contributing rank equals that rank's columns
        grad = torch.randn(batches[d], width, generator=g)
        for k, (h, a) in enumerate(hb.remote):
            agg = plans[a]
            hgrad = torch.empty(batches[d], agg.width[h])  # type: ignore[union-attr]
            _take(hgrad, grad, hb.out_runs[1 + len(hb.members) + k])
            for i, s in enumerate(agg.members):  # type: ignore[union-attr]
                mine = torch.empty(batches[d], rts[0].cols_from[s])
                _take(mine, hgrad, agg.into[i])  # type: ignore[union-attr]
                torch.testing.assert_close(mine, grad[:, _cols(rts[0], s)])
