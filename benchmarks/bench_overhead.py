"""Per-step overhead of a sharded fused collection on one process, against the bare fbgemm kernel step.

Both run in the same process on the same batches, alternating step by step, so the ratio is immune to
slow drifts of a shared machine. Jobs (batch 1,024, bags of 10..30 ids, Zipf-like ids, one feature per
table, fused exact SGD, one thread):

* ``big``: 8 tables x 100,000 x 64.
* ``dlrm``: 26 tables of mixed sizes (1,000 .. 100,000 rows) x 64.

``ours`` is ``shard_modules(ebc, plan, embedding_optimizer=sgd)`` on a gloo group of one process (each
plan below); ``bare`` is fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen`` called directly on the KJT's
values and offsets (no checks, no KeyedTensor). Reported: median forward and median step (forward +
backward + ``step()``) in ms, and ours / bare.

Usage:
    python benchmarks/bench_overhead.py [--steps 30] [--jobs big,dlrm] [--plans table_wise,row_wise]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from lightning_rec.kernels._capability import fbgemm_training
from lightning_rec.sharding import (
    ShardingPlan,
    data_parallel,
    fused_optimizer,
    row_wise,
    shard_modules,
    table_wise,
)

JOBS = {
    "big": [100_000] * 8,
    "dlrm": [
        100_000,
        50_000,
        20_000,
        10_000,
        5_000,
        2_000,
        1_000,
        100_000,
        30_000,
        3_000,
        8_000,
        60_000,
        4_000,
        100_000,
        40_000,
        1_500,
        25_000,
        7_000,
        90_000,
        2_500,
        15_000,
        70_000,
        1_200,
        12_000,
        6_000,
        80_000,
    ],
}
PLANS = {"table_wise": lambda: table_wise(0), "row_wise": row_wise, "data_parallel": data_parallel}


def make_batches(rows: list[int], batch: int, n: int, seed: int = 0) -> list[KeyedJaggedTensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.randint(10, 31, (len(rows) * batch,), generator=gen)
        per = lengths.view(len(rows), batch).sum(1).tolist()
        vals = []
        for r, k in zip(rows, per):
            u = torch.rand(k, generator=gen, dtype=torch.float64)
            vals.append(((r**u - 1).long().clamp_(0, r - 1) * 7919) % r)  # Zipf-like, scattered
        out.append(KeyedJaggedTensor([f"f{i}" for i in range(len(rows))], torch.cat(vals), lengths=lengths))
    return out


def bare_kernel(rows: list[int], dim: int):
    tbe = fbgemm_training()
    return tbe.SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(r, dim, tbe.EmbeddingLocation.HOST, tbe.ComputeDevice.CPU) for r in rows],
        optimizer=tbe.OptimType.EXACT_SGD,
        learning_rate=0.01,
        pooling_mode=tbe.PoolingMode.SUM,
        device=torch.device("cpu"),
        bounds_check_mode=tbe.BoundsCheckMode.NONE,
    )


def run(job: str, plan_name: str, steps: int, batch: int) -> dict[str, float]:
    rows, dim = JOBS[job], 64
    tables = [EmbeddingBagConfig(r, dim, f"t{i}", [f"f{i}"]) for i, r in enumerate(rows)]
    ebc = EmbeddingBagCollection(tables, device="meta")
    plan = ShardingPlan({"": {t.name: PLANS[plan_name]() for t in tables}})
    ours = shard_modules(ebc, plan, embedding_optimizer={"kind": "sgd", "lr": 0.01})
    opt = fused_optimizer(ours)
    bare = bare_kernel(rows, dim)
    batches = make_batches(rows, batch, 4)
    times: dict[str, list[float]] = {"ours_fwd": [], "ours_step": [], "bare_fwd": [], "bare_step": []}

    def ours_step(kjt):
        t0 = time.perf_counter()
        out = ours(kjt).values()
        t1 = time.perf_counter()
        out.sum().backward()
        opt.step()
        return t1 - t0, time.perf_counter() - t0

    def bare_step(kjt):
        t0 = time.perf_counter()
        out = bare(kjt.values(), kjt.offsets())
        t1 = time.perf_counter()
        out.sum().backward()
        return t1 - t0, time.perf_counter() - t0

    for i in range(steps + 3):
        kjt = batches[i % len(batches)]
        for name, fn in (
            (("ours", ours_step), ("bare", bare_step)) if i % 2 else (("bare", bare_step), ("ours", ours_step))
        ):
            fwd, total = fn(kjt)
            if i >= 3:
                times[f"{name}_fwd"].append(fwd)
                times[f"{name}_step"].append(total)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--jobs", default="big,dlrm")
    p.add_argument("--plans", default="table_wise,row_wise")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'store')}", rank=0, world_size=1)
        print("| job | plan | ours fwd ms | bare fwd ms | fwd ratio | ours step ms | bare step ms | step ratio |")
        print("|---|---|---|---|---|---|---|---|")
        for job in args.jobs.split(","):
            for plan in args.plans.split(","):
                r = run(job, plan, args.steps, args.batch)
                print(
                    f"| {job} | {plan} | {r['ours_fwd']:.1f} | {r['bare_fwd']:.1f} | "
                    f"{r['ours_fwd'] / r['bare_fwd']:.2f}x | {r['ours_step']:.1f} | {r['bare_step']:.1f} | "
                    f"{r['ours_step'] / r['bare_step']:.2f}x |",
                    flush=True,
                )
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
