"""Resident memory of serving workers that load one quantized model: tables mapped from one file vs private copies.

``save_quantized`` writes a DLRM-like model (``--tables`` int8 tables of ``--rows`` x ``--dim`` plus a small head)
to one file; 1, 2, 3 worker processes each build the model on the meta device, then ``load_quantized_tables`` it
(``mmap=True``: tables mapped read-only and shared; ``mmap=False``: read into private memory) and score
``--batches`` batches of ``--batch`` samples (random ids: most of every table's pages get read). The parent reads each
worker's ``/proc/<pid>/smaps_rollup`` (each worker first scores a few batches of a tiny model: the libraries
and allocator working set every worker pays whatever its tables are not counted) (Rss, Pss, Private_Clean + Private_Dirty) once every worker is ready and again
once every worker has loaded and scored: the sum of the workers' Pss growth is the memory the workers added
(Pss splits a shared page among its mappers, so summing over processes counts each page once). "extra per added
worker" is that sum at k workers minus the sum at k - 1, as a fraction of the tables' bytes.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_quant_shared.py [--out benchmarks/results/quant_shared.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

_WORKER = r"""
import sys, torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[5])
from bench_quant_shared import Model, batch
from lightning_rec.quant import load_quantized_tables, quantize_embeddings
path, mmap, batches, size = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4])
with torch.device("meta"):
    skeleton = Model()
# what every worker pays whatever its tables: the libraries the lookups load, the allocator's working set
warm = quantize_embeddings(Model(rows=64), torch.qint8)
with torch.inference_mode():
    for i in range(3):
        warm(batch(size, seed=i, rows=64))
del warm
print("ready", flush=True)
sys.stdin.readline()
m = load_quantized_tables(path, skeleton, mmap=mmap)
with torch.inference_mode():
    for i in range(batches):
        m(batch(size, seed=i))
print("done", flush=True)
sys.stdin.readline()
"""

TABLES, ROWS, DIM = 26, 100_000, 64


class Model(torch.nn.Module):
    """A DLRM-like model: ``TABLES`` tables, one feature each, and a linear head."""

    def __init__(self, rows: int = ROWS) -> None:
        super().__init__()
        from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig

        cfg = [
            EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=DIM, feature_names=[f"f{i}"])
            for i in range(TABLES)
        ]
        self.sparse = EmbeddingBagCollection(cfg)
        self.head = torch.nn.Linear(TABLES * DIM, 1)

    def forward(self, kjt) -> torch.Tensor:
        return self.head(self.sparse(kjt).values())


def batch(size: int, seed: int, rows: int = ROWS):
    from lightning_rec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4, (TABLES * size,), generator=g)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor([f"f{i}" for i in range(TABLES)], values, lengths=lengths)


def rollup(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        k, _, v = line.partition(":")
        if v.strip().endswith("kB"):
            out[k] = int(v.split()[0]) * 1024
    out["Private"] = out["Private_Clean"] + out["Private_Dirty"]
    return out


def run(path: Path, workers: int, mmap: bool, batches: int, size: int) -> list[dict[str, int]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _WORKER,
                str(path),
                "1" if mmap else "0",
                str(batches),
                str(size),
                str(ROOT / "benchmarks"),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(workers)
    ]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        before = [rollup(p.pid) for p in procs]
        for p in procs:  # one after the other: the later ones find the pages in the page cache
            p.stdin.write("go\n")
            p.stdin.flush()
            assert p.stdout.readline().strip() == "done"
        after = [rollup(p.pid) for p in procs]
        return [{k: a[k] - b[k] for k in ("Rss", "Pss", "Private")} for a, b in zip(after, before)]
    finally:
        for p in procs:
            p.communicate("bye\n", timeout=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "quant_shared.md")
    args = ap.parse_args()
    from lightning_rec.quant import quantize_embeddings, save_quantized

    with tempfile.TemporaryDirectory(dir=ROOT / "benchmarks") as tmp:
        q = quantize_embeddings(Model(), torch.qint8)
        table_bytes = q.sparse.storage_bytes()
        path = save_quantized(q, Path(tmp) / "dlrm_int8.lrq")
        del q
        mb = 1 << 20
        lines = [
            "# Serving workers sharing one copy of the quantized tables",
            "",
            f"Measured {time.strftime('%Y-%m-%d')} with `PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_quant_shared.py`"
            f" -- {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}.",
            "",
            f"Model: {TABLES} int8 tables of {ROWS:,} x {DIM} ({table_bytes / mb:.0f} MiB of stored rows) + a linear head, "
            f"written by `save_quantized`; each worker builds it on the meta device, loads it with "
            f"`load_quantized_tables(path, model, mmap=...)` and scores {args.batches} batches of {args.batch}. "
            "Memory: each worker's growth (smaps_rollup after load + scoring minus before load), MiB; "
            "extra = sum of the workers' Pss growth minus that sum with one worker fewer.",
            "",
            "| load | workers | per-worker Rss growth | per-worker Pss growth | per-worker Private growth | sum Pss growth | extra for the added worker (% of tables) |",
            "| --- | ---: | --- | --- | --- | ---: | ---: |",
        ]
        for mmap in (True, False):
            prev = 0
            for k in (1, 2, 3):
                res = run(path, k, mmap, args.batches, args.batch)
                total = sum(r["Pss"] for r in res)
                extra = "" if k == 1 else f"{(total - prev) / mb:.1f} MiB ({100 * (total - prev) / table_bytes:.1f}%)"
                fmt = lambda key: " / ".join(f"{r[key] / mb:.0f}" for r in res)  # noqa: E731
                lines.append(
                    f"| {'mmap=True (shared)' if mmap else 'mmap=False (private)'} | {k} | {fmt('Rss')} | {fmt('Pss')} | "
                    f"{fmt('Private')} | {total / mb:.1f} | {extra} |"
                )
                print(lines[-1], flush=True)
                prev = total
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
