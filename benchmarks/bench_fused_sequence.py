"""Training-step cost of the fused kernel without pooling (sequence lookups: one row per id) on CPU.

Workload: 8 tables x 100,000 rows x 64 dims (fp32), one feature per table, 40,960 ids per feature (uniform, or
Zipf-like: ``numpy.random.zipf(1.1)`` ranks scattered by a fixed permutation). Each step is forward + backward of
a fixed ``[ids, 64]`` gradient + the update:

  none    fbgemm's split TBE with ``PoolingMode.NONE`` (what ``FusedSequenceKernel`` runs for sgd / adagrad)
  sum1    the same TBE with SUM pooling and one id per bag: the same rows and the same update (the fbgemm path
          for the no-bag rows when every feature has the same number of ids)
  torch   ``F.embedding(sparse=True)`` per table + ``torch.optim.SGD`` / ``Adagrad`` (the full one for
          rowwise_adagrad too: torch has no row-wise Adagrad)
  ours    ``FusedSequenceKernel`` (none plus id checks and guards; for adam: the torch stand-in)

Median ms/step over interleaved rounds, one thread (``--threads``).

Usage:
    python benchmarks/bench_fused_sequence.py [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from lightning_rec.kernels import FusedPooledKernel, FusedSequenceKernel
from lightning_rec.optim import FusedOptimizer

warnings.filterwarnings("ignore")
T, R, D, N = 8, 100_000, 64, 40_960


def _ids(dist: str, rng: np.random.Generator) -> torch.Tensor:
    if dist == "uniform":
        return torch.from_numpy(rng.integers(0, R, T * N)).long()
    return torch.cat(
        [torch.from_numpy(rng.permutation(R)[np.clip(rng.zipf(1.1, N) - 1, 0, R - 1)]).long() for _ in range(T)]
    )


def _methods(kind: str, values: torch.Tensor, grad: torch.Tensor) -> dict[str, Callable[[], None]]:
    tables = [(f"t{t}", R, D, torch.float32) for t in range(T)]
    spec = {"kind": kind, "lr": 0.01}
    out: dict[str, Callable[[], None]] = {}
    ours = FusedSequenceKernel(tables, list(range(T)), spec)
    opt = FusedOptimizer(ours)
    per_feature = torch.arange(T + 1) * N

    def step_ours() -> None:
        ours(values, per_feature).backward(grad)
        opt.step()

    out["ours"] = step_ours
    if kind == "adam":
        return out
    none = FusedPooledKernel(tables, list(range(T)), spec, pooling="none")._tbe
    out["none"] = lambda: none(values, per_feature).backward(grad)
    sum1 = FusedPooledKernel(tables, list(range(T)), spec)._tbe
    one_per_bag, bag_grad = torch.arange(T * N + 1), grad.view(T, N, D).transpose(0, 1).reshape(N, T * D)
    out["sum1"] = lambda: sum1(values, one_per_bag).backward(bag_grad)
    ws = [torch.zeros(R, D, requires_grad=True) for _ in range(T)]
    topt = torch.optim.SGD(ws, lr=0.01) if kind == "sgd" else torch.optim.Adagrad(ws, lr=0.01, eps=1e-8)
    pieces = values.split(N)

    def step_torch() -> None:
        torch.cat([F.embedding(i, w, sparse=True) for i, w in zip(pieces, ws)]).backward(grad)
        topt.step()
        topt.zero_grad()

    out["torch"] = step_torch
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"| ids | kind | {T} tables x {R} x {D}, {T * N} ids | ms / step (median) |")
    print("|---|---|---|---|")
    for dist in ("uniform", "zipf"):
        values = _ids(dist, rng)
        grad = torch.randn(T * N, D) * 1e-3
        for kind in ("sgd", "adagrad", "rowwise_adagrad", "adam"):
            methods = _methods(kind, values, grad)
            for m in methods.values():
                m()
            times: dict[str, list[float]] = {m: [] for m in methods}
            for r in range(args.rounds):
                order = list(methods)
                random.Random(r).shuffle(order)
                for m in order:
                    t0 = time.perf_counter()
                    methods[m]()
                    times[m].append((time.perf_counter() - t0) * 1e3)
            for m, ts in times.items():
                print(f"| {dist} | {kind} | {m} | {statistics.median(ts):.1f} |", flush=True)


if __name__ == "__main__":
    main()
