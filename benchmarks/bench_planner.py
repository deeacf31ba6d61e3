"""The planner: its run time at cluster scale, and the throughput of its plans against one-type plans.

1. Planner run time for 1,000 tables x 4,096 ranks (model-parallel groups of 8 and of 4,096), CUDA
   defaults, 80 GB per rank: tables of 1e3..2e7 rows, dims 16..256, pooling factors 1..50.
2. The benchmark workload of ``bench_sharding.py`` (26 tables x 100,000 rows x 64 dims, 2,048 samples per
   rank, ~20 ids per bag, sparse-gradient SGD, one thread per process) on 2 and 4 gloo processes: the
   planner's plan vs all table_wise (round-robin), all row_wise and all data_parallel. For each, the
   cost model's estimate and the measured samples/s (median step of the slowest rank; interleaved rounds).

3. The cost model against measured steps (``--cost``: ``bench_planner_cost.py``): a Criteo-like fused-SGD job,
   ten plans, estimated vs measured per plan, Spearman rank correlation, estimate / measured, with speeds
   measured by a calibration; its section of ``results/planner.md`` is kept when 1-2 are rerun.

Usage:
    python benchmarks/bench_planner.py                    # full size
    python benchmarks/bench_planner.py --rows 20000 --steps 4
    python benchmarks/bench_planner.py --cost [--rounds 3 --steps 7]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sharding import load, machine, make_batches, make_tables

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_rec.sharding import (
    Planner,
    ShardingPlan,
    Topology,
    data_parallel,
    row_wise,
    shard_modules,
    table_wise,
)
from lightning_rec.testing import run_distributed


def planner_runtime(mp: int) -> tuple[float, str]:
    rng = random.Random(0)
    tables = [
        EmbeddingBagConfig(int(10 ** rng.uniform(3, 7.3)), rng.choice([16, 32, 64, 128, 256]), f"table_{i}", [f"f{i}"])
        for i in range(1000)
    ]
    pooling = {f"f{i}": rng.choice([1, 1, 5, 20, 50]) for i in range(1000)}
    planner = Planner(
        Topology(4096, mp, min(8, mp), device_memory="80GB", host_memory="2TB", device="cuda"),
        batch_size=512,
        pooling_factors=pooling,
        optimizer="rowwise_adagrad",
        gradients="fused",
    )
    t0 = time.perf_counter()
    planner.plan(tables)
    dt = time.perf_counter() - t0
    rep = planner.explain()
    kinds: dict[str, int] = {}
    for c in rep.tables:
        kinds[c.sharding.sharding_type.value] = kinds.get(c.sharding.sharding_type.value, 0) + 1
    return dt, f"{kinds}, estimated step {rep.step_time_ms:.2f} ms"


def plans_for(cfg: dict, world: int) -> tuple[dict[str, ShardingPlan], dict[str, float], str]:
    tables = make_tables(cfg)
    planner = Planner(Topology(world), batch_size=cfg["batch"], default_pooling_factor=cfg["ids"], gradients="sparse")
    n = cfg["tables"]
    plans = {
        "planner": planner.plan(tables),
        "table_wise": ShardingPlan({"": {f"t{i}": table_wise(i % world) for i in range(n)}}),
        "row_wise": ShardingPlan({"": {f"t{i}": row_wise() for i in range(n)}}),
        "data_parallel": ShardingPlan({"": {f"t{i}": data_parallel() for i in range(n)}}),
    }
    est = {k: planner.estimate(tables, p).step_time_ms for k, p in plans.items()}
    kinds: dict[str, int] = {}
    for ps in plans["planner"].plan[""].values():
        kinds[ps.sharding_type.value] = kinds.get(ps.sharding_type.value, 0) + 1
    return plans, est, str(kinds)


def worker(rank: int, world: int, plans: dict[str, ShardingPlan], cfg: dict) -> dict[str, list[float]]:
    import warnings

    warnings.filterwarnings("ignore", message=r".*Sparse invariant checks.*")
    batches = make_batches(cfg, seed=1000 + rank)
    times: dict[str, list[float]] = {k: [] for k in plans}
    names = list(plans)
    for r in range(cfg["rounds"]):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate: no plan always runs first
            plan = plans[name]
            torch.manual_seed(0)
            model = shard_modules(EmbeddingBagCollection(make_tables(cfg), device="meta", sparse_grad=True), plan)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            for i in range(cfg["warmup"] + cfg["steps"]):
                dist.barrier()
                t0 = time.perf_counter()
                model(batches[i % len(batches)]).values().square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                slowest = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                if i >= cfg["warmup"]:
                    times[name].append(float(slowest))
            del model, opt
    return times


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if "--cost" in args_in:
        import bench_planner_cost

        return bench_planner_cost.main([a for a in args_in if a != "--cost"])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--tables", type=int, default=26)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--ids", type=int, default=20)
    ap.add_argument("--zipf", type=float, default=1.05)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--distinct", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "planner.md"))
    args = ap.parse_args(argv)
    cfg = {
        k: getattr(args, k)
        for k in ("tables", "rows", "dim", "batch", "ids", "zipf", "steps", "warmup", "rounds", "distinct")
    }
    load0 = load()
    lines = [
        "# Planner: run time and the throughput of its plans",
        "",
        f"Machine: {machine()}.",
        "",
        "## Planner run time, 1,000 tables x 4,096 ranks",
        "",
        "| model-parallel group | ranks per host | planner s | plan |",
        "|---:|---:|---:|---|",
    ]
    for mp in (8, 4096):
        dt, what = planner_runtime(mp)
        print(f"planner 1000 tables x 4096 ranks, mp {mp}: {dt:.2f} s; {what}", flush=True)
        lines.append(f"| {mp} | {min(8, mp)} | {dt:.2f} | {what} |")
    lines += [
        "",
        "## Plans on the benchmark workload (gloo, CPU)",
        "",
        f"Workload: {cfg['tables']} tables x {cfg['rows']:,} rows x {cfg['dim']} (fp32, SUM), {cfg['batch']:,} "
        f"samples per rank, bags of ~{cfg['ids']} Zipf-like ids, `sparse_grad=True` + SGD; {cfg['rounds']} "
        f"interleaved rounds x {cfg['steps']} timed steps after {cfg['warmup']} warm-up per plan. "
        "samples/s = world x batch / median over steps of the slowest rank's step time.",
        "",
        "| world | plan | estimated ms | measured median ms | samples/s | vs planner |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for world in args.world_sizes:
        plans, est, kinds = plans_for(cfg, world)
        print(f"world {world}: planner chose {kinds}", flush=True)
        times = run_distributed(worker, world, plans, cfg, timeout_s=1800)[0]
        med = {k: statistics.median(v) for k, v in times.items()}
        sps = {k: world * cfg["batch"] / v for k, v in med.items()}
        for k in plans:
            lines.append(
                f"| {world} | {k}{' ' + kinds if k == 'planner' else ''} | {est[k]:.0f} | {1e3 * med[k]:.0f} "
                f"| {sps[k]:,.0f} | {sps[k] / sps['planner']:.2f}x |"
            )
            print(lines[-1], flush=True)
    lines += [
        "",
        f"Load average at start: {load0}; at end: {load()}. With 2 cores, world 4 runs 4 processes on 2 "
        "cores: its times measure oversubscription, which the cost model does not know about.",
        "",
        f"Command: `python benchmarks/bench_planner.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    from bench_planner_cost import SECTION

    old = Path(args.out).read_text() if Path(args.out).exists() else ""
    kept = SECTION + old.split(SECTION, 1)[1] if SECTION in old else ""  # the cost study's section
    Path(args.out).write_text("\n".join(lines) + "\n" + ("\n" + kept if kept else ""))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
