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

``--world N`` (default 2; 0 skips) adds the sharded step on N gloo processes (one thread each; the table
row-wise in whole buckets, each rank its own fresh batches of ``--batch`` bags), three methods per round:

  folded    the wrapper's step: raw ids routed to the bucket owners by the collection's own input dist,
            remapped there, looked up (no exchange beyond the lookup's)
  separate  the same step with the remap as its own exchange first (ids to the owners and rows back:
            3 more all-to-alls), then the collection's input dist
  lookup    the sharded collection alone, forward + backward + SGD, on ids remapped beforehand

``--main-job`` also runs the DLRM main job (examples/dlrm.py, 2 processes) on hashed and on raw ids
(``--data.raw_ids true``) with the same rows, and reports the per-epoch hit rate and evictions it prints
and both jobs' wall time. The load average (1/5/15 min) is recorded before and after.

Usage:
    python benchmarks/bench_mc.py --out benchmarks/results/mc.md --main-job        # full size
    python benchmarks/bench_mc.py --rows 48000 --batch 256 --rounds 2              # smoke
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

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
from lightning_rec.mc import _remap
from lightning_rec.mc._remap import splitmix64
from lightning_rec.mc.modules import split_by_table
from lightning_rec.sharding import ShardingPlan, row_wise, shard_modules
from lightning_rec.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]


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
    p.add_argument("--world", type=int, default=2, help="processes of the sharded run (0: skip it)")
    p.add_argument("--main-job", action="store_true", help="also run the DLRM main job on hashed and raw ids")
    p.add_argument("--job-rows", type=int, default=200_000, help="main job: training rows per epoch")
    p.add_argument("--job-epochs", type=int, default=2)
    p.add_argument("--job-repeats", type=int, default=1, help="main job: run the jobs this many times, in turn")
    p.add_argument("--tables", type=int, default=26, help="many-table section: tables (0: skip it)")
    p.add_argument("--table-rows", type=int, default=4096, help="many-table section: rows per table")
    p.add_argument("--table-buckets", type=int, default=256, help="many-table section: buckets per table")
    p.add_argument(
        "--job-before",
        type=str,
        default=None,
        help="main job: also run the raw-id job with lightning_rec imported from this directory (a "
        "checkout of the code before a change, e.g. `git archive <rev> lightning_rec | tar -x -C DIR`)",
    )
    p.add_argument("--out", type=str, default=None, help="write the markdown report here")
    return p.parse_args(argv)


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


class Batches:
    """Fresh batches forever (one rng): a replayed batch would only hit, and no step would evict."""

    def __init__(self, args, seed: int = 0) -> None:
        self.rng, self.args = np.random.default_rng(seed), args
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
    mcc = ManagedCollisionCollection(
        {"t": MCHManagedCollisionModule(args.rows, num_buckets=args.buckets, eviction_policy=policy)}, tables
    )
    return ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables, kernel="torch", sparse_grad=True), mcc)


def sharded_worker(rank: int, world: int, a: dict) -> dict:
    """One rank of the sharded run: folded, separate and lookup-only steps side by side in every round."""
    args = argparse.Namespace(**a)
    torch.set_num_threads(1)
    per, extra = divmod(args.buckets, world)
    size = args.rows // args.buckets
    blocks = [(per + (r < extra)) * size for r in range(world)]
    model = shard_modules(build(args), ShardingPlan({"_embedding_module": {"t": row_wise(blocks)}}))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    source = Batches(args, seed=1 + rank)
    for b in source.take(args.fill):
        model(b)

    def step(kjt):
        opt.zero_grad()
        model(kjt)[0].values().sum().backward()
        opt.step()

    def lookup(kjt):
        opt.zero_grad()
        model._embedding_module(kjt).values().sum().backward()
        opt.step()

    times: dict[str, list[float]] = {"folded": [], "separate": [], "lookup": []}
    names = list(times)
    for r in range(args.warmup + args.rounds):
        for method in names[r % 3 :] + names[: r % 3]:  # rotate the order: no method always runs first
            data = source.take(args.steps)
            if method == "lookup":
                data = [model.remap(b) for b in data]  # untimed: the rows the lookup reads
            model._fold_remap = method == "folded"
            dist.barrier()
            t0 = time.perf_counter()
            for b in data:
                (lookup if method == "lookup" else step)(b)
            dt = time.perf_counter() - t0
            if r >= args.warmup:
                times[method].append(dt / args.steps)
    return {"times": times, "stats": model.mc_stats()["t"]}


def sharded_section(args) -> list[str]:
    res = run_distributed(sharded_worker, args.world, vars(args), timeout_s=1800)
    # a step ends in collectives: every rank's time is about the slowest's; report rank 0's
    times = res[0]["times"]
    ids = args.batch * args.bag * args.world
    med = {m: statistics.median(v) * 1e3 for m, v in times.items()}
    ratio = {
        (k, base): statistics.median(a / b for a, b in zip(times[k], times[base]))
        for k, base in (("folded", "lookup"), ("separate", "lookup"), ("folded", "separate"))
    }
    hits = sum(r["stats"]["hits"] for r in res)
    lookups = sum(r["stats"]["lookups"] for r in res)
    evicted = sum(r["stats"]["evicted"] for r in res)
    return [
        f"## Sharded: {args.world} processes, remap folded into the input dist vs a separate exchange",
        "",
        f"The same table row-wise over {args.world} gloo processes in whole buckets, one thread each; each rank "
        f"its own fresh batches of {args.batch} bags x {args.bag} ids ({ids:,} ids/step over all ranks). Last "
        f"timed step: {hits:,} of {lookups:,} ids hit, {evicted:,} evicted.",
        "",
        "| method | ms/step (rank 0) | ids/s (all ranks) |",
        "| --- | --- | --- |",
        *[f"| {m} | {med[m]:.1f} | {ids / med[m] * 1e3:,.0f} |" for m in times],
        "",
        f"Paired ratios (median over rounds): folded / lookup = {ratio[('folded', 'lookup')]:.2f}, "
        f"separate / lookup = {ratio[('separate', 'lookup')]:.2f}, "
        f"folded / separate = {ratio[('folded', 'separate')]:.2f}.",
    ]


def per_table_remap(model: ManagedCollisionEmbeddingBagCollection, kjt: KeyedJaggedTensor) -> None:
    """The remap as it ran before the one-pass version: ``remap_step`` and the row re-initialisation per table."""
    segs, by_table = split_by_table(model._managed_collision_collection, kjt)
    for t, m in model._managed_collision_collection.modules_by_table().items():
        m.prepare()
        m.begin_step()
        pos = by_table.get(t, [])
        ids = torch.cat([segs[i] for i in pos]) if pos else torch.zeros(0, dtype=torch.int64)
        if ids.numel() and int(ids.min()) < 0:
            raise ValueError("negative id")
        res = _remap.remap_step(
            ids,
            m._mch_raw_ids,
            m._mch_last_access,
            m._mch_counts,
            m._index,
            int(m._mch_num_buckets),
            int(m._mch_step),
            m.eviction_policy.name,
        )
        m._after_remap(res)
        model._reinit_rows(t, res.admitted_slots, res.admitted_ids)


def many_tables_section(args) -> list[str]:
    """``--tables`` tables, one id per sample and feature (the DLRM's shape): one-pass remap vs per table."""
    n, rows = args.tables, args.table_rows
    names = [f"t{i}" for i in range(n)]

    def build_many():
        torch.manual_seed(0)
        tables = [
            EmbeddingBagConfig(name=t, num_embeddings=rows, embedding_dim=args.dim, feature_names=[f"f{t}"])
            for t in names
        ]
        policy = LRU_EvictionPolicy if args.policy == "lru" else LFU_EvictionPolicy
        mcc = ManagedCollisionCollection(
            {
                t: MCHManagedCollisionModule(rows, num_buckets=args.table_buckets, eviction_policy=policy())
                for t in names
            },
            tables,
        )
        return ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables, kernel="torch"), mcc)

    rng = np.random.default_rng(1)
    distinct = int(rows * args.distinct)

    def take(k):
        out = []
        for _ in range(k):
            ranks = np.minimum(rng.zipf(1.1, n * args.batch) - 1, distinct - 1)
            raw = splitmix64(torch.from_numpy(ranks.astype(np.int64))) & ((1 << 62) - 1)
            out.append(
                KeyedJaggedTensor([f"f{t}" for t in names], raw, lengths=torch.ones(n * args.batch, dtype=torch.int64))
            )
        return out

    one, per = build_many(), build_many()
    for b in take(args.fill):
        one.remap(b)
        per_table_remap(per, b)
    times: dict[str, list[float]] = {"one pass": [], "per table": []}
    for r in range(args.warmup + args.rounds):
        data = take(args.steps)
        t0 = time.perf_counter()
        for b in data:
            one.remap(b)
        t1 = time.perf_counter()
        for b in data:
            per_table_remap(per, b)
        t2 = time.perf_counter()
        if r >= args.warmup:
            times["one pass"].append((t1 - t0) / args.steps)
            times["per table"].append((t2 - t1) / args.steps)
    # the same ids into the same state: the two ways must have taken the same decisions
    sa, sb = one.state_dict(), per.state_dict()
    same = all(torch.equal(sa[k], sb[k]) for k in sa if not k.endswith("_mch_generation"))
    stats = list(one.mc_stats().values())
    hits, looks, ev = (sum(s[k] for s in stats) for k in ("hits", "lookups", "evicted"))
    med = {m: statistics.median(v) * 1e3 for m, v in times.items()}
    ratio = statistics.median(a / b for a, b in zip(times["one pass"], times["per table"]))
    return [
        f"## {n} tables: one remap pass over all tables vs a remap per table",
        "",
        f"{n} tables of {rows:,} x {args.dim} ({args.table_buckets} buckets of {rows // args.table_buckets} rows), "
        f"policy {args.policy}; batch {args.batch} samples x 1 id per table ({n * args.batch:,} ids/step), "
        f"Zipf(1.1) over {distinct:,} values per table; the remap alone (find, admit, evict, re-initialise rows). "
        "'per table' is the loop that ran before (`_remap.remap_step` and the row re-initialisation table by "
        f"table), fed the same batches in the same round. Last step: {hits:,} of {looks:,} ids hit, {ev:,} "
        f"evicted; both ways ended in the same state (remap tables, weights): {same}.",
        "",
        "| method | ms/step | ms/step/table |",
        "| --- | --- | --- |",
        *[f"| {m} | {med[m]:.1f} | {med[m] / n:.2f} |" for m in times],
        "",
        f"Paired ratio (median over rounds): one pass / per table = {ratio:.2f}.",
    ]


def run_job(extra: list[str], root: str, code: str | Path = ROOT) -> tuple[float, str]:
    # the job writes runs/dlrm (logs, checkpoint) under its working directory: a temporary one
    cmd = [sys.executable, str(ROOT / "examples" / "dlrm.py"), *extra]
    t0 = time.perf_counter()
    out = subprocess.run(
        cmd, capture_output=True, text=True, cwd=root, env={**os.environ, "PYTHONPATH": str(code)}, check=False
    )
    if out.returncode:
        raise RuntimeError(f"main job failed ({' '.join(cmd)}):\n{out.stderr[-3000:]}")
    return time.perf_counter() - t0, out.stdout


def main_job_section(args) -> list[str]:
    common = [
        "--data.train_rows",
        str(args.job_rows),
        "--trainer.max_epochs",
        str(args.job_epochs),
        "--trainer.val_check_interval",
        "1.0",
    ]
    lines = [
        "## The DLRM main job on raw ids",
        "",
        f"`python examples/dlrm.py --data.raw_ids true --data.train_rows {args.job_rows} "
        f"--trainer.max_epochs {args.job_epochs} --trainer.val_check_interval 1.0` (2 processes, the defaults of "
        "examples/dlrm.yaml otherwise: synthetic clicks at size 0.001, 26 tables, LRU, 768 buckets capped so "
        "a bucket holds at least 16 rows) next to the same job on hashed ids. Wall time includes start-up and "
        "validation. The two jobs learn different hidden tasks (raw ids drift), so compare each AUC with its "
        "achievable AUC.",
        "",
    ]
    runs = {}
    jobs = [("hashed ids", [], ROOT), ("raw ids, managed collision", ["--data.raw_ids", "true"], ROOT)]
    if args.job_before:
        jobs.append(("raw ids, managed collision, code before", ["--data.raw_ids", "true"], args.job_before))
    walls: dict[str, list[float]] = {name: [] for name, _, _ in jobs}
    for _ in range(args.job_repeats):  # the jobs in turn, so a change of load hits each
        for name, extra, code in jobs:
            with tempfile.TemporaryDirectory() as root:
                secs, out = run_job(common + extra, root, code)
            runs[name] = (secs, out)
            walls[name].append(secs)
            print(f"{name}: {secs:.0f}s", flush=True)
    lines += ["| job | wall s (median) | each run | final line |", "| --- | --- | --- | --- |"]
    for name, (_, out) in runs.items():
        final = [ln for ln in out.splitlines() if ln.startswith("final: ")]
        lines.append(
            f"| {name} | {statistics.median(walls[name]):.0f} | {', '.join(f'{w:.0f}' for w in walls[name])} "
            f"| `{final[-1] if final else '?'}` |"
        )
    if args.job_before:
        after, before = walls["raw ids, managed collision"], walls["raw ids, managed collision, code before"]
        hashed = walls["hashed ids"]
        lines += [
            "",
            f"Paired ratios (median over repeats): raw ids / hashed ids = "
            f"{statistics.median(a / h for a, h in zip(after, hashed)):.2f} (code before: "
            f"{statistics.median(b / h for b, h in zip(before, hashed)):.2f}); raw ids, now / before = "
            f"{statistics.median(a / b for a, b in zip(after, before)):.2f}.",
        ]
    per_epoch = [
        ln for ln in runs["raw ids, managed collision"][1].splitlines() if re.match(r"managed collision, epoch", ln)
    ]
    lines += ["", "Per epoch (printed by the job):", "", *[f"    {ln}" for ln in per_epoch]]
    return lines


def main(argv=None) -> None:
    args = parse_args(argv)
    load_before = load()
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
    if args.tables:
        lines += ["", *many_tables_section(args)]
    if args.world:
        lines += ["", *sharded_section(args)]
    if args.main_job:
        lines += ["", *main_job_section(args)]
    lines += [
        "",
        f"Load average (1/5/15 min) before: {load_before}; after: {load()} (2 cores, shared with other jobs).",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
