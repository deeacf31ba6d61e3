"""SIGTERM to one rank of a rec_sharded fit stops every rank at the same step, with exit code 143, and the
checkpoints written before are intact (Lightning's own handler broadcasts from inside the handler on the
signalled rank only, and the ranks hung). Through shared memory the ranks stop before the next batch; through
gloo, where the flags travel during a batch and are read at the next, one batch later."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_rec import RecShardedStrategy, ShardingPlan, full_state_dict, row_wise, table_wise
from lightning_rec.lightning.preemption import EXIT_CODE
from lightning_rec.testing import run_distributed
from tests.lightning.models import ClickModule

PLAN = ShardingPlan({"ebc": {"user": row_wise(), "item": table_wise(rank=1), "geo": row_wise()}})


class Preempted(ClickModule):
    def __init__(self, signalled_rank: int) -> None:
        super().__init__(batch_size=4, plan=PLAN)
        self.signalled_rank = signalled_rank

    def training_step(self, batch, batch_idx):
        if batch_idx == 2 and self.global_rank == self.signalled_rank:
            os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler sends to one process
        return super().training_step(batch, batch_idx)


def _job(rank: int, ws: int, root: str, signalled_rank: int, shm: str) -> dict:
    os.environ["LIGHTNING_REC_SHM"] = shm  # before the Trainer makes the process group
    model = Preempted(signalled_rank)
    ckpt = ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=ws,
        strategy=RecShardedStrategy(),
        max_steps=10,
        logger=False,
        callbacks=[ckpt],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
    )
    code = None
    try:
        trainer.fit(model)
    except SystemExit as e:
        code = e.code
    handler_restored = signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, signal.default_int_handler, None)
    return {
        "code": code,
        "step": trainer.global_step,
        "state": full_state_dict(model) if code else None,
        "restored": handler_restored,
    }


@pytest.mark.parametrize(("signalled_rank", "shm"), [(1, "1"), (0, "1"), (1, "0")])
def test_sigterm_on_one_rank_stops_every_rank_at_the_same_step(tmp_path: Path, signalled_rank: int, shm: str) -> None:
    results = run_distributed(_job, 2, str(tmp_path), signalled_rank, shm, init_process_group=False, timeout_s=240)
    # the signalled batch (the third) finished; through gloo the flags of the fourth's start arrive at the fifth
    last = 3 if shm == "1" else 4
    for r in results:
        assert r["code"] == EXIT_CODE, r["code"]  # not 0: a preempted job did not succeed
        assert r["step"] == last, r["step"]  # no rank started a batch past that
        assert r["restored"]
    saved = sorted(p.name for p in tmp_path.iterdir())
    assert saved == [f"step={s}.ckpt" for s in range(1, last + 1)], saved
    # the last checkpoint is complete and holds the state the ranks stopped with
    from lightning_rec import checkpoint as ckpt

    model = ClickModule(batch_size=4)
    ckpt.load(tmp_path / f"step={last}.ckpt", model)
    want = results[0]["state"]
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, want[k], atol=0, rtol=0, msg=k)
