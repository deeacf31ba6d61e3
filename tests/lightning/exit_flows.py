"""Short 2-process jobs that end the way users' scripts end, for checking how every rank exits.

``python -m tests.lightning.exit_flows FLOW OUT``: one rank's script (Lightning's launcher starts the other when
the environment names no rank). :func:`run_once` runs one flow and returns what every process it can see
returned. Used by ``tests/lightning/test_exit_codes.py`` and ``benchmarks/stress_exit.py``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLOWS = ("fit", "fit_save", "fit_eval", "fit_state", "fabric_save")
# not a user's flow: rank 1 fails after a fit that rank 0 finishes cleanly
RANK_1_FAILS = "rank_1_fails"
ABORT_MARKS = ("terminate called", "Aborted", "core dumped", "Fatal Python error")


def child(flow: str, out: str) -> None:
    import lightning as L
    import torch

    from lightning_rec import (
        RecShardedFabricStrategy,
        RecShardedStrategy,
        ShardingPlan,
        data_parallel,
        full_state_dict,
        row_wise,
        table_wise,
    )
    from lightning_rec.transport import inflight
    from tests.lightning.models import ClickModule

    plan = ShardingPlan({"ebc": {"user": row_wise(), "item": table_wise(rank=1), "geo": data_parallel()}})
    if flow == "fabric_save":
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=RecShardedFabricStrategy(plan=plan))
        fabric.launch()
        model = fabric.setup_module(ClickModule())
        opt = fabric.setup_optimizers(torch.optim.Adagrad(model.parameters(), lr=0.1))
        loader = fabric.setup_dataloaders(ClickModule().val_dataloader())
        for kjt, y in loader:
            fabric.backward(torch.nn.functional.binary_cross_entropy_with_logits(model(kjt), y))
            opt.step()
            opt.zero_grad()
        fabric.save(os.path.join(out, "fabric"), {"model": model, "optimizer": opt})
        _check_settled(inflight.outstanding())
        return
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=RecShardedStrategy(),
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
        num_sanity_val_steps=0,
    )
    model = ClickModule(plan=plan)
    trainer.fit(model)
    if flow == "fit_save":
        trainer.save_checkpoint(os.path.join(out, "ckpt"))
    elif flow == "fit_eval":
        trainer.validate(model, verbose=False)
        trainer.test(model, verbose=False)
        trainer.predict(model)
    elif flow == "fit_state":
        full_state_dict(model)
    _check_settled(inflight.outstanding())
    if flow == RANK_1_FAILS and trainer.global_rank == 1:
        sys.exit(5)


def _check_settled(outstanding: int) -> None:
    if outstanding:  # each one a collective still running on gloo's threads while the interpreter exits
        sys.exit(f"{outstanding} asynchronous collectives were never waited for")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def aborted(stderr: str) -> bool:
    return any(m in stderr for m in ABORT_MARKS)


def run_once(flow: str, launch: str, out: str, timeout: float = 300) -> tuple[list[int], list[str]]:
    """Exit codes and stderr of the processes the caller sees: both ranks (``external``, started here as
    torchrun would) or the launching process (``lightning``: Lightning's launcher starts rank 1)."""
    cmd = [sys.executable, "-m", "tests.lightning.exit_flows", flow, out]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if launch == "lightning":
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
        return [p.returncode], [p.stderr]
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()), WORLD_SIZE="2", NODE_RANK="0")
    procs = [
        subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in range(2)
    ]
    errs = [p.communicate(timeout=timeout)[1] for p in procs]
    return [p.returncode for p in procs], errs


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])
