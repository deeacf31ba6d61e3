"""The planner's cost model against measured steps: estimated vs measured per plan, rank correlation, ratio.

A 26-table Criteo-like job (table sizes of Criteo's 26 categorical features scaled down, dim 64, mixed pooling:
most features one id, a few multi-hot), fused SGD, 2 gloo processes on one host (the shared-memory transport).
Ten plans, the planner's among them, each timed as the median over interleaved rounds of the slowest rank's
step (forward + backward, the fused update inside backward). The planner's plan is timed a second time, under
another name, as the control: how far apart one plan measures twice in one run (the rank correlation and the
ratios leave it out).

Calibration (run first, same processes): the per-collective latency (an all-to-all of 8 bytes), the transport's
bandwidth (an all-to-all of 8 MiB per peer), and the lookup + update speed (a table-wise fused step of every
table on one rank, run by every rank at once, each in a group of its own: the ranks share the host's memory
system as in a real step; the same step alone at world 1 is reported beside it). These give the measured ``Hardware``; the plans are estimated with the library's default
``Hardware`` and with the measured one.

Usage:
    python benchmarks/bench_planner_cost.py                 # writes the section of benchmarks/results/planner.md
    python benchmarks/bench_planner_cost.py --rounds 2 --steps 4 --no-write
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sharding import load, machine

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, transport
from lightning_rec.pipeline.shard_modules import fused_optimizer
from lightning_rec.plans.planner.topology import Hardware
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
from lightning_rec.transport import shm

# Criteo Kaggle's 26 categorical cardinalities
CRITEO = [
    1460,
    583,
    10131227,
    2202608,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    8351593,
    3194,
    27,
    14992,
    5461306,
    10,
    5652,
    2173,
    4,
    7046547,
    18,
    15,
    286181,
    105,
    142572,
]
MULTI_HOT = {2: 20, 3: 8, 11: 30, 15: 5, 20: 12}  # feature index -> ids per sample; others one
SECTION = "## Cost model: estimated vs measured (fused SGD, Criteo-like, 2 processes)"
SPEC = {"kind": "sgd", "lr": 0.01}
AGAIN = "planner, again"


def make_tables(cfg: dict) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(max(int(n * cfg["scale"]), 4), cfg["dim"], f"t{i}", [f"f{i}"]) for i, n in enumerate(CRITEO)
    ]


def pooling() -> dict[str, float]:
    return {f"f{i}": float(MULTI_HOT.get(i, 1)) for i in range(len(CRITEO))}


def make_batches(cfg: dict, seed: int) -> list[KeyedJaggedTensor]:
    g = torch.Generator().manual_seed(seed)
    tables, out = make_tables(cfg), []
    for _ in range(2):
        lengths, values = [], []
        for i, t in enumerate(tables):
            k = MULTI_HOT.get(i, 1)
            ln = (
                torch.randint(max(k // 2, 1), k + k // 2 + 1, (cfg["batch"],), generator=g)
                if k > 1
                else torch.ones(cfg["batch"], dtype=torch.long)
            )
            lengths.append(ln)
            # Zipf-like ids: most traffic on few rows, as in click logs
            u = torch.rand(int(ln.sum()), generator=g)
            values.append((t.num_embeddings * u.pow(3)).long().clamp_(max=t.num_embeddings - 1))
        out.append(
            KeyedJaggedTensor([f"f{i}" for i in range(len(tables))], torch.cat(values), lengths=torch.cat(lengths))
        )
    return out


def plans_for(cfg: dict, world: int, planner: Planner) -> dict[str, ShardingPlan]:
    tables = make_tables(cfg)
    names = [t.name for t in tables]
    big = sorted(tables, key=lambda t: -t.num_embeddings)[:6]
    big_names = {t.name for t in big}
    by_size = sorted(tables, key=lambda t: -t.num_embeddings * t.embedding_dim)
    greedy, load_ = {}, [0.0] * world
    for t in by_size:  # table-wise, each table on the rank with the fewest rows so far
        r = int(np.argmin(load_))
        greedy[t.name], load_[r] = table_wise(r), load_[r] + t.num_embeddings
    cols = list(range(world))

    def plan(d: dict) -> ShardingPlan:
        return ShardingPlan({"": d})

    return {
        "planner": planner.plan(tables),
        "table_wise round-robin": plan({n: table_wise(i % world) for i, n in enumerate(names)}),
        "table_wise by rows": plan(greedy),
        "table_wise all on rank 0": plan({n: table_wise(0) for n in names}),
        "row_wise": plan({n: row_wise() for n in names}),
        "column_wise": plan({n: column_wise(cols) for n in names}),
        "row_wise big, table_wise rest": plan(
            {n: row_wise() if n in big_names else table_wise(i % world) for i, n in enumerate(names)}
        ),
        "column_wise big, table_wise rest": plan(
            {n: column_wise(cols) if n in big_names else table_wise(i % world) for i, n in enumerate(names)}
        ),
        "data_parallel small, table_wise big": plan(
            {n: table_wise(i % world) if n in big_names else data_parallel() for i, n in enumerate(names)}
        ),
        "data_parallel": plan({n: data_parallel() for n in names}),
    }


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        slowest = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        times.append(float(slowest))
    return statistics.median(times)


def calibrate_transport(rank: int, world: int) -> dict:
    """Per-collective latency and bytes per second of the transport between the ranks of this host."""
    out: dict[str, float] = {}
    for n, key in ((1, "tiny"), (1 << 20, "big")):  # int64 elements per peer: 8 B, 8 MiB
        x = torch.ones(world * n, dtype=torch.int64)
        y = torch.empty_like(x)
        for _ in range(5):
            transport.all_to_all_single(y, x, [n] * world, [n] * world, None)
        # ten collectives per timing: a barrier and a max of one would dominate a microsecond collective
        out[key] = (
            _median_time(
                lambda: [transport.all_to_all_single(y, x, [n] * world, [n] * world, None) for _ in range(10)], 15
            )
            / 10
        )
    latency = out["tiny"]
    peer_bytes = (world - 1) * 8 * (1 << 20)  # sent to (and received from) the other ranks
    return {"collective_latency": latency, "transport_bandwidth": peer_bytes / max(out["big"] - latency, 1e-9)}


_WAITED = [0.0]  # seconds this rank spent in the shared-memory transport's waits for its peers


def _count_waits() -> None:
    """Time the transport's waits for peers, so that a rank's own work is its step minus them (once)."""
    cls = shm._SharedGroup
    if getattr(cls, "_bench_timed", False):
        return
    orig = cls._wait_all

    def timed(self):
        t0 = time.perf_counter()
        try:
            return orig(self)
        finally:
            _WAITED[0] += time.perf_counter() - t0

    cls._wait_all, cls._bench_timed = timed, True


def _median_time_of_steps(model, batches: list[KeyedJaggedTensor], cfg: dict) -> tuple[float, float]:
    """The median step of the slowest rank, and this rank's median own work (its step minus its waits)."""
    opt = fused_optimizer(model)
    count = iter(range(10**9))
    own: list[float] = []

    def step() -> None:
        waited, t0 = _WAITED[0], time.perf_counter()
        model(batches[next(count) % len(batches)]).values().square().mean().backward()
        if opt is not None:  # a rank holding no table has no fused optimizer
            opt.step()  # the kernel updated in backward; this ends its step (and pushes the lr)
        own.append(time.perf_counter() - t0 - (_WAITED[0] - waited))

    for _ in range(cfg["warmup"]):
        step()
    own.clear()
    return _median_time(step, cfg["steps"]), statistics.median(own)


def time_plans(
    rank: int, world: int, plans: dict[str, ShardingPlan], cfg: dict, group: dist.ProcessGroup | None = None
) -> dict[str, list[tuple[float, float]]]:
    """Per plan and round: (the slowest rank's median step, this rank's median own work); ``group``: the
    shard group (default: every rank)."""
    import warnings

    warnings.filterwarnings("ignore", message=r".*Sparse invariant checks.*")
    _count_waits()
    batches = make_batches(cfg, seed=1000 + rank)
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in plans}
    names = list(plans)
    for r in range(cfg["rounds"]):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate: no plan always runs first
            torch.manual_seed(0)
            model = shard_modules(
                EmbeddingBagCollection(make_tables(cfg), device="meta"),
                plans[name],
                process_group=group,
                embedding_optimizer=SPEC,
            )
            times[name].append(_median_time_of_steps(model, batches, cfg))
    return times


def lookup_job(rank: int, world: int, cfg: dict) -> float:
    """Every rank at once, each with every table on itself (its own group of one): the step is lookups and
    updates (collectives stay local), with the other ranks of the host busy as they are in a real step."""
    tables = make_tables(cfg)
    plan = ShardingPlan({"": {t.name: table_wise(0) for t in tables}})
    groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group, in one order
    return min(step for step, _ in time_plans(rank, world, {"local": plan}, cfg, groups[rank])["local"])


def measured_hardware(cfg: dict, base: Hardware, comm: dict, local_step_s: float) -> Hardware:
    """The defaults with the measured speeds: latency and transport bandwidth as measured; lookup and update
    bandwidths scaled by one factor so the default model's lookup + update time of the local step matches."""
    tables = make_tables(cfg)
    planner = Planner(
        Topology(1, hardware=dataclasses.replace(base, collective_latency=0.0)),
        batch_size=cfg["batch"],
        pooling_factors=pooling(),
        optimizer="sgd",
        gradients="fused",
    )
    rep = planner.estimate(tables, ShardingPlan({"": {t.name: table_wise(0) for t in tables}}))
    modelled = float(rep.time[0:2].sum())  # lookup + update of the one rank
    k = modelled / local_step_s
    bw = comm["transport_bandwidth"]
    return dataclasses.replace(
        base,
        lookup_bandwidth=base.lookup_bandwidth * k,
        update_bandwidth=base.update_bandwidth * k,
        host_lookup_bandwidth=base.host_lookup_bandwidth * k,
        intra_host_bandwidth=bw,
        inter_host_bandwidth=bw,
        collective_latency=comm["collective_latency"],
    )


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--scale", type=float, default=0.01)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "planner.md"))
    args = ap.parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("scale", "dim", "batch", "steps", "warmup", "rounds")}
    world, load0 = args.world, load()
    default = Hardware.defaults("cpu")
    comm = run_distributed(calibrate_transport, world, timeout_s=600)[0]
    alone = run_distributed(lookup_job, 1, cfg, timeout_s=600)[0]
    local_step = run_distributed(lookup_job, world, cfg, timeout_s=600)[0]
    fitted = measured_hardware(cfg, default, comm, local_step)
    print(f"calibration: {comm}, local step {1e3 * local_step:.2f} ms -> {fitted}", flush=True)
    tables = make_tables(cfg)

    def planner_with(hw: Hardware) -> Planner:
        return Planner(
            Topology(world, hardware=hw),
            batch_size=cfg["batch"],
            pooling_factors=pooling(),
            optimizer="sgd",
            gradients="fused",
        )

    plans = plans_for(cfg, world, planner_with(default))
    plans["planner (measured speeds)"] = planner_with(fitted).plan(tables)
    # the control: one plan measured twice in the same rounds gives the run's noise floor
    plans[AGAIN] = plans["planner"]
    by_rank = run_distributed(time_plans, world, plans, cfg, timeout_s=1800)
    med = {k: 1e3 * statistics.median(step for step, _ in v) for k, v in by_rank[0].items()}
    # each rank's own work (its step minus its waits for the others), median over rounds
    own = {k: [1e3 * statistics.median(w for _, w in r[k]) for r in by_rank] for k in plans}
    summary = []
    for label, hw in (("default", default), ("measured", fitted)):
        est = {k: planner_with(hw).estimate(tables, p).step_time_ms for k, p in plans.items()}
        names = [k for k in plans if k != AGAIN]
        rho = spearman([est[k] for k in names], [med[k] for k in names])
        ratio = [est[k] / med[k] for k in names]
        summary.append((label, rho, ratio, est))
    best = min(med.values())
    lines = [
        SECTION,
        "",
        f"Date: {datetime.date.today()}. Machine: {machine()}.",
        "",
        f"Workload: 26 tables of Criteo's categorical sizes x {args.scale} (min 4 rows), dim {args.dim}, fp32; "
        f"{args.batch:,} samples per rank; features {sorted(MULTI_HOT)} multi-hot "
        f"({sorted(MULTI_HOT.values())} ids), the others one id; Zipf-like ids; fused SGD; {world} processes; "
        f"{args.rounds} interleaved rounds x median of {args.steps} steps after {args.warmup} warm-up.",
        "",
        f"Calibration: per-collective latency {1e6 * comm['collective_latency']:.0f} us, transport "
        f"{comm['transport_bandwidth'] / 1e9:.2f} GB/s per peer, a local step with every table on one process "
        f"{1e3 * alone:.2f} ms alone and {1e3 * local_step:.2f} ms with each of the {world} processes running "
        f"its own at once -> lookup {fitted.lookup_bandwidth / 1e9:.2f} GB/s, update "
        f"{fitted.update_bandwidth / 1e9:.2f} GB/s (from the latter).",
        "",
        "| plan | measured ms | est. default ms | ratio | est. measured-speeds ms | ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for k in plans:
        mark = " (best)" if med[k] == best else ""
        lines.append(
            f"| {k}{mark} | {med[k]:.2f} | {summary[0][3][k]:.2f} | {summary[0][3][k] / med[k]:.2f} "
            f"| {summary[1][3][k]:.2f} | {summary[1][3][k] / med[k]:.2f} |"
        )
    lines.append("")
    lines += [
        "",
        "Per rank: own work measured (the step minus the waits for the other ranks inside the shared-memory "
        "transport) against the default model's estimate of that rank (ms).",
        "",
        "| plan | " + " | ".join(f"rank {r} measured / est." for r in range(world)) + " |",
        "|---|" + "---:|" * world,
    ]
    for k, p in plans.items():
        est_r = planner_with(default).estimate(tables, p).rank_time_ms
        cells = " | ".join(f"{own[k][r]:.2f} / {est_r[r]:.2f}" for r in range(world))
        lines.append(f"| {k} | {cells} |")
    lines.append("")
    for label, rho, ratio, _ in summary:
        lines.append(
            f"- {label} speeds: Spearman {rho:.2f}; estimate/measured median {statistics.median(ratio):.2f} "
            f"(range {min(ratio):.2f}-{max(ratio):.2f})"
        )
    for k in ("planner", "planner (measured speeds)"):
        lines.append(f"- {k}: {med[k]:.2f} ms measured, {100 * (med[k] / best - 1):.1f}% above the best measured")
    same = [k for k, p in plans.items() if p.plan == plans["planner"].plan]  # the control, and any twin
    lo, hi = min(med[k] for k in same), max(med[k] for k in same)
    lines.append(
        f"- noise floor: the planner's plan, measured {len(same)} times in the same rounds ({', '.join(same)}): "
        f"{lo:.2f}-{hi:.2f} ms ({100 * (hi / lo - 1):.1f}% apart); plans closer than that are not ordered by this run"
    )
    lines += [
        "",
        f"Load average at start: {load0}; at end: {load()}.",
        "",
        f"Command: `python benchmarks/bench_planner_cost.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        out = Path(args.out)
        old = out.read_text() if out.exists() else ""
        keep = old.split(SECTION)[0].rstrip()
        out.write_text((keep + "\n\n" if keep else "") + text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
