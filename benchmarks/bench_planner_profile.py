"""Profile-guided costs: the planner's estimates against measured steps, before and after profiling on a job's own ids.

Two jobs, both on the main job's synthetic click data (``lightning_rec.data.SyntheticClicks``, Zipf ids with a
heavy head, popular ids scattered over each table), fused SGD, 2 gloo processes on one host:

* job A, the profiled job: 26 tables of Criteo Kaggle's categorical sizes x ``--scale``, dim 64, 1,024 samples per
  rank, five multi-hot features (the Criteo-like job of ``bench_planner_cost.py``, on heavy-head ids);
* job B, a second job never profiled: 26 tables of Criteo Terabyte's sizes x ``--scale-b`` (other sizes),
  the data's default multi-hot features, 512 samples per rank, other rows.

The speeds are profiled once, on job A's own batches (``profile_speeds``, both processes at once, as
``lightning-rec profile --processes 2`` does), and used for both jobs: job B's tables get the speeds of job A's
tables of their size and pooling. For each job, ten plans (the planner's with the default speeds and with the
profiled ones among them) are timed as the median over interleaved rounds of the slowest rank's step, and
estimated with the default speeds and with the profiled ones.

Usage:
    python benchmarks/bench_planner_profile.py            # writes benchmarks/results/planner_profile.md
    python benchmarks/bench_planner_profile.py --rounds 2 --steps 3 --no-write
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_planner_cost import CRITEO, _count_waits, _median_time, spearman
from bench_sharding import load, machine

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from lightning_rec.data.synthetic import CRITEO_CARDINALITIES, FEATURE_NAMES, SyntheticClicks
from lightning_rec.pipeline.shard_modules import fused_optimizer
from lightning_rec.plans.planner.profile import profile_speeds
from lightning_rec.plans.planner.speeds import ProfiledSpeeds
from lightning_rec.sharding import (
    Planner,
    ShardingPlan,
    Topology,
    column_wise,
    data_parallel,
    row_wise,
    shard_modules,
    table_wise,
)
from lightning_rec.testing import run_distributed

SPEC = {"kind": "sgd", "lr": 0.01}
OUT = Path(__file__).parent / "results" / "planner_profile.md"


def job(name: str, args: argparse.Namespace) -> dict:
    if name == "A":
        cards = [max(int(n * args.scale), 16) for n in CRITEO]
        # the Criteo-like job's multi-hot features (mean ids k): bags uniform in [0, 2k]
        multi = {FEATURE_NAMES[i]: 2 * k for i, k in {2: 20, 3: 8, 11: 30, 15: 5, 20: 12}.items()}
        return {"name": "A", "cards": cards, "multi_hot": multi, "batch": 1024, "seed": 1, "dim": 64}
    cards = [max(int(n * args.scale_b), 16) for n in CRITEO_CARDINALITIES]
    return {"name": "B", "cards": cards, "multi_hot": None, "batch": 512, "seed": 2, "dim": 64}


def tables_of(j: dict) -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(n, j["dim"], f"t{i}", [FEATURE_NAMES[i]]) for i, n in enumerate(j["cards"])]


def batches_of(j: dict, rank: int, world: int, n: int, zipf: float, split: str = "train") -> list[KeyedJaggedTensor]:
    ds = SyntheticClicks(
        n * j["batch"] * world,
        j["batch"],
        seed=j["seed"],
        rank=rank,
        world_size=world,
        multi_hot=j["multi_hot"],
        cardinalities=j["cards"],
        zipf_exponent=zipf,
        split=split,
    )
    return [b.sparse for b in ds][:n]


def pooling_of(batches: list[KeyedJaggedTensor]) -> dict[str, float]:
    """Mean ids per sample of every feature: what a user gives the planner."""
    out: dict[str, list[float]] = {}
    for b in batches:
        for k, n in zip(b.keys(), b.length_per_key()):
            out.setdefault(k, []).append(n / b.stride())
    return {k: float(np.mean(v)) for k, v in out.items()}


def plans_for(tables: list[EmbeddingBagConfig], world: int) -> dict[str, ShardingPlan]:
    names = [t.name for t in tables]
    big = {t.name for t in sorted(tables, key=lambda t: -t.num_embeddings)[:6]}
    greedy, load_ = {}, [0.0] * world
    for t in sorted(tables, key=lambda t: -t.num_embeddings * t.embedding_dim):
        r = int(np.argmin(load_))
        greedy[t.name], load_[r] = table_wise(r), load_[r] + t.num_embeddings
    cols = list(range(world))

    def plan(d: dict) -> ShardingPlan:
        return ShardingPlan({"": d})

    return {
        "table_wise round-robin": plan({n: table_wise(i % world) for i, n in enumerate(names)}),
        "table_wise by rows": plan(greedy),
        "table_wise all on rank 0": plan({n: table_wise(0) for n in names}),
        "row_wise": plan({n: row_wise() for n in names}),
        "column_wise": plan({n: column_wise(cols) for n in names}),
        "row_wise big, table_wise rest": plan(
            {n: row_wise() if n in big else table_wise(i % world) for i, n in enumerate(names)}
        ),
        "data_parallel small, table_wise big": plan(
            {n: table_wise(i % world) if n in big else data_parallel() for i, n in enumerate(names)}
        ),
        "data_parallel": plan({n: data_parallel() for n in names}),
    }


def profile_job(rank: int, world: int, j: dict, cfg: dict) -> dict:
    batches = batches_of(j, rank, world, cfg["profile_batches"], cfg["zipf"])
    t0 = time.perf_counter()
    sp = profile_speeds(tables_of(j), batches, embedding_optimizer=SPEC, max_batches=cfg["profile_batches"])
    return {"speeds": sp.as_dict(), "seconds": time.perf_counter() - t0}


def time_plans(rank: int, world: int, j: dict, plans: dict[str, ShardingPlan], cfg: dict) -> dict[str, list[float]]:
    import warnings

    warnings.filterwarnings("ignore", message=r".*Sparse invariant checks.*")
    _count_waits()
    # other rows than the profile's: the val split
    batches = batches_of(j, rank, world, 4, cfg["zipf"], split="val")
    out: dict[str, list[float]] = {k: [] for k in plans}
    names = list(plans)
    for r in range(cfg["rounds"]):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate: no plan always runs first
            torch.manual_seed(0)
            model = shard_modules(
                EmbeddingBagCollection(tables_of(j), device="meta"), plans[name], embedding_optimizer=SPEC
            )
            opt = fused_optimizer(model)
            count = iter(range(10**9))

            def step() -> None:
                model(batches[next(count) % len(batches)]).values().square().mean().backward()
                if opt is not None:
                    opt.step()

            for _ in range(cfg["warmup"]):
                step()
            out[name].append(_median_time(step, cfg["steps"]))
    return out


def planner(j: dict, world: int, pooling: dict[str, float], speeds: ProfiledSpeeds | None) -> Planner:
    return Planner(
        Topology(world),
        batch_size=j["batch"],
        pooling_factors=pooling,
        optimizer="sgd",
        gradients="fused",
        speeds=speeds,
    )


def run_job(j: dict, world: int, speeds: ProfiledSpeeds, cfg: dict) -> dict:
    tables = tables_of(j)
    pooling = pooling_of(batches_of(j, 0, world, 4, cfg["zipf"]))
    before, after = planner(j, world, pooling, None), planner(j, world, pooling, speeds)
    plans = {"planner (default speeds)": before.plan(tables), "planner (profiled speeds)": after.plan(tables)}
    plans.update(plans_for(tables, world))
    by_rank = run_distributed(time_plans, world, j, plans, cfg, timeout_s=3600)
    med = {k: 1e3 * statistics.median(v) for k, v in by_rank[0].items()}
    est = {
        label: {k: p.estimate(tables, plan).step_time_ms for k, plan in plans.items()}
        for label, p in (("default", before), ("profiled", after))
    }
    return {"plans": plans, "measured": med, "est": est, "pooling": pooling, "report": str(after.explain())}


def summary(r: dict, label: str) -> tuple[float, list[float]]:
    names = list(r["measured"])
    # one plan measured under two names (the planners agree) counts once
    seen, keep = set(), []
    for k in names:
        key = repr(r["plans"][k].plan)
        if key not in seen:
            seen.add(key)
            keep.append(k)
    rho = spearman([r["est"][label][k] for k in keep], [r["measured"][k] for k in keep])
    return rho, [r["est"][label][k] / r["measured"][k] for k in keep]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--scale", type=float, default=0.01, help="job A: Criteo Kaggle's sizes x this")
    ap.add_argument("--scale-b", type=float, default=0.002, help="job B: Criteo Terabyte's sizes x this")
    ap.add_argument("--zipf", type=float, default=1.2, help="the ids' Zipf exponent (heavy head)")
    ap.add_argument("--profile-batches", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("zipf", "profile_batches", "steps", "warmup", "rounds")}
    world, load0 = args.world, load()
    a, b = job("A", args), job("B", args)
    prof = run_distributed(profile_job, world, a, cfg, timeout_s=1200)
    speeds = ProfiledSpeeds.from_dict(prof[0]["speeds"])
    assert all(p["speeds"] == prof[0]["speeds"] for p in prof), "the ranks fitted different speeds"
    print(f"profiled in {prof[0]['seconds']:.1f} s: {speeds.describe()}", flush=True)
    results = {j["name"]: run_job(j, world, speeds, cfg) for j in (a, b)}
    lines = [
        "# Planner: estimates before and after profiling on the job's own ids",
        "",
        f"Date: {datetime.date.today()}. Machine: {machine()}.",
        "",
        f"Data: `SyntheticClicks`, Zipf exponent {args.zipf} (heavy head, popular ids scattered over each table); "
        f"fused SGD; fp32; {world} gloo processes on one host (the shared-memory transport); {args.rounds} "
        f"interleaved rounds x median of {args.steps} steps after {args.warmup} warm-up; the timed batches are "
        "other rows (the val split) than the profiled ones.",
        "",
        f"- job A (profiled): 26 tables of Criteo Kaggle's sizes x {args.scale} (min 16 rows), dim 64, "
        "1,024 samples per rank, 5 multi-hot features.",
        f"- job B (not profiled): 26 tables of Criteo Terabyte's sizes x {args.scale_b} (min 16 rows), dim 64, "
        "512 samples per rank, the data's default 3 multi-hot features.",
        "",
        f"Profile (job A's batches, {args.profile_batches} per process, both processes at once): "
        f"{prof[0]['seconds']:.1f} s; {speeds.describe()}; per-collective latency "
        f"{1e6 * (speeds.collective_latency or 0):.0f} us, transport {(speeds.intra_host_bandwidth or 0) / 1e9:.2f} "
        f"GB/s, fixed lookup cost per step {1e3 * speeds.step_overhead:.2f} ms, grouped/per-table "
        f"{speeds.group_scale:.2f}.",
        "",
    ]
    for name, r in results.items():
        best = min(r["measured"].values())
        lines += [
            f"## Job {name}",
            "",
            "| plan | measured ms | est. default ms | ratio | est. profiled ms | ratio |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for k, m in r["measured"].items():
            d, p = r["est"]["default"][k], r["est"]["profiled"][k]
            mark = " (best)" if m == best else ""
            lines.append(f"| {k}{mark} | {m:.2f} | {d:.2f} | {d / m:.2f} | {p:.2f} | {p / m:.2f} |")
        lines.append("")
        for label in ("default", "profiled"):
            rho, ratio = summary(r, label)
            within = sum(abs(x - 1) <= 0.3 for x in ratio)
            lines.append(
                f"- {label} speeds: Spearman {rho:.2f}; estimate/measured median {statistics.median(ratio):.2f} "
                f"(range {min(ratio):.2f}-{max(ratio):.2f}); {within} of {len(ratio)} plans within 30%"
            )
        for k in ("planner (default speeds)", "planner (profiled speeds)"):
            lines.append(f"- {k}: {100 * (r['measured'][k] / best - 1):.1f}% above the best measured")
        lines.append("")
    lines += [
        f"Load average at start: {load0}; at end: {load()}.",
        "",
        f"Command: `python benchmarks/bench_planner_profile.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
    ]
    text = "\n".join(lines)
    print(text)
    print(results["A"]["report"])
    if not args.no_write:
        OUT.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
