"""The sharded pipeline before / after a change, and with input pipelining, side by side in one run (gloo, CPU).

Same job as ``bench_vs_torchrec.py`` (its tables, Zipf ids, loss, SGD and timing rules; lightning_rec only):
``--jobs`` x world 2 x ``--plans`` x ``--variants``. Three contenders run the same configuration one after the
other, in an order that alternates per configuration (so that a slow phase of a shared machine does not
land on one side only):

  * ``before``: lightning_rec from ``--before`` (a directory holding an older ``lightning_rec`` package, e.g.
    ``git archive <commit> lightning_rec | tar -x -C DIR``), the plain loop;
  * ``after``: this checkout, the plain loop (forward, backward, optimizer step per batch);
  * ``pipelined``: this checkout, batch i+1's input dist started before batch i trains (``InputPrefetcher``,
    what ``TrainPipelineSparseDist`` and ``RecShardedStrategy(pipeline=True)`` do).

Cells: global samples/s (and of the median step); others = cores other processes used meanwhile (see
``bench_vs_torchrec.py``). Writes ``--out`` (markdown). Not part of the tests.

Usage:
    git archive 5ee0af6 lightning_rec | tar -x -C /tmp/before
    python benchmarks/bench_pipeline.py --before /tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helpers of bench_vs_torchrec (no lightning_rec)

from bench_vs_torchrec import (
    RESULT,
    build_lightning_rec,
    busy_seconds,
    free_port,
    job_tables,
    load,
    make_batches,
)

ROOT = Path(__file__).resolve().parents[1]
CONTENDERS = ("before", "after", "pipelined")


def run_config(contender: str, rank: int, world: int, cmd: dict) -> dict:
    cfg = cmd["cfg"]
    tables = job_tables(cmd["job"], cfg)
    batches = make_batches(tables, cfg, seed=1000 + rank)
    torch.manual_seed(0)
    dist.barrier()
    model, make_kjt, opt = build_lightning_rec(tables, cmd["plan"], cmd["variant"], world, cfg["lr"])
    kjts = [(make_kjt(lg, v), y) for lg, v, y in batches]
    prefetcher = None
    if contender == "pipelined":
        from lightning_rec.distributed.train_pipeline import InputPrefetcher  # the "before" tree has none

        prefetcher = InputPrefetcher(model)

    def step(batch) -> float:
        kjt, labels = batch
        loss = F.binary_cross_entropy_with_logits(model(kjt).values().mean(1), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    def loop(first: int, n: int, times: list[float] | None) -> None:
        started = prefetcher.start(kjts[first % len(kjts)][0]) if prefetcher else []
        for i in range(first, first + n):
            s0 = time.perf_counter()
            ahead = prefetcher.start(kjts[(i + 1) % len(kjts)][0]) if prefetcher and i + 1 < first + n else []
            if prefetcher:
                with prefetcher.feeding(started):  # the forward takes the input dist started a step ago
                    step(kjts[i % len(kjts)])
            else:
                step(kjts[i % len(kjts)])
            started = ahead
            if times is not None:
                times.append(time.perf_counter() - s0)

    loop(0, cfg["warmup"], None)
    dist.barrier()
    busy0, cpu0, t0 = busy_seconds(), time.process_time(), time.perf_counter()
    times: list[float] = []
    loop(cfg["warmup"], cfg["steps"], times)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    busy1 = busy_seconds()
    return {
        "elapsed": elapsed,
        "step_times": times,
        "own_cpu": time.process_time() - cpu0,
        "busy": None if busy0 is None or busy1 is None else busy1 - busy0,
    }


def worker(contender: str, rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for line in sys.stdin:
        try:
            res = {"ok": True, **run_config(contender, rank, world, json.loads(line))}
        except Exception as e:  # reported to the driver
            res = {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
        print(RESULT + json.dumps(res), flush=True)
    dist.destroy_process_group()


class Group:
    """``world`` persistent workers of one contender, fed configurations over stdin."""

    def __init__(self, contender: str, world: int, before: str) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        env["PYTHONPATH"] = before if contender == "before" else str(ROOT)
        port = free_port()
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--worker",
                    contender,
                    "--rank",
                    str(r),
                    "--world",
                    str(world),
                    "--port",
                    str(port),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            for r in range(world)
        ]

    def run(self, cmd: dict) -> list[dict]:
        for p in self.procs:
            p.stdin.write(json.dumps(cmd) + "\n")
            p.stdin.flush()
        out = []
        for p in self.procs:
            line = p.stdout.readline()
            while line and not line.startswith(RESULT):
                line = p.stdout.readline()
            out.append(json.loads(line[len(RESULT) :]) if line else {"ok": False, "error": "worker exited"})
        return out

    def close(self) -> None:
        for p in self.procs:
            p.stdin.close()
        for p in self.procs:
            p.wait(timeout=60)


def summarize(res: list[dict], cfg: dict, world: int) -> dict | str:
    bad = [r for r in res if not r["ok"]]
    if bad:
        return bad[0]["error"]
    elapsed = max(r["elapsed"] for r in res)
    med = statistics.median(max(ts) for ts in zip(*(r["step_times"] for r in res)))
    busy = res[0]["busy"]
    others = None if busy is None else max(0.0, busy - sum(r["own_cpu"] for r in res)) / res[0]["elapsed"]
    cpu_ms = 1e3 * statistics.mean(r["own_cpu"] for r in res) / cfg["steps"]
    return {
        "sps": world * cfg["batch"] * cfg["steps"] / elapsed,
        "med": world * cfg["batch"] / med,
        "others": others,
        "cpu_ms": cpu_ms,
    }


def cell(s: dict | str) -> str:
    if isinstance(s, str):
        return f"fails: {s}"
    others = "?" if s["others"] is None else f"{s['others']:.2f}"
    return f"{s['sps'] / 1e3:.1f}k (med {s['med'] / 1e3:.1f}k; cpu {s['cpu_ms']:.1f} ms; others {others})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", help="directory holding the older lightning_rec package")
    ap.add_argument("--jobs", nargs="+", default=["big"], choices=["big", "dlrm"])
    ap.add_argument("--plans", nargs="+", default=["table_wise", "row_wise", "column_wise", "data_parallel"])
    ap.add_argument("--variants", nargs="+", default=["fused", "dense"], choices=["fused", "dense"])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pipeline.md"))
    ap.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.rank, args.world, args.port)
        return 0
    cfg = {
        "big_tables": 8,
        "rows": 100_000,
        "dlrm_scale": 1.0,
        "dim": 64,
        "batch": args.batch,
        "ids": 20,
        "zipf": 1.05,
        "lr": 0.5,
        "warmup": args.warmup,
        "steps": args.steps,
        "distinct": 4,
    }
    contenders = [c for c in CONTENDERS if c != "before" or args.before]
    load0, t0 = load(), time.monotonic()
    groups = {c: Group(c, args.world, args.before or "") for c in contenders}
    rows = []
    try:
        n = 0
        for job in args.jobs:
            for variant in args.variants:
                for plan in args.plans:
                    cmd = {"cfg": cfg, "job": job, "plan": plan, "variant": variant}
                    order = contenders if n % 2 == 0 else contenders[::-1]
                    n += 1
                    got = {c: summarize(groups[c].run(cmd), cfg, args.world) for c in order}
                    rows.append((job, plan, variant, order[0], got))
                    print(job, plan, variant, {c: cell(s) for c, s in got.items()}, flush=True)
    finally:
        for g in groups.values():
            g.close()
    lines = [
        "# Sharded pipeline: before / after / pipelined, side by side (`benchmarks/bench_pipeline.py`)",
        "",
        f"gloo, CPU, {args.world} processes, 1 thread each; job as in bench_vs_torchrec (8 tables x 100,000 x 64 for "
        f"`big`), {args.batch} samples per rank, {args.warmup} warm-up + {args.steps} timed steps. Load average "
        f"before / after: {load0} / {load()}; total {time.monotonic() - t0:.0f} s.",
        "",
        "Cells: global samples/s (med = from the slowest rank's median step; cpu = CPU time per step of one "
        "process, its gloo threads included, mean over ranks: the work, which the load of other processes "
        "disturbs far less than the wall time; others = cores other processes used meanwhile). Ratios: samples/s, "
        "and in brackets the inverse ratio of CPU ms per step.",
        "",
        "| job | plan | variant | first | " + " | ".join(contenders) + " | after / before | pipelined / after |",
        "|---|---|---|---|" + "---|" * len(contenders) + "---|---|",
    ]

    def ratio(a, b) -> str:
        if isinstance(a, str) or isinstance(b, str):
            return "-"
        return f"{a['sps'] / b['sps']:.2f}x ({b['cpu_ms'] / a['cpu_ms']:.2f}x)"

    for job, plan, variant, first, got in rows:
        cells = " | ".join(cell(got[c]) for c in contenders)
        ab = ratio(got["after"], got["before"]) if "before" in got else "-"
        lines.append(
            f"| {job} | {plan} | {variant} | {first} | {cells} | {ab} | {ratio(got['pipelined'], got['after'])} |"
        )
    lines += ["", f"Command: `python benchmarks/bench_pipeline.py {' '.join(sys.argv[1:])}`", ""]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
