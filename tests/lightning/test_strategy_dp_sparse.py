"""rec_sharded picks sparse gradients for data-parallel tables where the optimizer makes them exact."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_rec import RecShardedStrategy, ShardingPlan, data_parallel, full_state_dict, row_wise
from lightning_rec.testing import run_distributed
from tests.lightning.models import QUIET_TRAINER, ClickModule

STEPS = 4
PLAN = ShardingPlan({"ebc": {"user": row_wise(), "item": data_parallel(), "geo": data_parallel()}})
DP = ("ebc.embedding_bags.item.weight", "ebc.embedding_bags.geo.weight")


class _Module(ClickModule):
    def __init__(self, opt: str, **kw) -> None:
        super().__init__(**kw)
        self.opt, self.seen_sparse = opt, []

    def configure_optimizers(self):
        if self.opt == "adam":
            return torch.optim.Adam(self.parameters(), lr=0.05)
        return (torch.optim.Adagrad if self.opt == "adagrad" else torch.optim.SGD)(self.parameters(), lr=self.lr)

    def on_after_backward(self) -> None:
        params = dict(self.named_parameters())
        self.seen_sparse.append([params[n].grad.is_sparse for n in DP if n in params])


class _OwnClipping(_Module):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        pass  # a module that clips by itself would read dense norms: the tables stay dense


def _trainer(**kw) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        **QUIET_TRAINER,
        limit_val_batches=0,
        **kw,
    )


def _fit_job(rank: int, ws: int, opt: str, clip: float | None, kw: dict) -> dict:
    model = (_OwnClipping if kw.get("own_clipping") else _Module)(opt, batch_size=4, plan=PLAN)
    strategy = RecShardedStrategy(embedding_grad="mean")
    _trainer(
        devices=ws,
        strategy=strategy,
        use_distributed_sampler=False,
        gradient_clip_val=clip,
        accumulate_grad_batches=kw.get("accumulate", 1),
    ).fit(model)
    return {"state": full_state_dict(model), "sparse": model.seen_sparse}


def _reference(opt: str, ws: int, clip: float | None, kw: dict) -> dict:
    model = _Module(opt, batch_size=4 * ws)
    _trainer(devices=1, strategy="auto", gradient_clip_val=clip, accumulate_grad_batches=kw.get("accumulate", 1)).fit(
        model
    )
    return model.state_dict()


@pytest.mark.parametrize(
    "opt, clip, kw, sparse",
    [
        ("sgd", None, {}, True),
        ("adagrad", None, {}, True),
        ("adam", None, {}, False),
        ("sgd", 1e6, {}, False),  # a bound never reached: only the gradient mode differs
        ("sgd", None, {"own_clipping": True}, False),
        ("adagrad", None, {"accumulate": 2}, True),  # sparse gradients accumulate by addition: exact
    ],
    ids=["sgd", "adagrad", "adam", "clip_val", "clip_hook", "accumulate"],
)
def test_fit_data_parallel_gradients_follow_the_optimizer(opt: str, clip: float | None, kw: dict, sparse: bool) -> None:
    results = run_distributed(_fit_job, 2, opt, clip, kw, init_process_group=False, timeout_s=240)
    want = _reference(opt, 2, clip, kw)
    backwards = STEPS * kw.get("accumulate", 1)
    for r in results:
        assert len(r["sparse"]) == backwards and all(s == [sparse, sparse] for s in r["sparse"])
        for k in want:
            torch.testing.assert_close(r["state"][k], want[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
