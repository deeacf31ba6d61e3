"""The planner: valid plans that fit memory, documented errors, determinism, and choices with a known answer."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingConfig, ShardingType
from lightning_rec.embedding_modules import check_tables
from lightning_rec.plans.mesh import MeshInfo, resolve_local_size
from lightning_rec.plans.plan import resolve_module_plan, resolve_table
from lightning_rec.plans.planner import OPTIMIZER_STATE, CostModel, automatic_plan, parse_bytes
from lightning_rec.sharding import (
    Planner,
    PlannerError,
    ShardingPlan,
    TableConstraint,
    Topology,
    column_wise,
    data_parallel,
    grid_shard,
    row_wise,
    table_row_wise,
    table_wise,
)

DT = (torch.float32, torch.float16, torch.bfloat16)


def _random_case(seed: int):
    rng = random.Random(seed)
    tables = [
        EmbeddingBagConfig(
            rng.choice([7, 100, 5_000, 200_000]),
            rng.choice([4, 16, 32, 64, 128]),
            f"t{i} x",
            [f"f{i}", f"g{i}"][: rng.randint(1, 2)],
            dtype=rng.choice(DT),
        )
        for i in range(rng.randint(1, 25))
    ]
    local = rng.choice([1, 2, 4])
    mp = local * rng.choice([1, 2, 4])
    replicas = rng.choice([1, 1, 2])
    need = sum(t.num_embeddings * t.embedding_dim * (t.dtype.itemsize * 2 + 8) for t in tables)  # + adam state
    memory = rng.choice([None, int(need / mp * rng.uniform(1.5, 4)) + 10**6])
    topo = Topology(mp * replicas, mp, local, device_memory=memory)
    kw = dict(
        batch_size=rng.choice([1, 64, 512]),
        default_pooling_factor=rng.choice([1.0, 5.0]),
        optimizer=rng.choice(sorted(OPTIMIZER_STATE)),
        gradients=rng.choice(["dense", "sparse"]),
    )
    return tables, topo, kw


def _weights_per_rank(tables, module_plan, topo) -> np.ndarray:
    """Independent memory of weights: rows x cols x itemsize of every resolved shard, or a full replica."""
    out = np.zeros(topo.model_parallel_size)
    for t in tables:
        shards = resolve_table(t, module_plan[t.name], topo.model_parallel_size, topo.local_size)
        if shards is None:
            out += t.num_embeddings * t.embedding_dim * t.dtype.itemsize
        else:
            for s in shards:
                out[s.rank] += s.rows * s.cols * t.dtype.itemsize
    return out


@pytest.mark.parametrize("seed", range(40))
def test_random_plans_are_valid_fit_and_deterministic(seed: int) -> None:
    tables, topo, kw = _random_case(seed)
    planner = Planner(topo, **kw)
    plan = planner.plan(tables)
    report = planner.explain()
    mod = plan.get_plan_for_module("")
    assert list(mod) == [t.name for t in tables]
    resolve_module_plan(tables, mod, topo.model_parallel_size, topo.local_size)  # raises if invalid
    weights = _weights_per_rank(tables, mod, topo)
    np.testing.assert_allclose(report.memory[0], weights)
    if topo.device_memory is not None:
        assert (report.memory.sum(0) <= topo.device_memory).all()
    # fresh objects, same inputs -> the same plan
    again = Planner(topo, **kw).plan(
        [
            EmbeddingBagConfig(t.num_embeddings, t.embedding_dim, t.name, list(t.feature_names), dtype=t.dtype)
            for t in tables
        ]
    )
    assert again == plan
    # the report describes the same plan, and estimating that plan reproduces the planner's numbers
    est = planner.estimate(tables, plan)
    np.testing.assert_allclose(est.time, report.time, rtol=1e-9)
    np.testing.assert_allclose(est.memory, report.memory, rtol=1e-9)


@pytest.mark.parametrize("seed", range(12))
def test_cost_model_layouts_match_plan_resolution(seed: int) -> None:
    # the planner's vectorized shard layouts must be the tiling plan.py resolves
    rng = random.Random(seed)
    t = EmbeddingBagConfig(rng.randint(1, 300), rng.choice([8, 16, 64]), "t", ["f"])
    topo = Topology(8, 8, rng.choice([2, 4]))
    planner = Planner(topo, batch_size=16, default_pooling_factor=3)
    model = CostModel(topo, 16)
    s = planner._stats("", t, rng.choice(["dense", "sparse"]))
    placements = [
        table_wise(rng.randrange(8)),
        row_wise(),
        column_wise([3, 1]),
        table_row_wise(1),
        grid_shard([1, 0]),
        data_parallel(),
    ]
    for ps in placements:
        a = model.of_placement(s, ps)
        b = model.of_shards(s, resolve_table(t, ps, 8, topo.local_size))
        np.testing.assert_allclose(a.time, b.time, err_msg=str(ps))
        np.testing.assert_allclose(a.mem, b.mem, err_msg=str(ps))


def test_cost_model_terms_by_hand() -> None:
    # one table-wise table on rank 1 of 2 (one host): hand-computed lookup, update and all-to-all terms
    t = EmbeddingBagConfig(1000, 16, "t", ["f"])
    topo = Topology(2)
    hw = topo.hardware
    rep = Planner(topo, batch_size=10, default_pooling_factor=3, gradients="sparse").estimate(
        [t], ShardingPlan({"": {"t": table_wise(1)}})
    )
    ids = 2 * 10 * 3  # both ranks' ids arrive at rank 1
    lookup = ids * (16 * 4 + hw.lookup_overhead_bytes) / hw.lookup_bandwidth
    update = ids * (2 * 16 * 4) / hw.update_bandwidth
    assert rep.time[0].tolist() == pytest.approx([0, lookup])
    assert rep.time[1].tolist() == pytest.approx([0, update])
    ids_bytes = 10 * (8 * 3 + 8)  # ids + lengths each rank sends; rank 1 receives rank 0's over the link
    assert rep.time[2].tolist() == pytest.approx([ids_bytes / 2 / hw.intra_host_bandwidth] * 2)
    pooled = 10 * 16 * 4  # pooled rows back to rank 0, in forward and backward
    assert rep.time[3].tolist() == pytest.approx([pooled / hw.intra_host_bandwidth] * 2)
    assert rep.memory[0].tolist() == [0, 1000 * 16 * 4]


def test_infeasible_raises_with_missing_memory_and_tables() -> None:
    tables = [EmbeddingBagConfig(1_000_000, 64, "big one", ["f"]), EmbeddingBagConfig(10, 8, "small", ["g"])]
    with pytest.raises(PlannerError, match=r"missing.*'big one'") as e:
        Planner(Topology(4, device_memory="100MB")).plan(tables)
    assert re.search(r"at least \d+(\.\d+)? MiB", str(e.value))  # sizes in human units
    # enough memory in total, but a table that may only be table-wise does not fit one rank
    only_tw = {"big one": TableConstraint(sharding_types=["table_wise"])}
    with pytest.raises(PlannerError, match=r"no placement of table \['big one'\].*missing"):
        Planner(Topology(4, device_memory="400MB"), constraints=only_tw).plan(tables)
    # the same tables fit once the planner may split the big one
    Planner(Topology(4, device_memory="400MB")).plan(tables)


def test_many_small_tables_on_a_big_world() -> None:
    tables = [EmbeddingBagConfig(500, 16, f"s{i}", [f"f{i}"]) for i in range(60)]
    planner = Planner(Topology(64, local_size=8, device="cuda"), batch_size=512)
    planner.plan(tables)
    kinds = {c.sharding.sharding_type for c in planner.explain().tables}
    assert kinds <= {ShardingType.DATA_PARALLEL, ShardingType.TABLE_WISE}


def test_one_huge_table_is_row_wise_or_grid_with_2d() -> None:
    huge = [EmbeddingBagConfig(40_000_000, 64, "huge", ["u"])]
    planner = Planner(Topology(8, device_memory="4GB"), batch_size=512)
    ps = planner.plan(huge).plan[""]["huge"]
    assert ps.sharding_type == ShardingType.ROW_WISE
    two_d = Planner(Topology(16, model_parallel_size=8, local_size=4, device_memory="4GB"), batch_size=512)
    ps = two_d.plan(huge).plan[""]["huge"]
    assert ps.sharding_type in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE, ShardingType.GRID_SHARD)


def test_a_wide_hot_table_is_column_wise() -> None:
    tables = [EmbeddingBagConfig(1000, 1024, "wide", ["w"])] + [
        EmbeddingBagConfig(1000, 32, f"n{i}", [f"n{i}"]) for i in range(3)
    ]
    planner = Planner(Topology(4), batch_size=512, pooling_factors={"w": 50})
    ps = planner.plan(tables).plan[""]["wide"]
    assert ps.sharding_type == ShardingType.COLUMN_WISE and len(ps.ranks) >= 2


@pytest.mark.parametrize("seed", range(6))
def test_balance_bound(seed: int) -> None:
    # stated bound: slowest rank <= 1.1 x mean rank + the largest single table's time on one rank
    rng = random.Random(seed)
    tables = [
        EmbeddingBagConfig(rng.choice([1000, 50_000]), rng.choice([16, 64]), f"t{i}", [f"f{i}"])
        for i in range(rng.randint(8, 40))
    ]
    planner = Planner(Topology(rng.choice([2, 4, 8])), batch_size=256, default_pooling_factor=10)
    planner.plan(tables)
    rep = planner.explain()
    t = rep.rank_time_ms
    assert t.max() <= 1.1 * t.mean() + max(c.time_ms for c in rep.tables) + 1e-9


def test_constraints_fixed_placement_and_together() -> None:
    tables = [EmbeddingBagConfig(1000 * (i + 1), 32, n, [n + "_f"]) for i, n in enumerate(["a", "b", "c", "d"])]
    planner = Planner(
        Topology(4),
        constraints={"a": TableConstraint(placement=table_wise(3)), "b": TableConstraint(sharding_types=["row_wise"])},
        together=[["c", "d"]],
    )
    mod = planner.plan(tables).plan[""]
    assert mod["a"] == table_wise(3) and mod["b"].sharding_type == ShardingType.ROW_WISE
    assert mod["c"] == mod["d"]
    rep = planner.explain()
    assert [c.fixed for c in rep.tables] == [True, False, False, False]
    with pytest.raises(ValueError, match=r"table 'a'.*outside the model-parallel group"):
        Planner(Topology(2), constraints={"a": TableConstraint(placement=table_wise(3))}).plan(tables)
    with pytest.raises(ValueError, match=r"constraints name tables \['zz'\]"):
        Planner(Topology(2), constraints={"zz": TableConstraint(sharding_types=["row_wise"])}).plan(tables)
    with pytest.raises(ValueError, match=r"pooling_factors name features \['nope'\]"):
        Planner(Topology(2), pooling_factors={"nope": 3}).plan(tables)


def test_fused_gradients_data_parallel_only_when_asked() -> None:
    tables = [EmbeddingBagConfig(10, 8, f"t{i}", [f"f{i}"]) for i in range(20)]
    planner = Planner(Topology(8), gradients="fused")
    planner.plan(tables)
    assert all(c.sharding.sharding_type != ShardingType.DATA_PARALLEL for c in planner.explain().tables)
    asked = Planner(
        Topology(2), gradients="fused", constraints={"t0": TableConstraint(sharding_types=["data_parallel"])}
    )
    asked.plan(tables)
    assert asked.explain().tables[0].sharding.sharding_type == ShardingType.DATA_PARALLEL


def test_host_memory_takes_what_devices_cannot_hold() -> None:
    tables = [EmbeddingBagConfig(4_000_000, 64, "big", ["f"]), EmbeddingBagConfig(1000, 64, "small", ["g"])]
    planner = Planner(Topology(2, device_memory="500MB", host_memory="8GB", device="cuda"))
    planner.plan(tables)
    rep = planner.explain()
    big = rep.tables[0]
    assert big.offloaded and big.sharding.compute_kernel == "fused_uvm"
    assert not rep.tables[1].offloaded
    assert rep.host_memory.sum() >= 4_000_000 * 64 * 4


def test_model_input_and_explanation() -> None:
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(100, 8, "u", ["u"]), EmbeddingBagConfig(50, 8, "i", ["i"])], sparse_grad=True
    )
    model = torch.nn.ModuleDict({"ebc": ebc, "seq": torch.nn.ModuleList()})
    planner = Planner(Topology(2))
    plan = planner.plan(model)
    assert set(plan.plan) == {"ebc"} and set(plan.plan["ebc"]) == {"u", "i"}
    rep = planner.explain()
    d = rep.as_dict()
    assert d["layout"]["model_parallel_size"] == 2 and len(d["ranks"]) == 2
    assert {t["table"] for t in d["tables"]} == {"u", "i"}
    assert all(t["runner_up"] for t in d["tables"]) and all(t["runner_up_rejected_because"] for t in d["tables"])
    text = str(rep)
    assert "estimated step time" in text and "runner-up" in text
    with pytest.raises(RuntimeError, match="call plan"):
        Planner().explain()
    seq = [EmbeddingConfig(100, 8, "s", ["s"])]
    Planner(Topology(2)).plan(seq)


def test_automatic_plan_uses_fused_spec() -> None:
    tables = [EmbeddingBagConfig(10, 8, f"t{i}", [f"f{i}"]) for i in range(6)]
    planner = automatic_plan(EmbeddingBagCollection(tables), 4, 2, 4, {"kind": "rowwise_adagrad", "lr": 0.1})
    assert planner.optimizer == "rowwise_adagrad" and planner.gradients == "fused"
    plan = planner.plan(EmbeddingBagCollection(tables))
    assert all(ps.sharding_type != ShardingType.DATA_PARALLEL for ps in plan.plan[""].values())


def test_parse_bytes_and_topology_errors() -> None:
    assert parse_bytes("80GB") == 80 * 10**9 and parse_bytes("64GiB") == 64 * 2**30 and parse_bytes(1024) == 1024
    assert parse_bytes("1.5 TB") == 1.5e12
    with pytest.raises(ValueError, match="device_memory: expected a size"):
        Topology(2, device_memory="lots")
    with pytest.raises(ValueError, match="model_parallel_size=3 must divide world_size=4"):
        Topology(4, 3)
    with pytest.raises(ValueError, match="local_size=3"):
        Topology(4, 4, 3)
    with pytest.raises(ValueError, match="unknown optimizer"):
        Planner(optimizer="rmsprop")


def test_tables_the_sharded_module_refuses_are_refused_with_its_message() -> None:
    shared = [EmbeddingBagConfig(10, 8, "a", ["f", "g"]), EmbeddingBagConfig(10, 8, "b", ["h", "f"])]
    twice = [EmbeddingBagConfig(10, 8, "a", ["f"]), EmbeddingBagConfig(10, 8, "a", ["g"])]
    for tables in (shared, twice):
        with pytest.raises(ValueError) as module_error:
            check_tables(tables)  # what the sharded collections check (the unsharded ones allow shared features)
        with pytest.raises(ValueError) as planner_error:
            Planner(Topology(2)).plan(tables)
        assert str(planner_error.value) == str(module_error.value)


def test_only_host_types_on_one_host_is_a_clear_error() -> None:
    tables = [EmbeddingBagConfig(100, 64, "a", ["f"]), EmbeddingBagConfig(100, 64, "b", ["g"])]
    only = {"a": TableConstraint(sharding_types=["table_row_wise", "grid_shard"])}
    with pytest.raises(
        PlannerError,
        match=r"table \['a'\]: no placement .*\['table_row_wise', 'grid_shard'\].*"
        r"1 host\(s\) x 4 rank\(s\)",
    ):
        Planner(Topology(4), constraints=only).plan(tables)
    with pytest.raises(PlannerError, match=r"4 host\(s\) x 1 rank\(s\)"):
        Planner(Topology(4, local_size=1), constraints=only).plan(tables)
    narrow = {"a": TableConstraint(sharding_types=["column_wise"])}
    with pytest.raises(PlannerError, match=r"column_wise and grid_shard need embedding_dim \[64\].*width=64"):
        Planner(Topology(4), constraints=narrow, min_column_width=64).plan(tables)
    # with two hosts of two ranks the same constraint has placements
    mod = Planner(Topology(4, local_size=2), constraints=only).plan(tables).plan[""]
    assert mod["a"].sharding_type in (ShardingType.TABLE_ROW_WISE, ShardingType.GRID_SHARD)


def test_sizes_beyond_int64_name_the_table() -> None:
    with pytest.raises(ValueError, match=r"table 'huge': num_embeddings=100000000000000000000 is larger"):
        Planner(Topology(2)).plan([EmbeddingBagConfig(10**20, 8, "huge", ["f"])])


def test_topology_from_mesh_reads_the_ranks_per_host() -> None:
    mesh = MeshInfo(None, None, None, 8, 2, 4)  # type: ignore[arg-type]
    topo = Topology.from_mesh(mesh, device_memory="1GB")
    assert (topo.world_size, topo.model_parallel_size, topo.local_size, topo.device_memory) == (16, 8, 4, 10**9)
    assert MeshInfo(None, None, None, 8, 1, 3).local_size == 8  # type: ignore[arg-type]  # 3 does not divide 8
    assert resolve_local_size(8, 2) == 2 and resolve_local_size(8, 16) == 8


def test_report_fits_100_columns_with_long_names_in_human_units() -> None:
    tables = [
        EmbeddingBagConfig(50_000, 64, "a_very_long_table_name_" + "x" * 40 + str(i), [f"feature {i}"])
        for i in range(6)
    ]
    planner = Planner(Topology(4, 2))
    planner.plan(tables)
    text = str(planner.explain())
    assert max(len(line) for line in text.splitlines()) <= 100, text
    assert re.search(r"\d+(\.\d+)? MiB", text) and "e-0" not in text
    assert all(t.name in text for t in tables)
