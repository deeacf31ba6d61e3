"""Peak memory per rank while sharding one large table row-wise over 2 processes (issue 14, item 6).

Workload (defaults): one table of 10,000,000 rows x 64 dims fp32 (2.4 GiB), sharded row-wise over 2 gloo
processes (1.2 GiB per rank). Each configuration builds the collection, shards it and takes one training
step; compared in one run:

- **build**: ``cpu`` (the whole table built on every rank, then cut) or ``meta`` (shapes only; ``shard_modules``
  allocates the local shard and fills it from the table config's init);
- **update**: ``plain`` (the shard is a Parameter for a torch optimizer) or ``fused`` (fbgemm's row-wise
  Adagrad kernel, which owns the shard's storage).

Reported per rank, in MiB of resident memory above the process's baseline (imports done, no model):
``peak`` = the highest value sampled (every 1 ms) while building and sharding; ``steady`` = after sharding
and one step, the model alive; and their ratio. ``--label`` names the rows (run it again with
``BENCH_LIB=<checkout of another commit>`` and ``--append`` to add that commit's figures).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, os.environ.get("BENCH_LIB", str(Path(__file__).resolve().parent.parent)))

from _memory import peak_during, rss_mib

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, ShardingPlan
from lightning_rec.sharding import fused_optimizer, row_wise, shard_modules
from lightning_rec.sparse import KeyedJaggedTensor
from lightning_rec.testing import run_distributed


def _job(rank: int, ws: int, rows: int, dim: int, build: str, fused: bool) -> dict:
    torch.set_num_threads(1)
    gc.collect()
    base = rss_mib()
    tables = [EmbeddingBagConfig(name="t", num_embeddings=rows, embedding_dim=dim, feature_names=["f"])]
    optimizer = {"kind": "rowwise_adagrad", "lr": 0.1} if fused else None

    def build_and_shard():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the large-table warning of the cpu build
            return shard_modules(
                EmbeddingBagCollection(tables, device=build),
                ShardingPlan({"": {"t": row_wise()}}),
                embedding_optimizer=optimizer,
            )

    t0 = time.perf_counter()
    model, peak = peak_during(build_and_shard)
    shard_s = time.perf_counter() - t0
    ids = torch.arange(rank, rows, max(1, rows // 4096))
    kjt = KeyedJaggedTensor(["f"], ids, lengths=torch.ones(len(ids), dtype=torch.long))
    model(kjt).values().pow(2).mean().backward()
    opt = fused_optimizer(model) if fused else torch.optim.SGD(model.parameters(), lr=0.1)
    opt.step()
    gc.collect()
    steady = rss_mib()
    return {"peak": peak - base, "steady": steady - base, "shard_s": shard_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--label", default="this commit")
    ap.add_argument("--configs", default="cpu:plain,meta:plain,cpu:fused,meta:fused")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "shard_memory.md"))
    ap.add_argument("--append", action="store_true")
    args = ap.parse_args()
    full = args.rows * args.dim * 4 / 2**20
    lines = (
        []
        if args.append
        else [
            "# Peak memory per rank while sharding one table row-wise over 2 processes",
            "",
            f"{args.rows:,} x {args.dim} fp32 = {full:,.0f} MiB of weights ({full / 2:,.0f} MiB per rank); "
            f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} cores. MiB of resident memory "
            "above each process's baseline: `peak` while building and sharding, `steady` after one training step "
            "(`plain`: SGD over the shard's Parameter, whose dense gradient adds a shard-sized buffer; `fused`: "
            "fbgemm's row-wise Adagrad, one state value per row).",
            "",
            "| code | build | update | rank | peak MiB | steady MiB | peak / steady | shard s |",
            "|---|---|---|---|---|---|---|---|",
        ]
    )
    for config in args.configs.split(","):
        build, update = config.split(":")
        res = run_distributed(_job, 2, args.rows, args.dim, build, update == "fused", timeout_s=1200)
        for rank, r in enumerate(res):
            lines.append(
                f"| {args.label} | {build} | {update} | {rank} | {r['peak']:,.0f} | {r['steady']:,.0f} "
                f"| {r['peak'] / r['steady']:.2f} | {r['shard_s']:.1f} |"
            )
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "a" if args.append else "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
