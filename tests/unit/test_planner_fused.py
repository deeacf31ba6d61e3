"""Fused optimizers and table widths (F6): the planner proposes only plans that sharding accepts, and both name
the real cause (a width that is not a multiple of 4) and the fix."""

from __future__ import annotations

import pytest

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_rec.fused_kinds import as_spec
from lightning_rec.pipeline.fused_lookup import check_fused
from lightning_rec.plans.plan import resolve_table
from lightning_rec.plans.planner import automatic_plan
from lightning_rec.sharding import PlannerError, ShardingPlan, TableConstraint, column_wise, table_wise

SPECS = [{"kind": "sgd", "lr": 0.1}, {"kind": "adagrad", "lr": 0.1}, {"kind": "rowwise_adagrad", "lr": 0.1}]


def _tables(dim: int, n: int = 3) -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(1_000 * (i + 1), dim, f"t{i}", [f"f{i}"]) for i in range(n)]


def _sharding_accepts(tables, plan: ShardingPlan, group: int, local: int, spec) -> None:
    # what a sharded collection checks at construction, before it allocates (pipeline/sharded_collection.py)
    shards = {t.name: resolve_table(t, plan.plan[""][t.name], group, local) for t in tables}
    check_fused(tables, shards, [as_spec(spec)] * len(tables))


@pytest.mark.parametrize("dim", [6, 10, 12, 24, 36])
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("world,local", [(1, 1), (2, 2), (4, 4), (4, 2), (8, 2)])
def test_every_proposed_plan_shards_or_the_planner_says_why(dim: int, spec: dict, world: int, local: int) -> None:
    tables = _tables(dim)
    ebc = EmbeddingBagCollection(tables)
    # narrow column shards allowed, so column_wise / grid_shard candidates of every width are considered
    planner = automatic_plan(ebc, world, local, world, spec, min_column_width=2)
    if dim % 4:
        with pytest.raises(PlannerError) as err:
            planner.plan(ebc)
        message = str(err.value)
        assert "'t" in message and f"embedding_dim={dim}" in message and "multiple of 4" in message, message
        assert "embedding_optimizer=None" in message and "column shard" not in message, message
        return
    plan = planner.plan(ebc)
    _sharding_accepts(tables, plan, world, local, spec)


def test_a_column_only_table_gets_shards_fbgemm_takes() -> None:
    tables = _tables(24, 1)
    ebc = EmbeddingBagCollection(tables)
    only_columns = {"t0": TableConstraint(sharding_types=["column_wise"])}
    planner = automatic_plan(ebc, 4, 4, 4, SPECS[0], min_column_width=2, constraints=only_columns)
    plan = planner.plan(ebc)
    ps = plan.plan[""]["t0"]
    widths = [s.cols for s in resolve_table(tables[0], ps, 4, 4)]
    assert ps.sharding_type.value == "column_wise" and all(w % 4 == 0 for w in widths), widths  # 2 x 12, 3 x 8
    _sharding_accepts(tables, plan, 4, 4, SPECS[0])


def test_a_fixed_placement_sharding_would_refuse_is_a_planner_error() -> None:
    tables = _tables(24, 1)
    ebc = EmbeddingBagCollection(tables)
    fixed = {"t0": TableConstraint(placement=column_wise([0, 1, 2, 3]))}  # 4 shards of 6 columns
    with pytest.raises(PlannerError, match=r"column_wise.*'t0': a column shard of it is 6 wide.*embedding_dim=24"):
        automatic_plan(ebc, 4, 4, 4, SPECS[0], constraints=fixed).plan(ebc)
    fixed = {"t0": TableConstraint(placement=column_wise([0, 1]))}
    with pytest.raises(PlannerError, match="one statistic per row"):
        automatic_plan(ebc, 4, 4, 4, SPECS[2], constraints=fixed).plan(ebc)


def test_sharding_names_the_cause_and_the_fix() -> None:
    spec = as_spec(SPECS[0])
    six = _tables(6, 1)
    # a table-wise table is not column-split: its own width is the cause, not a column shard
    shards = {"t0": resolve_table(six[0], table_wise(1), 2, 2)}
    with pytest.raises(ValueError) as err:
        check_fused(six, shards, [spec] * len(six))
    message = str(err.value)
    assert message.startswith("table 't0': embedding_dim=6 is not a multiple of 4"), message
    assert "e.g. 4 or 8" in message and "embedding_optimizer=None" in message and "column" not in message, message
    with pytest.raises(ValueError, match="embedding_dim=6 is not a multiple of 4, which"):
        check_fused(six, {"t0": None}, [spec] * len(six))  # data-parallel: the same
    # column-split and the table itself too narrow a multiple: both causes, both fixes
    shards = {"t0": resolve_table(six[0], column_wise([0, 1]), 2, 2)}
    with pytest.raises(ValueError) as err:
        check_fused(six, shards, [spec] * len(six))
    message = str(err.value)
    assert "embedding_dim=6 is not a multiple of 4 and its column shards are [3, 3] wide" in message, message
    assert "width that is a multiple of 4" in message and "column shards that are multiples of 4" in message
    # a good width split badly: the column shards are the cause
    wide = _tables(24, 1)
    shards = {"t0": resolve_table(wide[0], column_wise([0, 1, 2, 3]), 4, 4)}
    with pytest.raises(ValueError) as err:
        check_fused(wide, shards, [spec] * len(wide))
    message = str(err.value)
    assert "a column shard of it is 6 wide (column shards [6, 6, 6, 6] of embedding_dim=24)" in message, message
    assert "choose column shards" in message and "embedding_optimizer=None" in message, message
