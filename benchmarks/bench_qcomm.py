"""Quantized comms (``QCommsConfig``): the step time of fp32 against fp16 / bf16 pooled rows and gradients on the
wire, side by side in one run, through gloo (``LIGHTNING_REC_SHM=0``) and through the shared-memory transport.

2 processes, fused SGD, every table one sharding type (table-wise, row-wise, column-wise). A step is forward +
backward (the update runs in backward) + the fused optimizer's step; the slowest rank's median step over a
round, the median over rounds. All precisions alternate within each round, on the same batches.

    PYTHONPATH=$PWD python benchmarks/bench_qcomm.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_sharding import load, machine, make_batches

from lightning_rec import CommType, EmbeddingBagCollection, EmbeddingBagConfig, QCommsConfig, get_qcomm_codecs_registry
from lightning_rec.sharding import ShardingPlan, column_wise, fused_optimizer, row_wise, shard_modules, table_wise
from lightning_rec.testing import run_distributed

PRECISIONS = {
    "fp32": None,
    "fp16 fwd / bf16 bwd": QCommsConfig(forward_precision=CommType.FP16, backward_precision=CommType.BF16),
    "bf16 fwd / bf16 bwd": QCommsConfig(forward_precision=CommType.BF16, backward_precision=CommType.BF16),
}
PLANS = {
    "table_wise": lambda i: table_wise(rank=i % 2),
    "row_wise": lambda i: row_wise(),
    "column_wise": lambda i: column_wise(ranks=[0, 1]),
}


def _worker(rank: int, world: int, cfg: dict, transport: str) -> dict:
    os.environ["LIGHTNING_REC_SHM"] = "1" if transport == "shared memory" else "0"
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    torch.set_num_threads(1)
    batches = make_batches(cfg, seed=rank)
    tables = [EmbeddingBagConfig(cfg["rows"], cfg["dim"], f"t{i}", [f"f{i}"]) for i in range(cfg["tables"])]
    built = {}
    for plan_name, placement in PLANS.items():
        for prec, config in PRECISIONS.items():
            torch.manual_seed(0)
            ebc = EmbeddingBagCollection(tables, device="meta")
            plan = ShardingPlan({"": {t.name: placement(i) for i, t in enumerate(tables)}})
            ebc = shard_modules(
                ebc,
                plan,
                embedding_optimizer={"kind": "sgd", "lr": 0.01},
                qcomm_codecs_registry=get_qcomm_codecs_registry(config),
            )
            built[(plan_name, prec)] = (ebc, fused_optimizer(ebc))
    times: dict[tuple[str, str], list[float]] = {k: [] for k in built}

    def run(key: tuple[str, str], steps: int) -> float:
        ebc, opt = built[key]
        step_times = []
        for s in range(steps):
            torch.distributed.barrier()
            start = time.perf_counter()
            ebc(batches[s % len(batches)]).values().sum().backward()
            opt.step()
            step_times.append(time.perf_counter() - start)
        return statistics.median(step_times)

    for _ in range(cfg["rounds"]):
        for key in built:
            run(key, cfg["warmup"])
            times[key].append(run(key, cfg["steps"]))
    return {"times": {f"{p}|{q}": v for (p, q), v in times.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2048, help="samples per rank per step")
    ap.add_argument("--ids", type=int, default=10)
    ap.add_argument("--zipf", type=float, default=1.05)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--distinct", type=int, default=4)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "qcomm.md"))
    cfg = vars(ap.parse_args(argv))
    before = load()
    results = {t: run_distributed(_worker, 2, cfg, t, timeout_s=3600) for t in ("gloo", "shared memory")}
    after = load()
    b, d = cfg["batch"], cfg["dim"]
    lines = [
        "# Quantized comms: fp32 against fp16 / bf16 on the wire (2 processes)",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} with `PYTHONPATH=$PWD python benchmarks/bench_qcomm.py` -- {machine()}.",
        f"Job: {cfg['tables']} tables of {cfg['rows']:,} x {d} fp32, Zipf({cfg['zipf']}) ids, ~{cfg['ids']} ids per "
        f"bag, {b} samples per rank, fused SGD. The output dist moves {b} x {cfg['tables']} x {d} values per rank "
        f"each way ({b * cfg['tables'] * d * 4 / 2**20:.0f} MiB in fp32). Step = forward + backward + step, "
        f"median over {cfg['steps']} steps of the slowest rank, median of {cfg['rounds']} rounds "
        f"(load before / after: {before} / {after}).",
        "",
        "| transport | plan | precision | step (ms) | vs fp32 |",
        "| --- | --- | --- | --- | --- |",
    ]
    for transport, res in results.items():
        for plan in PLANS:
            step = {}
            for prec in PRECISIONS:
                key = f"{plan}|{prec}"
                step[prec] = statistics.median(max(r["times"][key][j] for r in res) for j in range(cfg["rounds"]))
            for prec, ms in step.items():
                lines.append(f"| {transport} | {plan} | {prec} | {1e3 * ms:.1f} | {step['fp32'] / ms:.2f}x |")
    lines += ["", "vs fp32 = fp32 step / this step (above 1: faster).", ""]
    Path(cfg["out"]).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
