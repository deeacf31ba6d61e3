"""Trainer and Fabric with rec_sharded on one device, CPU or CUDA: the weights equal one plain CPU process, and
the dense part's DDP raises no warning (on CUDA, Lightning 2.6 builds DDP under a side stream, and torch >= 2.10
then warns at every backward that the AccumulateGrad nodes' stream is not backward's; we build it on the
current stream)."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric

from lightning_rec import (
    RecShardedFabricStrategy,
    RecShardedStrategy,
    ShardingPlan,
    data_parallel,
    full_state_dict,
    row_wise,
    table_wise,
)
from lightning_rec.testing import run_distributed
from tests.lightning.models import QUIET_TRAINER, ClickModule, Clicks, collate

STEPS = 4
BATCH = 4
LR = 0.2
ONE_RANK = ShardingPlan({"ebc": {"user": row_wise(), "item": table_wise(rank=0), "geo": data_parallel()}})
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
    ),
]


def _stream_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message)[:200] for w in caught if "stream" in str(w.message).lower()]


def _cpu_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in full_state_dict(model).items()}


def _trainer(accelerator: str, **kw) -> L.Trainer:
    """One device, STEPS training steps, nothing else (no logger, checkpoints, bars or validation)."""
    return L.Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=STEPS,
        **QUIET_TRAINER,
        limit_val_batches=0,
        **kw,
    )


class _DenseDevice(L.Callback):
    """Where the dense part trains (Lightning moves the module back to the CPU when fit ends)."""

    where = ""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.where = str(pl_module.head.weight.device)


def _trainer_job(rank: int, ws: int, device: str, ckpt: str) -> tuple[dict, list[str], str]:
    model = ClickModule(batch_size=BATCH, lr=LR, plan=ONE_RANK)
    seen = _DenseDevice()
    trainer = _trainer(
        "gpu" if device == "cuda" else "cpu",
        strategy=RecShardedStrategy(),
        use_distributed_sampler=False,  # Lightning's (as under "ddp") reorders samples even at one process
        callbacks=[seen],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    # what users do once fit returns: the module is back on the CPU, the process group still the device's
    trainer.save_checkpoint(ckpt)
    return _cpu_state(model), _stream_warnings(caught), seen.where


def _fabric_job(rank: int, ws: int, device: str, ckpt: str) -> tuple[dict, list[str], str]:
    fabric = Fabric(accelerator=device, devices=1, strategy=RecShardedFabricStrategy(plan=ONE_RANK))
    fabric.launch()
    model = fabric.setup_module(ClickModule())
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))
    clicks = Clicks()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(STEPS):  # the Trainer's unshuffled batches
            kjt, y = fabric.to_device(collate([clicks[i] for i in range(s * BATCH, (s + 1) * BATCH)]))
            fabric.backward(torch.nn.functional.binary_cross_entropy_with_logits(model(kjt), y))
            opt.step()
            opt.zero_grad()
    where = str(next(p for n, p in model.named_parameters() if "head" in n).device)
    return _cpu_state(model), _stream_warnings(caught), where


def _reference() -> dict[str, torch.Tensor]:
    model = ClickModule(batch_size=BATCH, lr=LR)
    _trainer("cpu", strategy="auto").fit(model)
    return model.state_dict()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("job", [_trainer_job, _fabric_job], ids=["trainer", "fabric"])
def test_one_device_fit_equals_a_plain_cpu_process_without_stream_warnings(job, device: str, tmp_path) -> None:
    ckpt = str(tmp_path / "after_fit.ckpt")
    ((got, stream_warnings, where),) = run_distributed(job, 1, device, ckpt, init_process_group=False, timeout_s=240)
    assert where.startswith(device), f"the dense part ran on {where}, not {device}"
    assert stream_warnings == [], stream_warnings
    want = _reference()
    before = ClickModule().state_dict()
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
        assert not torch.equal(got[k], before[k]), f"{k} did not train"
    if job is _trainer_job:  # the checkpoint written after fit holds the trained weights
        loaded = ClickModule.load_from_checkpoint(ckpt, weights_only=False)
        for k in want:
            torch.testing.assert_close(loaded.state_dict()[k], got[k], atol=0, rtol=0, msg=lambda m: f"{k}: {m}")
