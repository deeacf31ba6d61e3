"""Fused Adam on CPU (the torch update of ``kernels/_torch_adam.py``) against unfused ``torch.optim.SparseAdam``.

One process, one thread. The fused kernel (``FusedPooledKernel`` + ``FusedOptimizer``, kind ``adam``: the update
inside backward, touched rows only) against one ``nn.EmbeddingBag(mode="sum", sparse=True)`` per table stepped by
``torch.optim.SparseAdam`` (sparse gradients, then the step), and, for scale, fbgemm's own CPU kernel with fused
row-wise Adagrad. A step is forward + backward of ``(pooled * c).sum()`` + the optimizer step. Modes alternate
within each round (a round: ``--steps`` timed steps per mode after 2 warm-up steps); the median step of each
mode per round, then the median over rounds. Every mode sees the same batches. Afterwards: the largest
difference of the tables, fused Adam vs SparseAdam, from the same start (they differ only in where ``eps`` sits).

    PYTHONPATH=$PWD python benchmarks/bench_fused_adam_cpu.py --rounds 3 --steps 100
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_rec.kernels import FusedPooledKernel
from lightning_rec.optim import FusedOptimizer

LR = 0.01


def make_batches(cfg: dict, n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` feature-major batches (values, offsets): Zipf-like ids, ``cfg['ids']`` ids per bag on average."""
    rows, tables, b = cfg["rows"], cfg["tables"], cfg["batch"]
    cdf = torch.cumsum(torch.arange(1, rows + 1, dtype=torch.float64).pow(-cfg["zipf"]), 0)
    cdf /= cdf[-1].clone()
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(rows, generator=gen)
    lo, hi = max(1, cfg["ids"] // 2), cfg["ids"] + cfg["ids"] // 2
    out = []
    for _ in range(n):
        lengths = torch.randint(lo, hi + 1, (tables * b,), generator=gen)
        k = torch.searchsorted(cdf, torch.rand(int(lengths.sum()), generator=gen, dtype=torch.float64))
        values = perm[k.clamp_(max=rows - 1)]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        out.append((values, offsets))
    return out


def initial_weights(cfg: dict) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    bound = (1.0 / cfg["rows"]) ** 0.5
    return [torch.rand(cfg["rows"], cfg["dim"], generator=gen) * 2 * bound - bound for _ in range(cfg["tables"])]


class Fused:
    def __init__(self, cfg: dict, kind: str, w0: list[torch.Tensor]) -> None:
        tables = [(f"t{i}", cfg["rows"], cfg["dim"], torch.float32) for i in range(cfg["tables"])]
        spec = {"kind": kind, "lr": LR, "eps": cfg["eps"]}
        self.kernel = FusedPooledKernel(tables, range(cfg["tables"]), spec, weights=w0)
        self.opt = FusedOptimizer(self.kernel)

    def step(self, values: torch.Tensor, offsets: torch.Tensor, c: torch.Tensor) -> None:
        (self.kernel(values, offsets) * c).sum().backward()
        self.opt.step()

    def tables(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.kernel.tables()]


class SparseAdam:
    def __init__(self, cfg: dict, w0: list[torch.Tensor]) -> None:
        self.bags = torch.nn.ModuleList(
            torch.nn.EmbeddingBag.from_pretrained(w.clone(), freeze=False, mode="sum", sparse=True) for w in w0
        )
        self.opt = torch.optim.SparseAdam(list(self.bags.parameters()), lr=LR, eps=cfg["eps"])
        self.batch = cfg["batch"]

    def step(self, values: torch.Tensor, offsets: torch.Tensor, c: torch.Tensor) -> None:
        b, outs = self.batch, []
        bounds = offsets[::b].tolist()
        for t, bag in enumerate(self.bags):
            lo = bounds[t]
            outs.append(bag(values[lo : bounds[t + 1]], offsets[t * b : (t + 1) * b] - lo))
        (torch.cat(outs, 1) * c).sum().backward()
        self.opt.step()
        self.opt.zero_grad()

    def tables(self) -> list[torch.Tensor]:
        return [bag.weight.detach() for bag in self.bags]


def machine() -> str:
    model = "unknown"
    with contextlib.suppress(OSError, StopIteration):
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    return (
        f"CPU: {model}, {torch.get_num_threads()} thread; {platform.system()} {platform.release()}; "
        f"Python {platform.python_version()}, torch {torch.__version__}"
    )


def load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tables", type=int, default=26)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--ids", type=int, default=1, help="ids per bag on average (1: one id per feature)")
    ap.add_argument("--zipf", type=float, default=1.05)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100, help="timed steps per mode per round")
    ap.add_argument("--no-adagrad", action="store_true", help="skip fbgemm's fused row-wise Adagrad")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = {k: getattr(args, k) for k in ("tables", "rows", "dim", "batch", "ids", "zipf", "eps")}
    w0 = initial_weights(cfg)
    modes: dict[str, Fused | SparseAdam] = {
        "fused adam (torch update in backward)": Fused(cfg, "adam", w0),
        "torch.optim.SparseAdam, nn.EmbeddingBag(sparse=True)": SparseAdam(cfg, w0),
    }
    if not args.no_adagrad:
        modes["fused rowwise_adagrad (fbgemm CPU kernel)"] = Fused(cfg, "rowwise_adagrad", w0)
    del w0
    batches = make_batches(cfg, args.steps + 2, seed=1)
    gen = torch.Generator().manual_seed(2)
    coef = [torch.randn(cfg["batch"], cfg["tables"] * cfg["dim"], generator=gen) for _ in batches]
    ids = sum(v.numel() for v, _ in batches) / len(batches)
    before = load()
    medians: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for name, mode in modes.items():
            run: Callable[[int], None] = lambda i, mode=mode: mode.step(*batches[i], coef[i])  # noqa: E731
            run(0)
            run(1)
            times = []
            for i in range(2, len(batches)):
                t0 = time.perf_counter()
                run(i)
                times.append(time.perf_counter() - t0)
            medians[name].append(statistics.median(times) * 1e3)
    base = statistics.median(medians["torch.optim.SparseAdam, nn.EmbeddingBag(sparse=True)"])
    print(f"Machine: {machine()}")
    print(
        f"Job: {cfg['tables']} tables of {cfg['rows']:,} x {cfg['dim']} fp32, batch {cfg['batch']}, "
        f"{ids:,.0f} ids per step (Zipf {cfg['zipf']}, ~{cfg['ids']} per bag), Adam(lr={LR}, eps={cfg['eps']}); "
        f"{args.rounds} rounds x {args.steps} timed steps per mode (+2 warm-up), modes alternating."
    )
    print(f"Load average before: {before}; after: {load()}.")
    print()
    print("| mode | step ms (median of round medians) | round medians | vs SparseAdam |")
    print("|---|---|---|---|")
    for name, ms in medians.items():
        m = statistics.median(ms)
        rounds = ", ".join(f"{x:.2f}" for x in ms)
        print(f"| {name} | {m:.2f} | {rounds} | {m / base:.2f}x |")
    fused, sparse = (
        modes["fused adam (torch update in backward)"],
        modes["torch.optim.SparseAdam, nn.EmbeddingBag(sparse=True)"],
    )
    diffs = [(a - b).abs() for a, b in zip(fused.tables(), sparse.tables())]
    worst = max(float(d.max()) for d in diffs)
    over = sum(int((d > 1e-5).sum()) for d in diffs)
    total = sum(d.numel() for d in diffs)
    steps = args.rounds * (args.steps + 2)
    print()
    print(
        f"Fused adam vs SparseAdam after the same {steps} steps: largest difference {worst:.1e}; "
        f"{over:,} of {total:,} values differ by more than 1e-5"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
