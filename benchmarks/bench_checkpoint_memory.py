"""Resume peak memory of a fused row-wise Adagrad checkpoint, and its size on disk (issue 14, item 6).

Workload (defaults): one table of 2,000,000 rows x 64 dims fp32 (512 MB), sharded row-wise over 2 gloo
processes, updated by the fused row-wise Adagrad (one state value per row). Each rank: builds the sharded
model, takes one step, saves; then drops it, builds a fresh model and loads the checkpoint (a resume).

Reported per rank, in MB of resident memory above the process's baseline (imports done, no model):
``steady`` = model + optimizer state after the load; ``peak`` = the highest value sampled (every 1 ms) during
the load; and their ratio. Compared in one run: pieces written in row blocks (``CHUNK_BYTES``, the default)
and as whole shards. ``--label`` names a row (e.g. to append a run of an older commit with PYTHONPATH set).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.environ.get("BENCH_LIB", str(Path(__file__).resolve().parent.parent)))

from _memory import peak_during, rss_mib

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, ShardingPlan
from lightning_rec import checkpoint as ckpt
from lightning_rec.sharding import fused_optimizer, row_wise, shard_modules
from lightning_rec.sparse import KeyedJaggedTensor
from lightning_rec.testing import run_distributed


def _model(rows: int, dim: int):
    tables = [EmbeddingBagConfig(name="t", num_embeddings=rows, embedding_dim=dim, feature_names=["f"])]
    model = shard_modules(
        EmbeddingBagCollection(tables),
        ShardingPlan({"": {"t": row_wise()}}),
        embedding_optimizer={"kind": "rowwise_adagrad", "lr": 0.1},
    )
    return model, fused_optimizer(model)


def _job(rank: int, ws: int, rows: int, dim: int, path: str, chunk: bool) -> dict:
    if hasattr(ckpt, "placement") and not chunk:
        ckpt.placement.CHUNK_BYTES = 1 << 62
    gc.collect()
    base = rss_mib()
    model, opt = _model(rows, dim)
    ids = torch.arange(rank, rows, max(1, rows // 4096))
    kjt = KeyedJaggedTensor(["f"], ids, lengths=torch.ones(len(ids), dtype=torch.long))
    model(kjt).values().pow(2).mean().backward()
    opt.step()
    t0 = time.perf_counter()
    ckpt.save(path, model, [opt])
    save_s = time.perf_counter() - t0
    del model, opt, kjt
    gc.collect()
    model, opt = _model(rows, dim)
    gc.collect()
    t0 = time.perf_counter()
    _, peak = peak_during(lambda: ckpt.load(path, model, [opt]))
    load_s = time.perf_counter() - t0
    gc.collect()
    steady = rss_mib()
    return {"steady": steady - base, "peak": peak - base, "save_s": save_s, "load_s": load_s}


def _disk_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--label", default="this commit")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "checkpoint_memory.md"))
    ap.add_argument("--append", action="store_true")
    args = ap.parse_args()
    weights_mb = args.rows * args.dim * 4 / 2**20
    lines = (
        []
        if args.append
        else [
            "# Resume peak memory: fused row-wise Adagrad, one table row-wise over 2 processes",
            "",
            f"{args.rows:,} x {args.dim} fp32 = {weights_mb:.0f} MB of weights ({weights_mb / 2:.0f} MB per rank); "
            f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} cores. MB of resident memory above "
            "each process's baseline; `peak / steady` is the resume's peak over the memory the resumed model holds.",
            "",
            "| code | pieces | rank | steady MB | load peak MB | peak / steady | on disk MB | save s | load s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
    )
    for chunk in (True, False) if hasattr(ckpt, "placement") else (False,):
        tmp = Path(tempfile.mkdtemp())
        try:
            res = run_distributed(_job, 2, args.rows, args.dim, str(tmp / "c"), chunk, timeout_s=900)
            disk = _disk_mb(tmp / "c")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        for rank, r in enumerate(res):
            lines.append(
                f"| {args.label} | {'row blocks' if chunk else 'whole shards'} | {rank} | {r['steady']:.0f} "
                f"| {r['peak']:.0f} | {r['peak'] / r['steady']:.2f} | {disk:.0f} | {r['save_s']:.2f} "
                f"| {r['load_s']:.2f} |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "a" if args.append else "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
