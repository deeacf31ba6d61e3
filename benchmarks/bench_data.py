"""Reader throughput: rows/s per reader and format, by ranks x DataLoader workers, beside pyarrow's raw CSV read.

    PYTHONPATH=. python benchmarks/bench_data.py [--rows 200000] [--batch 8192] [--out benchmarks/results/data.md]

Writes a Criteo-format TSV file (hex ids of 8 digits, 20% missing integers, 10% missing ids), converts it with
``lightning-rec convert`` to Parquet and npy, then reads every format in the same run:

* one process, no workers (rows/s per core), beside ``pyarrow.csv.read_csv`` of the same file on one thread
  (the parser the TSV reader is built on: the ratio is the reader's overhead);
* R processes (ranks, each reading its own share, as under ``Trainer(devices=R)``) x W DataLoader workers
  each: total rows/s of the slowest rank's wall time.

Each figure is the best of ``--repeat`` rounds (the one least disturbed by other work on the machine).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import tempfile
import time

import numpy as np
import pyarrow.csv as pacsv
import torch

from lightning_rec.data import ClickLoader, CriteoNpy, CriteoParquet, CriteoTSV, SyntheticClicks
from lightning_rec.data.convert import convert


def write_tsv(path: str, n: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for s in range(0, n, 20000):
            m = min(20000, n - s)
            ints = rng.integers(0, 1000, (m, 13)).astype(str)
            ints[rng.random((m, 13)) < 0.2] = ""
            cats = np.char.mod("%08x", rng.integers(0, 2**32, (m, 26), dtype=np.uint64))
            cats[rng.random((m, 26)) < 0.1] = ""
            labels = rng.integers(0, 2, (m, 1)).astype(str)
            f.write("\n".join("\t".join(r) for r in np.concatenate([labels, ints, cats], axis=1).tolist()) + "\n")


def make(kind: str, paths: dict, batch: int, rank: int = 0, world: int = 1):
    if kind == "tsv":
        return CriteoTSV(paths["tsv"], batch, rank=rank, world_size=world)
    if kind == "parquet":
        return CriteoParquet(paths["parquet"], batch, rank=rank, world_size=world)
    if kind == "npy":
        return CriteoNpy(paths["npy"], batch, rank=rank, world_size=world)
    return SyntheticClicks(paths["rows"], batch, rank=rank, world_size=world, multi_hot={})


def _rank(kind: str, paths: dict, batch: int, rank: int, world: int, workers: int, queue) -> None:
    torch.set_num_threads(1)
    loader = ClickLoader(make(kind, paths, batch, rank, world), num_workers=workers)
    start = time.perf_counter()
    rows = sum(len(b) for b in loader)
    queue.put((rows, time.perf_counter() - start))


def run_ranks(kind: str, paths: dict, batch: int, world: int, workers: int) -> float:
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(kind, paths, batch, r, world, workers, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    return sum(r for r, _ in results) / max(t for _, t in results)


def best(fn, repeat: int) -> float:
    return max(fn() for _ in range(repeat))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/data.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t_all = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="bench_data_")
    paths = {
        "tsv": os.path.join(tmp, "day_0"),
        "parquet": os.path.join(tmp, "pq"),
        "npy": os.path.join(tmp, "npy"),
        "rows": args.rows,
    }
    write_tsv(paths["tsv"], args.rows)
    size_mb = os.path.getsize(paths["tsv"]) / 2**20
    conv = {}
    for fmt in ("parquet", "npy"):
        t = time.perf_counter()
        convert(paths["tsv"], paths[fmt], fmt)
        conv[fmt] = args.rows / (time.perf_counter() - t)

    def raw() -> float:
        t = time.perf_counter()
        table = pacsv.read_csv(
            paths["tsv"],
            read_options=pacsv.ReadOptions(autogenerate_column_names=True, use_threads=False),
            parse_options=pacsv.ParseOptions(delimiter="\t"),
        )
        return table.num_rows / (time.perf_counter() - t)

    def one(kind: str) -> float:
        ds = make(kind, paths, args.batch)
        t = time.perf_counter()
        rows = sum(len(b) for b in ds)
        return rows / (time.perf_counter() - t)

    raw_rate = best(raw, args.repeat)
    single = {k: best(lambda k=k: one(k), args.repeat) for k in ("tsv", "parquet", "npy", "synthetic")}
    grid = {}
    for kind in ("tsv", "parquet", "npy"):
        for world in (1, 2):
            for workers in (0, 2):
                grid[kind, world, workers] = best(
                    lambda: run_ranks(kind, paths, args.batch, world, workers), max(1, args.repeat - 1)
                )
    load = os.getloadavg()
    lines = [
        "# Data readers: rows/s",
        "",
        f"Machine: {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), Python "
        f"{platform.python_version()}, torch {torch.__version__}. Load average during the run "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (the machine is shared: compare figures of one run, "
        "not across runs).",
        "",
        f"Workload: {args.rows:,} Criteo-format lines ({size_mb:.1f} MiB; 8-digit hex ids, 20% missing integers, 10% "
        f"missing ids), batches of {args.batch:,} rows, one torch thread per process, best of {args.repeat} rounds. "
        f"Total benchmark time {(time.perf_counter() - t_all) / 60:.1f} min. Produced by `benchmarks/bench_data.py`.",
        "",
        "## One process, no workers (rows/s per core)",
        "",
        "| reader | rows/s | vs pyarrow raw CSV read |",
        "|---|---:|---:|",
        "| pyarrow.csv.read_csv, one thread (reference: parse only, no ids hashed, no batches) | "
        f"{raw_rate:,.0f} | 1.00 |",
    ]
    names = {
        "tsv": "CriteoTSV (pyarrow + numpy hex/hash)",
        "parquet": "CriteoParquet",
        "npy": "CriteoNpy (mmap)",
        "synthetic": "SyntheticClicks (generated)",
    }
    lines += [f"| {names[k]} | {v:,.0f} | {v / raw_rate:.2f} |" for k, v in single.items()]
    lines += [
        "",
        f"Conversion (`lightning-rec convert`, one process): TSV -> Parquet {conv['parquet']:,.0f} rows/s, "
        f"TSV -> npy {conv['npy']:,.0f} rows/s.",
        "",
        "## Ranks x workers (total rows/s over ranks; each rank reads only its share)",
        "",
        "| reader | ranks | workers per rank | rows/s | vs 1 rank, 0 workers |",
        "|---|---:|---:|---:|---:|",
    ]
    for (kind, world, workers), v in grid.items():
        lines.append(f"| {kind} | {world} | {workers} | {v:,.0f} | {v / grid[kind, 1, 0]:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
