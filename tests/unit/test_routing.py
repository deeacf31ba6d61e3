"""The routing table is a pure function of the layout: checked here on one process, no process group."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from lightning_rec import _compat
from lightning_rec.pipeline.agreement import _mismatch_message, agreement_text, describe_table, settings
from lightning_rec.pipeline.input_dist import Received, regroup
from lightning_rec.pipeline.input_payload import build_bucketing
from lightning_rec.pipeline.routing import Route, _put, _runs, _take, build_routing, column_placement
from lightning_rec.plans.shard_geometry import ShardMeta


def _colmap(rt) -> list[int]:
    """The output column of every column of the concatenated blocks, from the output placement's runs."""
    return [
        dst + j * step + i
        for groups in column_placement(rt).runs
        for _, dst, n, count, step in groups
        for j in range(count)
        for i in range(n)
    ]


def _row_wise_10() -> list[ShardMeta]:
    # docs/ARCHITECTURE.md's walk-through: 10 rows, rows 0-4 on rank 0, rows 5-9 on rank 1
    return [ShardMeta(0, 5, 0, 4, 0), ShardMeta(5, 5, 0, 4, 1)]


def test_row_wise_routes_blocks_and_columns() -> None:
    shards = _row_wise_10()
    rt = build_routing([0], [4], [shards], [0], group_rank=0, group_size=2)
    assert rt.routes_to == ((Route(0, 0, shards[0]),), (Route(0, 0, shards[1]),))
    assert rt.my_routes == (Route(0, 0, shards[0]),)
    assert rt.row_starts == {0: (0, 5)}
    assert rt.block_of == {(0, 0): 0, (0, 5): 1}
    assert rt.my_route_table == (0,)
    assert rt.cols_from == (4, 4)
    assert rt.dp_tables == () and rt.dp_features == ()
    # both row blocks land on the same 4 output columns: their partial sums add up
    assert _colmap(rt) == [0, 1, 2, 3, 0, 1, 2, 3]
    placement = column_placement(rt)
    assert placement.runs == ((), ((0, 0, 4, 1, 4),), ((0, 0, 4, 1, 4),))
    # the first row block is copied into place, the second adds onto it: no zero fill
    assert placement.kind == "overlay" and placement.adds == ((), (False,), (True,)) and not placement.zero_fill
    assert rt.has_model_parallel and rt.group_size == 2


def test_data_parallel_and_column_shards_map_onto_output_columns() -> None:
    # features: a (dp table 0, width 2), b and c (table 1 column-wise 2+4 on ranks 1 and 0)
    cw = [ShardMeta(0, 3, 0, 2, 1), ShardMeta(0, 3, 2, 4, 0)]
    rt = build_routing([0, 1, 1], [2, 6, 6], [None, cw], [1], group_rank=0, group_size=2)
    assert rt.dp_tables == (0,) and rt.dp_features == (0,)
    assert rt.feat_off == (0, 2, 8, 14)
    # rank 0 owns columns 2-5 of table 1 for features b and c; rank 1 columns 0-1
    assert [r.feature for r in rt.routes_to[0]] == [1, 2] and [r.feature for r in rt.routes_to[1]] == [1, 2]
    assert rt.cols_from == (8, 4)
    assert rt.my_route_table == (0, 0)
    want = [0, 1] + [4, 5, 6, 7] + [10, 11, 12, 13] + [2, 3] + [8, 9]
    assert _colmap(rt) == want
    # every output column is covered exactly once when no table is row-split
    assert sorted(want) == list(range(14))
    # the same map as runs of adjacent columns, per part (data-parallel block, rank 0's, rank 1's)
    # (each rank's two runs land 6 columns apart: one strided group)
    assert column_placement(rt).runs == (((0, 0, 2, 1, 2),), ((0, 4, 4, 2, 6),), ((0, 2, 2, 2, 6),))


def test_zero_row_shards_get_no_route_and_routes_sort_by_table() -> None:
    rw = [ShardMeta(0, 0, 0, 2, 0), ShardMeta(0, 3, 0, 2, 1)]
    tw = [ShardMeta(0, 4, 0, 2, 1)]
    rt = build_routing([1, 0], [2, 2], [rw, tw], [0, 1], group_rank=1, group_size=2)
    assert rt.routes_to[0] == ()
    assert [(r.table, r.feature) for r in rt.routes_to[1]] == [(0, 1), (1, 0)]
    assert rt.row_starts == {0: (0,), 1: (0,)}
    assert rt.cols_from == (0, 4)


def test_no_model_parallel_when_every_table_is_replicated() -> None:
    rt = build_routing([0, 0], [3, 3], [None], [], group_rank=0, group_size=3)
    assert not rt.has_model_parallel and rt.cols_from == (0, 0, 0)
    assert _colmap(rt) == list(range(6))


def test_shard_outside_the_group_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 2, outside the group of 2"):
        build_routing([0], [4], [[ShardMeta(0, 3, 0, 4, 2)]], [], group_rank=0, group_size=2)


def test_routing_table_is_frozen_and_its_bucketing_follows_the_device() -> None:
    rt = build_routing([0], [4], [_row_wise_10()], [0], group_rank=0, group_size=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rt.group_rank = 1  # type: ignore[misc]
    bucketing = build_bucketing(rt)
    with pytest.raises(dataclasses.FrozenInstanceError):
        bucketing.single_block = True  # type: ignore[misc]
    # the walk-through's table: two row blocks of feature 0 (keys 0 and 5), a route to each
    assert bucketing.bucket_start.tolist() == [0, 5] and bucketing.route_bucket.tolist() == [0, 1]
    assert not bucketing.single_block and bucketing.route_features == (0, 0)
    moved = bucketing.to("meta")
    assert moved.bucket_start.device.type == "meta" and bucketing.bucket_start.device.type == "cpu"
    assert all(t.device.type == "meta" for t in moved.block_bounds) and moved.route_segment == bucketing.route_segment
    # built directly on a device, under another default device: nothing lands on the default
    with torch.device("meta"):
        on_cpu = build_bucketing(build_routing([0], [4], [_row_wise_10()], [0], 0, 2), device="cpu")
    assert on_cpu.bucket_start.device.type == "cpu" and on_cpu.block_cuts.device.type == "cpu"


def test_regroup_swaps_outer_and_inner_segments() -> None:
    # [outer][inner] with 2 outer, 3 inner segments of sizes 1,0,2 | 2,1,0
    x = torch.tensor([10, 20, 21, 30, 31, 40])
    out = regroup(x, [1, 0, 2, 2, 1, 0], 2, 3)
    assert out.tolist() == [10, 30, 31, 40, 20, 21]


def test_received_ids_per_route_sums_over_sources() -> None:
    empty = torch.zeros(0)
    recv = Received(empty, empty, None, ids_from=[[1, 2], [3, 4], [0, 5]], positions=[], sent=[])
    assert recv.ids_per_route() == [4, 11]
    assert Received(empty, empty, None, ids_from=[[], []], positions=[], sent=[]).ids_per_route() == []


def test_placement_device_always_has_an_index() -> None:
    assert _compat.indexed_device("cpu") == torch.device("cpu")
    assert _compat.indexed_device(torch.device("meta")) == torch.device("meta")
    if torch.cuda.is_available():
        assert _compat.indexed_device("cuda").index == torch.cuda.current_device()


def test_table_descriptions_differ_exactly_when_layouts_differ() -> None:
    from lightning_rec import EmbeddingBagConfig

    t = EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=4, feature_names=["f"])
    a = describe_table(t, [ShardMeta(0, 3, 0, 4, 0), ShardMeta(3, 7, 0, 4, 1)])
    b = describe_table(t, [ShardMeta(0, 5, 0, 4, 0), ShardMeta(5, 5, 0, 4, 1)])
    assert a != b and a == describe_table(t, [ShardMeta(0, 3, 0, 4, 0), ShardMeta(3, 7, 0, 4, 1)])
    assert describe_table(t, None) != a
    env = {"LIGHTNING_REC_OUTPUT_DIST": "auto"}
    msg = _mismatch_message(
        {0: ({("", "t"): a}, "o", env), 1: ({("", "t"): b}, "o", env), 2: ({("", "t"): a}, "o", env)}
    )
    assert "table 't'" in msg and "ranks [0, 2]" in msg and "rank 1:" in msg and "sharding options" not in msg
    assert "LIGHTNING_REC" not in msg  # the settings agree


def test_ranks_compare_the_collective_settings_and_name_the_variable_that_differs() -> None:
    tables = {("", "t"): "rows=10"}
    flat = {"LIGHTNING_REC_OUTPUT_DIST": "flat", "LIGHTNING_REC_PAIRWISE": "auto"}
    auto = {**flat, "LIGHTNING_REC_OUTPUT_DIST": "auto"}
    assert agreement_text(tables, "o", flat) == agreement_text(tables, "o", dict(flat))
    assert agreement_text(tables, "o", flat) != agreement_text(tables, "o", auto)
    assert agreement_text(tables, "o", flat) != agreement_text(tables, "o", {**flat, "LIGHTNING_REC_PAIRWISE": "0"})
    msg = _mismatch_message({0: (tables, "o", flat), 1: (tables, "o", auto), 2: (tables, "o", flat)})
    assert "LIGHTNING_REC_OUTPUT_DIST: ranks [0, 2] have 'flat', rank 1 has 'auto': set it alike on every rank" in msg
    assert "LIGHTNING_REC_PAIRWISE" not in msg and "table 't'" not in msg and "sharding options" not in msg


def test_unknown_settings_raise_naming_the_variable_and_the_accepted_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_rec import transport

    monkeypatch.delenv("LIGHTNING_REC_OUTPUT_DIST", raising=False)
    monkeypatch.setattr(transport, "_PAIRWISE_SET", "auto")
    assert settings() == {"LIGHTNING_REC_OUTPUT_DIST": "auto", "LIGHTNING_REC_PAIRWISE": "auto"}
    monkeypatch.setenv("LIGHTNING_REC_OUTPUT_DIST", "bogus")
    with pytest.raises(
        ValueError, match=r"LIGHTNING_REC_OUTPUT_DIST='bogus': expected one of auto, flat, hierarchical"
    ):
        settings()
    monkeypatch.setenv("LIGHTNING_REC_OUTPUT_DIST", "flat")
    monkeypatch.setattr(transport, "_PAIRWISE_SET", "yes")
    with pytest.raises(ValueError, match=r"LIGHTNING_REC_PAIRWISE='yes': expected one of auto, 0, 1"):
        settings()
    # read at import: a later change of the variable does not reach this process's exchanges
    monkeypatch.setattr(transport, "_PAIRWISE_SET", "0")
    monkeypatch.setenv("LIGHTNING_REC_PAIRWISE", "1")
    assert settings()["LIGHTNING_REC_PAIRWISE"] == "0" and not transport._pairwise(None, None)


def _random_routing(seed: int):
    """Rank 0's routing of 1-4 tables over 3 ranks: whole tables, row blocks, column shards, data-parallel."""
    rng = random.Random(seed)
    feature_table, dims, shards = [], [], []
    for t in range(rng.randint(1, 4)):
        dim = rng.choice([2, 3, 4])
        kind = rng.choice(["table", "rows", "cols", "dp"])
        if kind == "dp":
            shards.append(None)
        elif kind == "table":
            shards.append([ShardMeta(0, 6, 0, dim, rng.randrange(3))])
        elif kind == "rows":
            shards.append([ShardMeta(0, 3, 0, dim, 0), ShardMeta(3, 3, 0, dim, rng.randrange(1, 3))])
        else:
            cut = rng.randint(1, dim - 1)
            shards.append([ShardMeta(0, 6, 0, cut, 2), ShardMeta(0, 6, cut, dim - cut, rng.randrange(2))])
        for _ in range(rng.randint(1, 2)):
            feature_table.append(t)
            dims.append(dim)
    local = [t for t, sh in enumerate(shards) if sh and any(s.rank == 0 for s in sh)]
    return build_routing(feature_table, dims, shards, local, group_rank=0, group_size=3), sum(dims)


SEEDS = range(12)


def test_place_columns_cases_cover_every_kind() -> None:
    kinds = {column_placement(_random_routing(seed)[0]).kind for seed in SEEDS}
    assert kinds == {"identity", "permutation", "overlay", "sum"}


@pytest.mark.parametrize("seed", SEEDS)
def test_place_columns_by_runs_matches_index_add(seed: int) -> None:
    # the output placement (groups of column runs, copied or added, then gathered back for the gradient)
    # against a per-column reference: index_add for the values, index_select for each block's gradient
    rt, width = _random_routing(seed)
    placement = column_placement(rt)
    b = 5
    widths = [sum(n * count for _, _, n, count, _ in groups) for groups in placement.runs]
    assert widths[1:] == list(rt.cols_from)
    blocks = [torch.randn(b, w, dtype=torch.float64) for w in widths]
    out = (torch.zeros if placement.zero_fill else torch.empty)(b, width, dtype=torch.float64)
    _put(out, list(zip(blocks, placement.runs, placement.adds)))
    ref = torch.zeros(b, width, dtype=torch.float64)
    # every block's output columns straight from the routes (independent of the groups)
    off = rt.feat_off
    cols_of = [[c for f in rt.dp_features for c in range(off[f], off[f + 1])]] + [
        [off[r.feature] + r.shard.col_offset + c for r in routes for c in range(r.shard.cols)]
        for routes in rt.routes_to
    ]
    for block, cols in zip(blocks, cols_of):
        if cols:
            ref = ref.index_add(1, torch.tensor(cols), block)
    assert torch.allclose(out, ref)
    grad = torch.randn(b, width, dtype=torch.float64)
    for groups, cols, w in zip(placement.runs, cols_of, widths):
        got = torch.full((b, w), float("nan"), dtype=torch.float64)
        _take(got, grad, groups)
        assert torch.equal(got, grad.index_select(1, torch.tensor(cols, dtype=torch.long)))


def test_column_runs_group_interleaved_tables() -> None:
    # tables alternating over two ranks: each rank's block lands as one group of equal runs, one step apart
    assert _runs([0, 1, 4, 5, 8, 9]) == ((0, 0, 2, 3, 4),)
    assert _runs([0, 1, 2, 3]) == ((0, 0, 4, 1, 4),)
    assert _runs([4, 5, 0, 1]) == ((0, 4, 2, 1, 2), (2, 0, 2, 1, 2))  # backwards: two groups
    assert _runs([0, 1, 4, 5, 8, 9, 10, 11]) == ((0, 0, 2, 2, 4), (4, 8, 4, 1, 4))


@pytest.mark.parametrize("seed", range(20))
def test_column_run_groups_expand_to_the_columns(seed: int) -> None:
    # random block layouts (runs of random widths, shuffled): the groups give back every column's place
    rng = random.Random(seed)
    widths = [rng.choice([1, 2, 2, 3]) for _ in range(rng.randint(1, 8))]
    firsts = [sum(widths[:i]) for i in range(len(widths))]
    order = list(range(len(widths)))
    rng.shuffle(order)
    cols = [firsts[k] + i for k in order for i in range(widths[k])]
    groups = _runs(cols)
    assert [dst + j * step + i for _, dst, n, count, step in groups for j in range(count) for i in range(n)] == cols
    assert [src + j * n + i for src, _, n, count, _ in groups for j in range(count) for i in range(n)] == list(
        range(len(cols))
    )
    assert all(step >= n for _, _, n, _, step in groups)
