"""Checkpoint save / load time and peak memory per rank: sharded DCP directories vs one-process torch.save.

Workload (defaults): 26 tables x 100,000 rows x 64 dims fp32 (666 MB of weights) with row-wise Adagrad-
like state (a torch Adagrad over the tables: one more table-sized tensor per table), sharded table-wise
over 2 gloo processes. Compared, on the same machine in one run:

- ``torch.save`` / ``torch.load`` of the unsharded ``state_dict`` + optimizer state on one process;
- ``lightning_rec.checkpoint.save`` / ``load`` (DCP directory) from 2 processes;
- ``lightning_rec.export.export_state_dict`` (one consolidated file, streamed) from 2 processes.

Peak memory is the growth of each process's resident memory (sampled) during the operation, on top of the
model and optimizer it already holds. Writes benchmarks/results/checkpoint.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, ShardingPlan
from lightning_rec import checkpoint as ckpt
from lightning_rec.export import export_state_dict
from lightning_rec.sharding import shard_modules, table_wise
from lightning_rec.testing import run_distributed


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _tables(n: int, rows: int, dim: int) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=dim, feature_names=[f"f{i}"])
        for i in range(n)
    ]


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adagrad(model.parameters(), lr=0.1)  # state: one "sum" per table, made here


def _timed(fn) -> tuple[float, float]:
    """Seconds, and the peak resident-memory growth over the call (sampled every 2 ms)."""
    base, peak, done = _rss_mb(), [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mb())
            time.sleep(0.002)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t = time.perf_counter()
    fn()
    dt = time.perf_counter() - t
    done.set()
    th.join()
    return dt, max(peak[0], _rss_mb()) - base


def single(n: int, rows: int, dim: int, path: str) -> dict:
    model = EmbeddingBagCollection(_tables(n, rows, dim))
    opt = _optimizer(model)
    f = os.path.join(path, "single.pt")
    save_s, save_mb = _timed(lambda: torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f))
    size = os.path.getsize(f) / 2**20

    def load() -> None:
        state = torch.load(f, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])

    load_s, load_mb = _timed(load)
    return {"save_s": save_s, "save_mb": save_mb, "load_s": load_s, "load_mb": load_mb, "size_mb": size}


def sharded(rank: int, ws: int, n: int, rows: int, dim: int, path: str) -> dict:
    plan = ShardingPlan({"": {f"t{i}": table_wise(i % ws) for i in range(n)}})
    torch.manual_seed(0)
    model = shard_modules(EmbeddingBagCollection(_tables(n, rows, dim), device="meta"), plan)
    opt = _optimizer(model)
    d = os.path.join(path, "dcp")
    torch.distributed.barrier()
    save_s, save_mb = _timed(lambda: ckpt.save(d, model, [opt]))
    torch.distributed.barrier()
    load_s, load_mb = _timed(lambda: ckpt.load(d, model, [opt]))
    torch.distributed.barrier()
    export_s, export_mb = _timed(lambda: export_state_dict(model, os.path.join(path, "export.pt")))
    size = sum(p.stat().st_size for p in Path(d).iterdir()) / 2**20
    return {
        "save_s": save_s,
        "save_mb": save_mb,
        "load_s": load_s,
        "load_mb": load_mb,
        "size_mb": size,
        "export_s": export_s,
        "export_mb": export_mb,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", type=int, default=26)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "checkpoint.md"))
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="bench_ckpt_")
    try:
        one = run_distributed(_single_job, 1, args.tables, args.rows, args.dim, tmp, timeout_s=1200)[0]
        shutil.rmtree(tmp)
        os.makedirs(tmp)
        per_rank = run_distributed(sharded, args.world, args.tables, args.rows, args.dim, tmp, timeout_s=1200)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    weights_mb = args.tables * args.rows * args.dim * 4 / 2**20
    lines = [
        "# Checkpoint save / load",
        "",
        f"Workload: {args.tables} tables x {args.rows:,} rows x {args.dim} dims fp32 ({weights_mb:.0f} MiB of weights) "
        f"+ torch Adagrad state (as large again); sharded table-wise over {args.world} gloo processes.",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        "local disk. Peak memory = growth of the process's resident memory during the operation (sampled every 2 ms).",
        "",
        "| what | save s | load s | save peak +MiB | load peak +MiB | on disk MiB |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| torch.save unsharded, 1 process | {one['save_s']:.2f} | {one['load_s']:.2f} | {one['save_mb']:.0f} | "
        f"{one['load_mb']:.0f} | {one['size_mb']:.0f} |",
    ]
    for r, res in enumerate(per_rank):
        lines.append(
            f"| DCP directory, rank {r} of {args.world} | {res['save_s']:.2f} | {res['load_s']:.2f} | "
            f"{res['save_mb']:.0f} | {res['load_mb']:.0f} | {res['size_mb']:.0f} (all ranks) |"
        )
    for r, res in enumerate(per_rank):
        lines.append(
            f"| export_state_dict (one file), rank {r} | {res['export_s']:.2f} | - | {res['export_mb']:.0f} | - | - |"
        )
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


def _single_job(rank: int, ws: int, n: int, rows: int, dim: int, path: str) -> dict:
    return single(n, rows, dim, path)


if __name__ == "__main__":
    sys.exit(main())
