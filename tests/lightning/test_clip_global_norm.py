"""Norm clipping under rec_sharded scales every rank by the norm over all tables: the one-process answer."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_rec import (
    RecShardedStrategy,
    ShardingPlan,
    column_wise,
    data_parallel,
    full_state_dict,
    row_wise,
    table_wise,
)
from lightning_rec.testing import run_distributed
from tests.lightning.models import QUIET_TRAINER, ClickModule

STEPS = 4
CLIP = 0.05  # well below the gradient norms of this job: every step is clipped
PLANS = {
    "row_table_dp": ShardingPlan({"ebc": {"user": row_wise(), "item": table_wise(rank=1), "geo": data_parallel()}}),
    "column": ShardingPlan({"ebc": {"user": column_wise(ranks=[0, 1]), "item": row_wise(), "geo": table_wise(rank=0)}}),
}


class _Module(ClickModule):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _trainer(**kw) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        **QUIET_TRAINER,
        limit_val_batches=0,
        gradient_clip_val=CLIP,
        **kw,
    )


def _fit_job(rank: int, ws: int, plan: str, algorithm: str) -> dict:
    model = _Module(batch_size=4, plan=PLANS[plan])
    _trainer(
        devices=ws,
        strategy=RecShardedStrategy(embedding_grad="mean"),
        use_distributed_sampler=False,
        gradient_clip_algorithm=algorithm,
    ).fit(model)
    return full_state_dict(model)


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_clipped_training_matches_one_process(plan: str, algorithm: str) -> None:
    results = run_distributed(_fit_job, 2, plan, algorithm, init_process_group=False, timeout_s=240)
    reference = _Module(batch_size=8)
    _trainer(devices=1, strategy="auto", gradient_clip_algorithm=algorithm).fit(reference)
    want = reference.state_dict()
    unclipped = _Module(batch_size=8)
    L.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        **QUIET_TRAINER,
        limit_val_batches=0,
    ).fit(unclipped)
    # the bound is reached: clipping changed the outcome, so the comparison below tests it
    assert not torch.allclose(unclipped.state_dict()["head.weight"], want["head.weight"], atol=1e-4)
    for rank, got in enumerate(results):
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-5, msg=lambda m: f"rank {rank} {k}: {m}")
