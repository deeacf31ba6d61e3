"""Training-step time of the unsharded DLRM: eager vs ``torch.compile`` (inductor), on one process (CPU).

Workload (defaults; shrink with flags): ``lightning_rec.models.DLRM`` with 26 tables x 20,000 rows x 16 dims
(one per feature, SUM pooling, the torch lookup kernel, dense gradients), 13 dense features, bottom MLP
[64, 16], top MLP [64, 32, 1], batch 512, bags of 0..4 ids (Criteo-like multi-hot). A pool of batches with
the same batch size and different bag lengths is drawn up front; every step takes the next one, so the
compiled model must not recompile per batch (bag lengths and id counts are dynamic).

A step is forward + binary cross-entropy + backward (gradients zeroed first); no optimizer, which is the
same for both sides. ``torch.compile(model, fullgraph=True)`` with ``capture_scalar_outputs`` (the per-key id
counts are read from the lengths tensor: symbolic ints instead of a graph break). Before timing, the
compiled loss and gradients are checked against eager ones, and the compile time (first steps) is reported
apart. Methods alternate within each round (shuffled order), ``--iters`` steps each; the ratio is the
median over rounds of the per-round ratio, so slow phases of a shared machine hit both sides alike. One
thread by default (``--threads``).

``--sharded``: the same step for the DLRM sharded over 2 gloo processes (tables round-robin table-wise,
row-wise, column-wise, data-parallel), eager vs ``torch.compile(model, dynamic=True)`` after sharding (what
``RecShardedStrategy(compile=True)`` does); each rank takes its own batches, rank 0's times are reported.
The collectives run eagerly in both (graph breaks), so the ratio shows what compiling the rest buys.

Usage:
    python benchmarks/bench_compile.py                                  # full size
    python benchmarks/bench_compile.py --sharded --out benchmarks/results/compile_sharded.md
    python benchmarks/bench_compile.py --tables 4 --rows 1000 --batch 64 --rounds 2 --iters 2   # smoke
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._dynamo
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from lightning_rec import KeyedJaggedTensor, ShardingPlan
from lightning_rec.models import DLRM
from lightning_rec.sharding import column_wise, data_parallel, row_wise, shard_modules, table_wise
from lightning_rec.testing import run_distributed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--dense", type=int, default=13)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--max-bag", type=int, default=4)
    p.add_argument("--pool", type=int, default=8, help="distinct batches cycled through")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=str, default=None, help="also write the markdown table here")
    p.add_argument("--sharded", action="store_true", help="2 gloo processes, the tables sharded")
    p.add_argument("--backend", type=str, default="inductor")
    return p.parse_args(argv)


def make_batches(args: argparse.Namespace) -> list[tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(getattr(args, "seed", 0))
    keys = [f"cat_{i}" for i in range(args.tables)]
    out = []
    for _ in range(args.pool):
        lengths = torch.randint(0, args.max_bag + 1, (args.tables * args.batch,), generator=g)
        values = torch.randint(0, args.rows, (int(lengths.sum()),), generator=g)
        out.append(
            (
                torch.randn(args.batch, args.dense, generator=g),
                KeyedJaggedTensor(keys, values, lengths=lengths),
                (torch.rand(args.batch, generator=g) < 0.3).float(),
            )
        )
    return out


def step(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    dense, kjt, labels = batch
    for p in model.parameters():
        p.grad = None
    loss = F.binary_cross_entropy_with_logits(model(dense, kjt), labels)
    loss.backward()
    return loss


def make_model(args: argparse.Namespace) -> DLRM:
    torch.manual_seed(0)
    keys = [f"cat_{i}" for i in range(args.tables)]
    return DLRM(
        num_dense=args.dense,
        feature_names=keys,
        num_embeddings_per_feature=[args.rows] * args.tables,
        embedding_dim=args.dim,
        dense_arch_layer_sizes=[64, args.dim],
        over_arch_layer_sizes=[64, 32, 1],
        kernel="torch",
        sparse_grad=False,
    )


def _sharded_rank(rank: int, ws: int, args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    kinds = [table_wise(rank=0), row_wise(), column_wise(ranks=[1, 0]), data_parallel()]
    plan = ShardingPlan(
        {
            "sparse_arch.embedding_bag_collection": {
                f"cat_{i}": (table_wise(rank=i % ws) if i % 4 == 0 else kinds[i % 4]) for i in range(args.tables)
            }
        }
    )
    eager = shard_modules(make_model(args), plan)
    model = shard_modules(make_model(args), plan)
    args.seed = 1 + rank  # each rank its own batches
    batches = make_batches(args)
    torch._dynamo.reset()
    torch._dynamo.config.capture_scalar_outputs = True
    compiled = torch.compile(model, dynamic=True, backend=args.backend)
    return _measure(args, eager, compiled, model, batches, rank)


def _measure(
    args: argparse.Namespace,
    model: torch.nn.Module,
    compiled: torch.nn.Module,
    compiled_base: torch.nn.Module,
    batches: list,
    rank: int = 0,
) -> dict:
    """Check and compile (every pooled batch once), then alternate eager and compiled rounds."""
    start = time.perf_counter()
    for b in batches:
        loss_c = step(compiled, b)
        loss_e = step(model, b)
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-4, atol=1e-5)
        for gc, ge in zip(compiled_base.parameters(), model.parameters()):
            if ge.grad is not None:
                torch.testing.assert_close(gc.grad, ge.grad, rtol=1e-4, atol=1e-5)
    compile_s = time.perf_counter() - start
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    methods = {"eager": model, "compiled": compiled}
    times: dict[str, list[float]] = {m: [] for m in methods}
    ratios = []
    rng = random.Random(0)  # the same order on every rank: both run the same method at the same time
    i = 0
    for r in range(args.warmup + args.rounds):
        order = list(methods)
        rng.shuffle(order)
        this = {}
        for name in order:
            t0 = time.perf_counter()
            for _ in range(args.iters):
                step(methods[name], batches[i % len(batches)])
                i += 1
            this[name] = (time.perf_counter() - t0) / args.iters * 1e3
        if r >= args.warmup:
            for name, ms in this.items():
                times[name].append(ms)
            ratios.append(this["compiled"] / this["eager"])
    return {"times": times, "ratios": ratios, "compile_s": compile_s, "graphs": graphs}


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    load = os.getloadavg()[0]
    if args.sharded:
        res = run_distributed(_sharded_rank, 2, args, timeout_s=3600)[0]
        what = f"sharded over 2 gloo processes (per rank: batch {args.batch}), {args.backend}, dynamic=True"
    else:
        torch.set_num_threads(args.threads)
        model = make_model(args)
        batches = make_batches(args)
        torch._dynamo.reset()
        torch._dynamo.config.capture_scalar_outputs = True
        compiled = torch.compile(model, fullgraph=True)
        res = _measure(args, model, compiled, model, batches)
        what = "one process, inductor, fullgraph=True"
    times, ratios, compile_s, graphs = res["times"], res["ratios"], res["compile_s"], res["graphs"]
    lines = [
        f"DLRM step (forward + BCE + backward), CPU, {what}, {args.threads} thread(s) per process, "
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}",
        f"{args.tables} tables x {args.rows} rows x {args.dim} dims, batch {args.batch}, bags 0..{args.max_bag}, "
        f"{args.rounds} rounds x {args.iters} steps; compile + check of {args.pool} batches: {compile_s:.1f}s "
        f"({graphs} graph(s) compiled for {args.pool} batches); load average {load:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end (2 cores)",
        "",
        "| method | median ms/step |",
        "| --- | --- |",
        *(f"| {name} | {statistics.median(ts):.2f} |" for name, ts in times.items()),
        "",
        f"compiled / eager (median of per-round ratios): **{statistics.median(ratios):.3f}** "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f})",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return text


if __name__ == "__main__":
    main()
