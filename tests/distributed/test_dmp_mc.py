"""DistributedModelParallel over a model with managed collision and dense parameters equals one process.

DDP must leave the remap state alone (each rank remaps its own buckets): broadcasting rank 0's would overwrite
the other ranks' remaps before every forward.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_rec.distributed import DistributedModelParallel
from lightning_rec.sharding import ShardingPlan, full_state_dict, row_wise
from lightning_rec.testing import run_distributed
from tests.distributed.test_mc_sharded import BAGS, FEATURES, STEPS, _global_batch, _kjt, _model, _slice

LR = 0.25


class _WithDense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mc = _model(return_remapped=False)
        torch.manual_seed(1)
        self.head = nn.Linear(12, 1)  # 3 features x 4 dims

    def forward(self, kjt):
        pooled, _ = self.mc(kjt)
        return self.head(pooled.values()).squeeze(1)


def _train(model, rank: int, ws: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        out = model(_kjt(_slice(_global_batch(step), rank, ws)))
        # each rank's loss is the mean over its bags; embedding_grad="mean" and DDP's average make it the global mean
        (out.sum() / (BAGS // ws)).backward()
        opt.step()


def _dmp_job(rank: int, ws: int) -> dict:
    plan = ShardingPlan({"mc._embedding_module": {"a": row_wise([32, 32]), "b.x": row_wise([16, 16])}})
    model = DistributedModelParallel(_WithDense(), plan=plan, embedding_grad="mean")
    _train(model, rank, ws)
    return {k: v.clone() for k, v in full_state_dict(model.module).items() if not k.endswith("_mch_generation")}


def test_dmp_with_managed_collision_and_dense_parameters_equals_one_process() -> None:
    got = run_distributed(_dmp_job, 2, timeout_s=180)[0]
    ref = _WithDense()
    _train(ref, 0, 1)
    want = {k: v for k, v in ref.state_dict().items() if not k.endswith("_mch_generation")}
    assert set(got) == set(want) and FEATURES
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
