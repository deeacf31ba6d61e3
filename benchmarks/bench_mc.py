"""Managed-collision remap cost per training step, next to the embedding lookup it feeds (CPU, one process).

Workload (defaults; shrink with flags): one table of 98,304 rows x 64 dims (fp32, SUM), 768 buckets,
batch 2,048 bags of 20 ids. Raw ids are Zipf(1.1) ranks over 1,966,080 distinct values (20x the table:
the table fills during ``--fill`` untimed steps, then evicts every step), scattered over the int64 range
by a hash. Every step draws a fresh batch (a replayed batch would only hit).

Methods, each one training step, run side by side in every round:

  remap   ``ManagedCollisionEmbeddingBagCollection.remap`` alone (find, admit, evict, re-initialise rows)
  lookup  the plain ``EmbeddingBagCollection`` (sparse_grad=True) forward + backward + SGD, on ids the
          remap produced (so it reads the same rows)
  both    the wrapper's full step: remap, then the lookup

The report gives the median ms/step, ids/s, and paired ratios (both/lookup, remap/lookup: computed
within a round, median over rounds). One thread by default, as the shared CI machine is noisy.

Usage:
    python benchmarks/bench_mc.py                                       # full size
    python benchmarks/bench_mc.py --rows 48000 --batch 256 --rounds 2   # smoke
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from lightning_rec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    MCHManagedCollisionModule,
)
from lightning_rec.mc._remap import splitmix64


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=98_304)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--buckets", type=int, default=768)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--bag", type=int, default=20)
    p.add_argument("--distinct", type=float, default=20.0, help="distinct raw ids, as a multiple of rows")
    p.add_argument("--steps", type=int, default=4, help="steps per method and round")
    p.add_argument("--fill", type=int, default=40, help="untimed remap steps that fill the table first")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--policy", choices=["lru", "lfu"], default="lru")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=str, default=None, help="write the markdown report here")
    return p.parse_args(argv)


class Batches:
    """Fresh batches forever (one rng): a replayed batch would only hit, and no step would evict."""

    def __init__(self, args) -> None:
        self.rng, self.args = np.random.default_rng(0), args
        self.distinct = int(args.rows * args.distinct)

    def take(self, n: int) -> list[KeyedJaggedTensor]:
        a = self.args
        out = []
        for _ in range(n):
            ranks = np.minimum(self.rng.zipf(1.1, a.batch * a.bag) - 1, self.distinct - 1)
            raw = splitmix64(torch.from_numpy(ranks.astype(np.int64))) & ((1 << 62) - 1)
            out.append(KeyedJaggedTensor(["f"], raw, lengths=torch.full((a.batch,), a.bag)))
        return out


def build(args) -> ManagedCollisionEmbeddingBagCollection:
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name="t", num_embeddings=args.rows, embedding_dim=args.dim, feature_names=["f"])]
    policy = LRU_EvictionPolicy() if args.policy == "lru" else LFU_EvictionPolicy()
    mcc = ManagedCollisionCollection({"t": MCHManagedCollisionModule(args.rows, num_buckets=args.buckets,
                                                                     eviction_policy=policy)}, tables)
    return ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables, kernel="torch", sparse_grad=True), mcc)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build(args)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    source = Batches(args)
    ids_per_step = args.batch * args.bag
    for b in source.take(args.fill):  # fill the table: from here on new ids evict
        model.remap(b)

    def lookup(kjt):
        opt.zero_grad()
        model._embedding_module(kjt).values().sum().backward()
        opt.step()

    def both(kjt):
        opt.zero_grad()
        model(kjt)[0].values().sum().backward()
        opt.step()

    # per round: remap fresh batches; look up exactly the rows they were given; a full step on other fresh
    # batches. The order is fixed (the lookup needs the remap's output), every method sees new ids.
    times: dict[str, list[float]] = {"remap": [], "lookup": [], "both": []}
    stats: dict[str, int] = {}
    for r in range(args.warmup + args.rounds):
        data = source.take(args.steps)
        t0 = time.perf_counter()
        remapped = [model.remap(b) for b in data]
        t1 = time.perf_counter()
        stats = model.mc_stats()["t"]
        for k in remapped:
            lookup(k)
        t2 = time.perf_counter()
        for b in source.take(args.steps):
            both(b)
        t3 = time.perf_counter()
        if r >= args.warmup:
            for m, dt in (("remap", t1 - t0), ("lookup", t2 - t1), ("both", t3 - t2)):
                times[m].append(dt / args.steps)
    methods = times
    med = {m: statistics.median(v) * 1e3 for m, v in times.items()}
    ratio = {k: statistics.median(a / b for a, b in zip(times[k], times["lookup"])) for k in ("remap", "both")}
    lines = [
        "# Managed collision: remap cost per step vs the lookup",
        "",
        f"`python benchmarks/bench_mc.py {' '.join(sys.argv[1:])}`".replace(" `", "`"),
        "",
        f"Table {args.rows:,} x {args.dim} fp32, {args.buckets} buckets ({args.rows // args.buckets} rows each), "
        f"policy {args.policy}; batch {args.batch} bags x {args.bag} ids = {ids_per_step:,} ids/step; raw ids "
        f"Zipf(1.1) over {int(args.rows * args.distinct):,} values. {args.threads} thread(s), "
        f"{args.fill} fill steps, then {args.rounds} rounds x {args.steps} steps per method; "
        f"torch {torch.__version__}, {platform.machine()}.",
        "",
        f"Last timed remap step: {stats['hits']:,} of {stats['lookups']:,} ids hit, "
        f"{stats['admitted']:,} admitted, {stats['evicted']:,} evicted, {stats['unadmitted']:,} unadmitted.",
        "",
        "| method | ms/step | ids/s |",
        "| --- | --- | --- |",
        *[f"| {m} | {med[m]:.1f} | {ids_per_step / med[m] * 1e3:,.0f} |" for m in methods],
        "",
        f"Paired ratios (median over rounds): remap / lookup = {ratio['remap']:.2f}, "
        f"(remap + lookup) / lookup = {ratio['both']:.2f}.",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
