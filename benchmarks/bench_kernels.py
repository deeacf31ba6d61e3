"""Training-step cost of the embedding lookup kernels on one process (CPU).

Workload (defaults; shrink with flags): an ``EmbeddingBagCollection`` of 26 tables x 100,000 rows x 64 dims
(fp32, SUM pooling), one feature per table, batch 2,048, bags of 10..30 ids (mean 20). Ids are Zipf-like:
ranks drawn from ``numpy.random.zipf(1.1)`` (minus 1, clipped to the table size), then scattered over the
table by one fixed random permutation per table. One batch is drawn up front and reused, so every method
sees exactly the same ids.

Each step is forward + backward of a fixed upstream gradient + the optimizer update:

  a  torch     ``EmbeddingBagCollection(kernel="torch")``, dense gradients, ``torch.optim.SGD``
  b  torch-sp  ``EmbeddingBagCollection(kernel="torch", sparse_grad=True)``, ``torch.optim.SGD``
  c  fbgemm    ``EmbeddingBagCollection(kernel="fbgemm")`` (one dense table-batched fbgemm call), dense
               gradients, ``torch.optim.SGD``
  d  TBE fused fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen`` with ``OptimType.EXACT_SGD``: the update
               happens inside backward (what a fused optimizer path runs); no ``optimizer.step()``
  e  ours fused lightning_rec's ``FusedPooledKernel`` (the same fbgemm kernel, what every fused table runs),
               EXACT_SGD: d plus our guards and id checks, its tables on 2 MiB pages where the system's
               transparent huge pages allow it (``memory.py``); e / d is what that costs or buys

All four start from the same weights, and their forward outputs are checked against each other before
timing. Methods run interleaved: every round runs each method (in a shuffled order) for ``--iters``
steps after ``--warmup`` untimed rounds. The table reports the median over rounds of ms/step, and ratios
are paired: each ratio is computed within one round, then the median over rounds is taken, so slow
phases of a shared machine hit both sides of a ratio alike. One thread by default (``--threads``).
``--busy N`` keeps N more processes running method d on their own copy of the workload meanwhile, as the
other ranks of a sharded job would (they share the memory system with the timed process).

Usage:
    python benchmarks/bench_kernels.py                                   # full size
    python benchmarks/bench_kernels.py --tables 4 --rows 5000 --batch 256 --rounds 2 --iters 1   # smoke
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from lightning_rec.memory import thp_mode

# fbgemm's dense CPU backward is correct but warns on every call that it has no autograd kernel.
warnings.filterwarnings("ignore", message=r".*an autograd kernel was not registered.*")

METHODS = {
    "a": "torch, dense grad + SGD",
    "b": "torch, sparse_grad=True + SGD",
    "c": "fbgemm (dense TBE op), dense grad + SGD",
    "d": "fbgemm TBE fused EXACT_SGD",
    "e": "lightning_rec FusedPooledKernel, EXACT_SGD",
}
RATIOS = [("b", "a"), ("c", "a"), ("d", "a"), ("d", "b"), ("c", "b"), ("d", "c"), ("e", "d")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64, help="embedding dim (fused TBE needs a multiple of 4)")
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--ids-per-bag", type=int, default=20, help="mean bag length; lengths are uniform in [L/2, 3L/2]")
    p.add_argument("--zipf", type=float, default=1.1, help="numpy.random.zipf exponent")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds")
    p.add_argument("--iters", type=int, default=3, help="steps per method per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds before timing")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: leave torch's default)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--methods", default="abcde", help="subset of a, b, c, d, e")
    p.add_argument("--busy", type=int, default=0, help="other processes running method d meanwhile")
    p.add_argument("--spin", action="store_true", help=argparse.SUPPRESS)  # one of --busy's processes
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "results" / "kernels.md", help="Markdown output"
    )
    args = p.parse_args(argv)
    bad = set(args.methods) - set(METHODS)
    if bad or not args.methods:
        p.error(f"--methods takes letters from {''.join(METHODS)}, got {args.methods!r}")
    if {"d", "e"} & set(args.methods) and args.dim % 4:
        p.error("the fused kernels (methods d, e) need --dim to be a multiple of 4")
    return args


def make_batch(args: argparse.Namespace) -> KeyedJaggedTensor:
    rng = np.random.default_rng(args.seed)
    L = args.ids_per_bag
    keys, values, lengths = [], [], []
    for t in range(args.tables):
        lens = rng.integers(max(L // 2, 0), L + L // 2 + 1, size=args.batch)
        n = int(lens.sum())
        ranks = np.minimum(rng.zipf(args.zipf, size=n) - 1, args.rows - 1)
        perm = rng.permutation(args.rows)
        keys.append(f"f{t}")
        values.append(perm[ranks])
        lengths.append(lens)
    return KeyedJaggedTensor.from_lengths_sync(
        keys, torch.from_numpy(np.concatenate(values)).long(), torch.from_numpy(np.concatenate(lengths)).long()
    )


class Step:
    """One method: ``step()`` runs forward + backward + update."""

    def __init__(self, name: str, run, forward) -> None:
        self.name, self.run, self.forward = name, run, forward


def build_methods(args: argparse.Namespace, kjt: KeyedJaggedTensor, grad_out: torch.Tensor) -> dict[str, Step]:
    configs = [
        EmbeddingBagConfig(num_embeddings=args.rows, embedding_dim=args.dim, name=f"t{t}", feature_names=[f"f{t}"])
        for t in range(args.tables)
    ]
    torch.manual_seed(args.seed)
    reference_state = None
    methods: dict[str, Step] = {}

    def ebc_step(kernel: str, sparse_grad: bool) -> Step:
        nonlocal reference_state
        ebc = EmbeddingBagCollection(configs, kernel=kernel, sparse_grad=sparse_grad)
        if reference_state is None:
            reference_state = {k: v.clone() for k, v in ebc.state_dict().items()}
        else:
            ebc.load_state_dict(reference_state)
        opt = torch.optim.SGD(ebc.parameters(), lr=args.lr)

        def run() -> None:
            opt.zero_grad(set_to_none=True)
            ebc(kjt).values().backward(grad_out)
            opt.step()

        def forward() -> torch.Tensor:
            with torch.no_grad():
                return ebc(kjt).values()

        return Step(kernel + (" sparse" if sparse_grad else ""), run, forward)

    for m, (kernel, sparse) in {"a": ("torch", False), "b": ("torch", True), "c": ("fbgemm", False)}.items():
        if m in args.methods or (m == "a" and reference_state is None):
            step = ebc_step(kernel, sparse)
            if m in args.methods:
                methods[m] = step

    if "d" in args.methods:
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            EmbeddingLocation,
            OptimType,
            PoolingMode,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(args.rows, args.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * args.tables,
            optimizer=OptimType.EXACT_SGD,
            learning_rate=args.lr,
            pooling_mode=PoolingMode.SUM,
        )
        with torch.no_grad():
            for t, w in enumerate(tbe.split_embedding_weights()):
                w.copy_(reference_state[f"embedding_bags.t{t}.weight"])  # type: ignore[index]
        # KJT layout is key-major, which is exactly the TBE's feature-major indices / offsets.
        indices, offsets = kjt.values(), kjt.offsets()

        def run_tbe() -> None:
            tbe(indices, offsets).backward(grad_out)  # the table is updated inside backward

        def forward_tbe() -> torch.Tensor:
            with torch.no_grad():
                return tbe(indices, offsets)

        methods["d"] = Step("tbe fused", run_tbe, forward_tbe)
    if "e" in args.methods:
        from lightning_rec.kernels import FusedPooledKernel

        weights = [reference_state[f"embedding_bags.t{t}.weight"] for t in range(args.tables)]  # type: ignore[index]
        fused = FusedPooledKernel(
            [(f"t{t}", args.rows, args.dim, torch.float32) for t in range(args.tables)],
            list(range(args.tables)),
            {"kind": "sgd", "lr": args.lr},
            weights=weights,
        )
        values, offsets = kjt.values(), kjt.offsets()

        def run_ours() -> None:
            fused(values, offsets).backward(grad_out)
            fused.finish_step()

        def forward_ours() -> torch.Tensor:
            with torch.no_grad():
                return fused(values, offsets)

        methods["e"] = Step("ours fused", run_ours, forward_ours)
    return methods


def check_outputs(methods: dict[str, Step]) -> float:
    outs = {m: s.forward() for m, s in methods.items()}
    first = next(iter(outs.values()))
    worst = 0.0
    for m, o in outs.items():
        err = float((o - first).abs().max()) if o.numel() else 0.0
        if not torch.allclose(o, first, rtol=1e-4, atol=1e-5):
            raise AssertionError(f"method {m} forward differs from the others (max abs err {err:.3g})")
        worst = max(worst, err)
    return worst


def time_rounds(args: argparse.Namespace, methods: dict[str, Step]) -> dict[str, list[float]]:
    order = list(methods)
    shuffle = random.Random(args.seed)
    times: dict[str, list[float]] = {m: [] for m in order}
    for r in range(args.warmup + args.rounds):
        shuffle.shuffle(order)
        for m in order:
            t0 = time.perf_counter()
            for _ in range(args.iters):
                methods[m].run()
            ms = (time.perf_counter() - t0) * 1e3 / args.iters
            if r >= args.warmup:
                times[m].append(ms)
        if r >= args.warmup:
            line = "  ".join(f"{m}={times[m][-1]:.1f}" for m in sorted(times))
            print(f"round {r - args.warmup + 1}/{args.rounds}: {line} ms/step", file=sys.stderr, flush=True)
    return times


def report(
    args: argparse.Namespace,
    kjt: KeyedJaggedTensor,
    times: dict[str, list[float]],
    max_err: float,
    load: tuple[float, float],
) -> str:
    from importlib import metadata

    import fbgemm_gpu  # noqa: F401

    try:
        fb = metadata.version("fbgemm-gpu-cpu")
    except metadata.PackageNotFoundError:
        fb = metadata.version("fbgemm-gpu")
    n_ids = kjt.values().numel()
    threads = torch.get_num_threads()
    lines = [
        "# Embedding kernel benchmark (forward + backward + SGD update)",
        "",
        f"- workload: {args.tables} tables x {args.rows:,} rows x {args.dim} dims, fp32, SUM; batch {args.batch:,}; "
        f"bags of {max(args.ids_per_bag // 2, 0)}..{args.ids_per_bag + args.ids_per_bag // 2} ids "
        f"({n_ids:,} ids/step, {n_ids / max(args.tables * args.batch, 1):.1f} per bag); ids zipf({args.zipf}) ranks "
        "scattered by a fixed permutation",
        f"- {args.rounds} timed rounds x {args.iters} steps per method (after {args.warmup} warm-up round), methods "
        f"interleaved in shuffled order; torch threads: {threads}",
        f"- torch {torch.__version__}, fbgemm-gpu {fb}, Python {platform.python_version()}, "
        f"{platform.processor() or platform.machine()}",
        f"- forward outputs of all methods agree before timing (max abs diff {max_err:.2g})",
        f"- 1-minute load average of the machine: {load[0]:.2f} before timing, {load[1]:.2f} after "
        f"({os.cpu_count()} CPUs); other processes compete with the timed one when it exceeds ~{threads}"
        + (f" ({args.busy} of them on purpose: --busy {args.busy})" if args.busy else ""),
        f"- transparent huge pages: {thp_mode()}",
        "",
        "| method | median ms/step | min | max |",
        "|---|---:|---:|---:|",
    ]
    for m in sorted(times):
        t = times[m]
        lines.append(f"| {m}: {METHODS[m]} | {statistics.median(t):.1f} | {min(t):.1f} | {max(t):.1f} |")
    pairs = [(x, y) for x, y in RATIOS if x in times and y in times]
    if pairs:
        lines += ["", "| ratio (median of per-round ratios) | value | min | max |", "|---|---:|---:|---:|"]
        for x, y in pairs:
            r = [tx / ty for tx, ty in zip(times[x], times[y])]
            lines.append(f"| {x} / {y} | {statistics.median(r):.3f} | {min(r):.3f} | {max(r):.3f} |")
    return "\n".join(lines) + "\n"


def spin(args: argparse.Namespace, methods: dict[str, Step]) -> None:
    """Run method d until killed: one of ``--busy``'s processes."""
    while True:
        methods["d"].run()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    kjt = make_batch(args)
    grad_out = torch.randn(args.batch, args.tables * args.dim, generator=torch.Generator().manual_seed(args.seed))
    if args.spin:
        args.methods = "d"
        spin(args, build_methods(args, kjt, grad_out))
        return
    methods = build_methods(args, kjt, grad_out)
    max_err = check_outputs(methods)
    print(f"setup {time.perf_counter() - t0:.1f}s; outputs agree (max abs diff {max_err:.2g})", file=sys.stderr)
    companions = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                *(argv if argv is not None else sys.argv[1:]),
                "--spin",
                "--seed",
                str(args.seed + 1 + i),
            ]
        )
        for i in range(args.busy)
    ]
    try:
        if companions:
            time.sleep(5 + 2 * args.tables * args.rows * args.dim / 1e8)  # their setup, roughly
        load_before = os.getloadavg()[0]
        times = time_rounds(args, methods)
    finally:
        for c in companions:
            c.kill()
            c.wait()
    md = report(args, kjt, times, max_err, (load_before, os.getloadavg()[0]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(md)
    print(md)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
