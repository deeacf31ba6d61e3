"""The planner with a fused optimizer per table (issue 44): each table's state size and gradients are its own, a
per-row statistic keeps only its own table whole, and every proposed plan is one sharding accepts."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from lightning_rec.fused_kinds import as_spec
from lightning_rec.pipeline.fused_lookup import check_fused
from lightning_rec.plans.plan import resolve_table
from lightning_rec.plans.planner import Planner, automatic_plan
from lightning_rec.sharding import ShardingType

ROWWISE = as_spec({"kind": "rowwise_adagrad", "lr": 0.1})
ADAM = as_spec({"kind": "adam", "lr": 0.1})
SGD = as_spec({"kind": "sgd", "lr": 0.1})


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        wide = [EmbeddingBagConfig(50_000, 256, n, [f"f{n}"]) for n in ("rw", "adam", "sgd")]
        self.ebc = EmbeddingBagCollection(wide, device="meta")
        self.ec = EmbeddingCollection([EmbeddingConfig(40_000, 256, "plain", ["fp"])], device="meta")


SPECS = {"ebc": {"rw": ROWWISE, "adam": ADAM, "sgd": SGD}, "ec": {"plain": None}}


@pytest.mark.parametrize("world", [2, 4])
def test_each_table_is_planned_with_its_own_optimizer(world: int) -> None:
    model = _Model()
    planner = automatic_plan(model, world, world, world, table_optimizers=SPECS, min_column_width=32)
    plan = planner.plan(model)
    report = planner.explain()
    rows = {(t.module, t.table): t for t in report.tables}
    assert planner.table_optimizers == {"rw": "rowwise_adagrad", "adam": "adam", "sgd": "sgd"}
    assert planner.table_gradients == {"rw": "fused", "adam": "fused", "sgd": "fused"}
    # the row-wise table is never split by columns; the others may be (the planner is free to choose)
    assert plan.plan["ebc"]["rw"].sharding_type not in (ShardingType.COLUMN_WISE.value, ShardingType.GRID_SHARD.value)
    # every placement is one sharding accepts for the table's own spec
    for path, specs in SPECS.items():
        for name, spec in specs.items():
            if spec is None:
                continue
            t = next(c for c in model.ebc.embedding_bag_configs() if c.name == name)
            check_fused([t], {name: resolve_table(t, plan.plan[path][name], world, world)}, [spec])
    assert set(rows) == {("ebc", "rw"), ("ebc", "adam"), ("ebc", "sgd"), ("ec", "plain")}


def test_state_bytes_follow_each_tables_kind() -> None:
    tables = [EmbeddingBagConfig(10_000, 64, n, [f"f{n}"]) for n in ("rw", "adam", "sgd")]
    planner = Planner(optimizer={"rw": "rowwise_adagrad", "adam": "adam"}, gradients={"rw": "fused"})
    stats = {t.name: planner._stats("", t, "dense") for t in tables}
    assert stats["rw"].state == (0, 1) and stats["adam"].state == (2, 0) and stats["sgd"].state == (0, 0)
    with pytest.raises(ValueError, match="table t: unknown optimizer 'adamw'"):
        Planner(optimizer={"t": "adamw"})
    with pytest.raises(ValueError, match="table t: gradients must be one of"):
        Planner(gradients={"t": "fast"})
