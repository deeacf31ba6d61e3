"""RecShardedStrategy(compile=...) and Trainer.fit(torch.compile(model)) at 2 processes give eager's weights."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_rec import RecShardedStrategy, ShardingPlan, full_state_dict
from lightning_rec.sharding import column_wise, data_parallel, row_wise
from lightning_rec.testing import run_distributed
from tests.lightning.models import QUIET_TRAINER, ClickModule

STEPS = 3
PLAN = ShardingPlan({"ebc": {"user": row_wise(), "item": column_wise(ranks=[1, 0]), "geo": data_parallel()}})
# aot_eager: dynamo and AOT autograd as inductor runs them, without generating C++ (seconds, not minutes)
OPTIONS = {"backend": "aot_eager"}


class _UnloggedClickModule(ClickModule):
    """ClickModule without ``self.log`` in ``training_step``: ``Trainer.fit(torch.compile(model))`` compiles
    ``training_step`` too, and dynamo (torch 2.13) fails inside Lightning's ``self.log`` with an
    InternalTorchDynamoError, on one device with the default strategy as well (not a sharding matter)."""

    def training_step(self, batch, _):
        kjt, y = batch
        return torch.nn.functional.binary_cross_entropy_with_logits(self(kjt), y)


def _fit(strategy: RecShardedStrategy, model: L.LightningModule | torch.nn.Module) -> None:
    L.Trainer(
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        **QUIET_TRAINER,
        limit_val_batches=0,
        strategy=strategy,
        use_distributed_sampler=False,
    ).fit(model)


def _job(rank: int, ws: int) -> dict:
    eager = ClickModule(plan=PLAN)
    _fit(RecShardedStrategy(), eager)
    by_strategy = ClickModule(plan=PLAN)
    strategy = RecShardedStrategy(compile=OPTIONS)
    _fit(strategy, by_strategy)
    # Lightning's usual way: compile the module, then fit (the strategy shards it before the first trace)
    by_user = _UnloggedClickModule(plan=PLAN)
    _fit(RecShardedStrategy(), torch.compile(by_user, dynamic=True, **OPTIONS))
    return {
        "states": [full_state_dict(m) for m in (eager, by_strategy, by_user)],
        "compiled": by_strategy._compiled_call_impl is not None,
        "options": strategy.compile_options,
    }


def test_compiled_fit_matches_eager() -> None:
    results = run_distributed(_job, 2, init_process_group=False, timeout_s=600)
    eager, by_strategy, by_user = results[0]["states"]
    assert results[0]["compiled"] and results[0]["options"] == {"dynamic": True, "backend": "aot_eager"}
    initial = ClickModule().state_dict()
    assert not torch.equal(eager["ebc.embedding_bags.item.weight"], initial["ebc.embedding_bags.item.weight"])
    for state in (by_strategy, by_user):
        assert set(state) == set(eager)
        for k in eager:
            torch.testing.assert_close(state[k], eager[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_compile_option_is_checked() -> None:
    with pytest.raises(TypeError, match="compile must be a bool or a dict"):
        RecShardedStrategy(compile="inductor")
    assert RecShardedStrategy(compile=True).compile_options == {"dynamic": True}
    assert RecShardedStrategy().compile_options is None
