"""Short 2-process Lightning fits in a row: every rank of every run must exit 0 with nothing on stderr about
an abort (``terminate called ...``). Not part of ``make test``: ``python benchmarks/stress_exit.py --runs 200``.

Each run is ``python benchmarks/stress_exit.py --child``: Lightning's own launcher starts the second rank,
fits a sharded click model for a few steps through the shared-memory transport, and exits.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child() -> None:
    sys.path.insert(0, str(ROOT))
    import lightning as L

    from lightning_rec import RecShardedStrategy, ShardingPlan, data_parallel, row_wise, table_wise
    from tests.lightning.models import ClickModule

    plan = ShardingPlan({"ebc": {"user": row_wise(), "item": table_wise(rank=1), "geo": data_parallel()}})
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
    trainer.fit(ClickModule(plan=plan))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    if args.child:
        child()
        return
    bad, t0 = [], time.monotonic()
    for i in range(args.runs):
        p = subprocess.run(
            [sys.executable, __file__, "--child"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        aborted = "terminate called" in p.stderr or "Aborted" in p.stderr
        if p.returncode != 0 or aborted:
            bad.append((i, p.returncode, p.stderr[-2000:]))
            print(f"run {i}: exit {p.returncode}\n{p.stderr[-2000:]}", flush=True)
        else:
            print(f"run {i}: ok ({time.monotonic() - t0:.0f} s)", flush=True)  # a stopped run still tells how far
    print(
        f"{args.runs - len(bad)} of {args.runs} runs exited 0 on every rank with no abort "
        f"({time.monotonic() - t0:.0f} s)"
    )
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
