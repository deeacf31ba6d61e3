"""The planner's choice and its estimates, on the plans it rejected; the automatic plan under the strategy.

Whether the estimates match measured step times is a timing question for ``benchmarks/bench_planner.py``
(results in ``benchmarks/results/planner.md``); a wall-clock comparison here failed on a loaded machine.
"""

from __future__ import annotations

import pytest
import torch

from lightning_rec import EmbeddingBagConfig
from lightning_rec.sharding import Planner, ShardingPlan, Topology, data_parallel, row_wise, table_wise
from lightning_rec.testing import run_distributed
from tests.lightning.models import QUIET_TRAINER

N_TABLES, ROWS, DIM, BATCH, IDS = 8, 20_000, 32, 512, 10


def _tables() -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(ROWS, DIM, f"t{i}", [f"f{i}"]) for i in range(N_TABLES)]


def test_planner_choice_is_the_models_best_of_the_rejected_plans() -> None:
    world = 2
    planner = Planner(Topology(world), batch_size=BATCH, default_pooling_factor=IDS, gradients="sparse")
    plans = {
        "planner": planner.plan(_tables()),
        "data_parallel": ShardingPlan({"": {f"t{i}": data_parallel() for i in range(N_TABLES)}}),
        "row_wise": ShardingPlan({"": {f"t{i}": row_wise() for i in range(N_TABLES)}}),
        "table_wise": ShardingPlan({"": {f"t{i}": table_wise(i % world) for i in range(N_TABLES)}}),
    }
    est = {k: planner.estimate(_tables(), p).step_time_ms for k, p in plans.items()}
    for name in plans:
        assert est[name] >= est["planner"] - 1e-9, f"the planner's plan is not the model's best: {est}"


def _fit_with_summary(rank: int, world: int, tables_optimizer: str) -> dict:
    import lightning as L

    from lightning_rec.lightning.callbacks import ShardingSummary
    from lightning_rec.optim import CombinedOptimizer
    from lightning_rec.pipeline.sharded_collection import ShardedCollection
    from tests.lightning.models import ClickModule

    class TwoOptimizers(ClickModule):
        # as the DLRM: Adam for the dense layers, another optimizer for the tables
        def configure_optimizers(self):
            tables = list(self.ebc.parameters())
            dense = [p for p in self.parameters() if all(p is not q for q in tables)]
            kind = torch.optim.Adagrad if tables_optimizer == "adagrad" else torch.optim.SGD
            return CombinedOptimizer([torch.optim.Adam(dense, lr=0.01), kind(tables, lr=self.lr)])

    model = TwoOptimizers(batch_size=4, plan=None)  # no plan: the strategy asks the planner
    summary = ShardingSummary()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="rec_sharded",
        max_steps=2,
        **QUIET_TRAINER,
        limit_val_batches=0,
        callbacks=[summary],
    )
    trainer.fit(model)
    ebc = next(m for m in model.modules() if isinstance(m, ShardedCollection))
    local_bytes = sum(p.numel() * p.element_size() for p in ebc.parameters())
    rep, chosen = summary.last_report, trainer.strategy.plan_report
    return {
        "local_bytes": local_bytes,
        "weights": rep.memory[0].tolist(),
        "text": str(rep),
        "tables": [c.table for c in rep.tables],
        "summary": (rep.settings, rep.memory.tolist(), str(rep)),
        "strategy": (chosen.settings, chosen.memory.tolist(), str(chosen)),
    }


@pytest.mark.slow
@pytest.mark.parametrize("tables_optimizer", ["adagrad", "sgd"])
def test_strategy_plans_automatically_and_summary_reports_real_memory(tables_optimizer: str) -> None:
    results = run_distributed(_fit_with_summary, 2, tables_optimizer, init_process_group=False, timeout_s=240)
    # the summary's weight memory of each rank is what that rank actually allocated
    for rank, r in enumerate(results):
        assert r["weights"][rank] == r["local_bytes"], r["text"]
    assert results[0]["tables"] == ["user", "item", "geo"] and "per rank" in results[0]["text"]
    # the strategy's report of its automatic plan and the summary name the tables' optimizer (not the dense
    # Adam) and the same memory
    (s_settings, s_memory, s_text), (c_settings, c_memory, c_text) = results[0]["summary"], results[0]["strategy"]
    assert s_settings["optimizer"] == c_settings["optimizer"] == tables_optimizer, (s_text, c_text)
    assert s_memory == c_memory, (s_text, c_text)
    peak = [line for line in s_text.splitlines() if line.startswith("peak memory")]
    assert peak and peak == [line for line in c_text.splitlines() if line.startswith("peak memory")]
