"""Gradient accumulation with a fused embedding optimizer (issue 33): bytes kept per micro-batch, and the step
time of k = 1, 2, 4 micro-batches per step against the same job with a torch optimizer and against k = 1.

2 gloo processes, row-wise tables. Fused Adagrad (``embedding_optimizer``; k = 1 with accumulation off is
today's in-backward update, k = 1 with it on shows the mode's own cost) against torch's Adagrad on sparse
gradients of plain sharded tables. All modes alternate within each round; a step is k x (forward + backward)
+ the optimizer step; slowest rank per round. Bytes per micro-batch: ``FusedOptimizer.pending_bytes()``
after each backward, per rank, against the README's formula.

    PYTHONPATH=$PWD python benchmarks/bench_accumulate.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_sharding import load, machine, make_batches

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_rec.sharding import ShardingPlan, fused_optimizer, row_wise, shard_modules
from lightning_rec.testing import run_distributed

MODES = [
    ("fused", 1, False),
    ("fused", 1, True),
    ("fused", 2, True),
    ("fused", 4, True),
    ("torch", 1, False),
    ("torch", 2, False),
    ("torch", 4, False),
]
LR, EPS = 0.01, 1e-8


def _label(mode: tuple[str, int, bool]) -> str:
    kind, k, acc = mode
    if kind == "torch":
        return f"torch Adagrad (sparse grads), k={k}"
    return f"fused Adagrad, k={k}" + (", accumulation on" if acc and k == 1 else "" if acc else ", in backward")


def _build(cfg: dict, mode: tuple[str, int, bool]):
    tables = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=cfg["rows"], embedding_dim=cfg["dim"], feature_names=[f"f{i}"])
        for i in range(cfg["tables"])
    ]
    torch.manual_seed(0)
    fused = mode[0] == "fused"
    ebc = EmbeddingBagCollection(tables, sparse_grad=not fused)
    plan = ShardingPlan({"": {t.name: row_wise() for t in tables}})
    if fused:
        ebc = shard_modules(ebc, plan, embedding_optimizer={"kind": "adagrad", "lr": LR, "eps": EPS})
        opt = fused_optimizer(ebc)
        opt.accumulate = mode[2]
    else:
        ebc = shard_modules(ebc, plan)
        opt = torch.optim.Adagrad(ebc.parameters(), lr=LR, eps=EPS, initial_accumulator_value=0.0)
    return ebc, opt


def _worker(rank: int, world: int, cfg: dict) -> dict:
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    torch.set_num_threads(1)
    batches = make_batches(cfg, seed=rank)
    built = [_build(cfg, m) for m in MODES]
    times: dict[int, list[float]] = {i: [] for i in range(len(MODES))}
    kept: list[int] = []
    cursor = [0] * len(MODES)

    def run(i: int, steps: int, measure: bool = False) -> float:
        ebc, opt = built[i]
        k = MODES[i][1]
        start = time.perf_counter()
        for _ in range(steps):
            opt.zero_grad()
            for _ in range(k):
                ebc(batches[cursor[i] % len(batches)]).values().sum().backward()
                cursor[i] += 1
                if measure and MODES[i][2]:
                    kept.append(opt.pending_bytes())
            opt.step()
        torch.distributed.barrier()
        return (time.perf_counter() - start) / steps

    for r in range(cfg["rounds"]):
        for i in range(len(MODES)):
            run(i, cfg["warmup"], measure=(r == 0 and MODES[i][1] == 4))
            times[i].append(run(i, cfg["steps"]))
    # the same micro-batches in the same order: fused and torch Adagrad must agree for each k
    agree = {}
    for k in (1, 2, 4):
        f = next(i for i, m in enumerate(MODES) if m[0] == "fused" and m[1] == k and (k > 1 or not m[2]))
        t = next(i for i, m in enumerate(MODES) if m[0] == "torch" and m[1] == k)
        assert cursor[f] == cursor[t]
        fs, ts = built[f][0].state_dict(), built[t][0].state_dict()
        agree[k] = max(float((fs[n] - ts[n].to_dense() if ts[n].is_sparse else fs[n] - ts[n]).abs().max()) for n in fs)
    ids = [sum(int(b.values().numel()) for b in batches[:1])]
    return {"times": times, "kept": kept, "agree": agree, "local_ids": ids[0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1024, help="samples per rank per micro-batch")
    ap.add_argument("--ids", type=int, default=20)
    ap.add_argument("--zipf", type=float, default=1.05)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--distinct", type=int, default=4)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "accumulate.md"))
    cfg = vars(ap.parse_args(argv))
    before = load()
    res = run_distributed(_worker, 2, cfg, timeout_s=1800)
    after = load()
    rounds = range(cfg["rounds"])
    step = {i: statistics.median(max(r["times"][i][j] for r in res) for j in rounds) for i in range(len(MODES))}
    base = {kind: step[MODES.index((kind, 1, False))] for kind in ("fused", "torch")}
    torch_of = {k: step[MODES.index(("torch", k, False))] for k in (1, 2, 4)}
    # bytes kept per micro-batch: growth of pending_bytes from one backward to the next, per rank
    per_mb = [[b - a for a, b in zip([0, *r["kept"][:3]], r["kept"][:4])] for r in res]
    b, n_t, d = cfg["batch"], cfg["tables"], cfg["dim"]
    # row-wise: every rank receives (about) half of both ranks' ids and every sample's bag of each table
    formula = [8 * (2 * r["local_ids"]) // 2 + 8 * (n_t * 2 * b + 1) + 4 * 2 * b * n_t * d for r in res]
    lines = [
        "# Gradient accumulation with a fused embedding optimizer (2 processes)",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} with `PYTHONPATH=$PWD python benchmarks/bench_accumulate.py` -- {machine()}.",
        f"Job: {n_t} row-wise tables of {cfg['rows']:,} x {d} fp32, Zipf({cfg['zipf']}) ids, ~{cfg['ids']} ids per "
        f"bag, {b} samples per rank per micro-batch, Adagrad(lr={LR}, eps={EPS}), sum loss. All modes alternate "
        f"in one run: {cfg['rounds']} rounds x {cfg['steps']} timed steps after {cfg['warmup']} warm-up step; a "
        "step is k x (forward + backward) + optimizer step; median over rounds of the slowest rank. 1 thread per "
        "process.",
        f"Load average (1/5/15 min) before: {before}; after: {after}.",
        "",
        "| mode | step ms | ms per micro-batch | step vs same k, torch | per micro-batch vs k=1 (same optimizer) |",
        "|---|---|---|---|---|",
    ]
    for i, (kind, k, _acc) in enumerate(MODES):
        vs_torch = f"{step[i] / torch_of[k]:.2f}x" if kind == "fused" else "-"
        lines.append(
            f"| {_label(MODES[i])} | {step[i] * 1e3:.1f} | {step[i] / k * 1e3:.1f} | {vs_torch} | "
            f"{step[i] / k / base[kind]:.2f}x |"
        )
    lines += [
        "",
        "Bytes kept per micro-batch (fused, k=4, `pending_bytes()` growth after each backward), by rank: "
        + "; ".join(f"rank {r}: " + ", ".join(f"{x:,}" for x in mb) for r, mb in enumerate(per_mb))
        + ". The README's formula (8 B per id + 8 B per bag + 4 B x batch x width) for the ids and bags a rank "
        f"receives, ids split evenly: about {', '.join(f'{x:,}' for x in formula)}.",
        "",
        "Largest difference of the final tables, fused vs torch Adagrad after the same micro-batches: "
        + ", ".join(f"k={k}: {v:.1e}" for k, v in res[0]["agree"].items())
        + ".",
        "",
    ]
    Path(cfg["out"]).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
