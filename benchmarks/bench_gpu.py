"""GPU benchmarks (needs CUDA; exits with a message otherwise). Writes ``benchmarks/results/gpu.md``.

(a) Embedding training step: forward + backward + update of 26 tables x 1,000,000 x 128 fp32, batch 16,384,
    20 ids per bag (uniform ids, one feature per table), as a fraction of the device-to-device copy
    bandwidth measured in the same run. Useful bytes per step: every looked-up row is read in forward and
    read + written by the update (3 x ids x dim x 4), the pooled output is written in forward and its
    gradient read in backward (2 x batch x tables x dim x 4). Methods:

      loop      26 ``nn.EmbeddingBag(sparse=True)`` + ``torch.optim.SGD`` (plain PyTorch)
      torch     ``EmbeddingBagCollection(kernel="torch", sparse_grad=True)`` + ``torch.optim.SGD``
      fbgemm    ``EmbeddingBagCollection(kernel="fbgemm")`` (dense gradient) + ``torch.optim.SGD``
      fused     ``FusedPooledKernel`` with fused ``sgd`` (the update runs inside backward)

    ``fbgemm`` / ``fused`` run only where the installed fbgemm build has CUDA kernels; otherwise the table
    says why (the one-sentence error or warning the library gives).

(b) DLRM samples/s on one GPU: ``lightning_rec.models.DLRM`` trained by ``Trainer(accelerator="gpu",
    devices=1, strategy="rec_sharded")`` vs a plain-PyTorch DLRM of the same sizes (the same MLP and
    interaction modules, 26 ``nn.EmbeddingBag(sparse=True)``, Adam + Adagrad), same batches, same run.

(c) The sharded lookup (forward + backward + SGD) at world size 2 on one GPU (gloo, CUDA tensors) vs world
    size 1, per sharding type; a type that fails on CUDA is reported with its error.

    python benchmarks/bench_gpu.py                       # everything, full size
    python benchmarks/bench_gpu.py --parts a --rows 100000 --steps 5   # quick
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from lightning_rec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    kernels,
)
from lightning_rec.fused_kinds import FusedOptimizerSpec

warnings.filterwarnings("ignore", message=r".*an autograd kernel was not registered.*")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["a", "b", "c"], choices=["a", "b", "c"])
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=16_384)
    p.add_argument("--ids", type=int, default=20, help="ids per bag")
    p.add_argument("--steps", type=int, default=20, help="timed steps per method")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dlrm-rows", type=int, default=100_000, help="(b) rows per table")
    p.add_argument("--dlrm-dim", type=int, default=64, help="(b) embedding dim")
    p.add_argument("--dlrm-batch", type=int, default=8192, help="(b) batch size")
    p.add_argument("--shard-rows", type=int, default=200_000, help="(c) rows per table")
    p.add_argument("--device", default="cuda", help="cpu only to smoke-test this script (the figures mean nothing)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "gpu.md")
    return p.parse_args(argv)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _sync_time(fn, steps: int, warmup: int) -> float:
    """Median seconds per call of ``fn`` (CUDA-synchronised)."""
    for _ in range(warmup):
        fn()
    _sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: str, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = _sync_time(lambda: dst.copy_(src), steps=20, warmup=3)
    return 2 * nbytes / t


# -- (a) -----------------------------------------------------------------------------------------------------


def _batch(args, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Feature-major ids ``[tables * batch * ids]`` and offsets ``[tables * batch + 1]``."""
    g = torch.Generator(device="cpu").manual_seed(0)
    values = torch.randint(0, args.rows, (args.tables * args.batch * args.ids,), generator=g)
    offsets = torch.arange(0, values.numel() + 1, args.ids)
    return values.to(device), offsets.to(device)


def _configs(args, rows: int, dim: int) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(num_embeddings=rows, embedding_dim=dim, name=f"t{i}", feature_names=[f"f{i}"])
        for i in range(args.tables)
    ]


def _method(name: str, args, values, offsets):
    """A ``step()`` for method ``name`` (built on the GPU) and what it holds, or raise why it cannot run."""
    dev = torch.device(args.device)
    b, t, d = args.batch, args.tables, args.dim
    grad = torch.randn(b, t * d, device=dev)
    if name == "loop":
        bags = [nn.EmbeddingBag(args.rows, d, mode="sum", sparse=True).to(dev) for _ in range(t)]
        opt = torch.optim.SGD([p for m in bags for p in m.parameters()], lr=0.01)
        per = b * args.ids
        offs = torch.arange(0, per, args.ids, device=dev)

        def step():
            out = torch.cat([m(values[i * per : (i + 1) * per], offs) for i, m in enumerate(bags)], dim=1)
            out.backward(grad)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step, bags
    if name in ("torch", "fbgemm"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a fallback to torch is reported, not timed
            ebc = EmbeddingBagCollection(
                _configs(args, args.rows, d), device=dev, kernel=name, sparse_grad=name == "torch"
            )
            if name == "fbgemm":
                kernels.resolve_kernel("fbgemm", list(ebc.parameters()), False)
        opt = torch.optim.SGD(ebc.parameters(), lr=0.01)
        kjt = KeyedJaggedTensor([f"f{i}" for i in range(t)], values, offsets=offsets)

        def step():
            ebc(kjt).values().backward(grad)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step, ebc
    if name == "fused":
        k = kernels.FusedPooledKernel(
            [(f"t{i}", args.rows, d, torch.float32) for i in range(t)],
            list(range(t)),
            FusedOptimizerSpec("sgd", lr=0.01),
            device=dev,
        )

        def step():
            k(values, offsets).backward(grad)
            k.finish_step()

        return step, k
    raise ValueError(name)


def part_a(args, bw: float) -> list[str]:
    values, offsets = _batch(args, args.device)
    useful = 3 * values.numel() * args.dim * 4 + 2 * args.batch * args.tables * args.dim * 4
    lines = [
        f"## (a) embedding training step: {args.tables} tables x {args.rows:,} x {args.dim} fp32, batch "
        f"{args.batch:,}, {args.ids} ids per bag",
        "",
        f"Copy bandwidth (read + write): {bw / 1e9:,.0f} GB/s. Useful bytes per step: {useful / 1e9:.2f} GB.",
        "",
        "| method | ms / step | useful GB/s | of copy bandwidth |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name in ("loop", "torch", "fbgemm", "fused"):
        try:
            step, held = _method(name, args, values, offsets)
            t = _sync_time(step, args.steps, args.warmup)
            lines.append(f"| {name} | {t * 1e3:.2f} | {useful / t / 1e9:,.0f} | {useful / t / bw:.0%} |")
            del held, step
        except Exception as e:  # the table reports why a method cannot run here
            lines.append(f"| {name} | not run: {str(e).splitlines()[0][:200]} | | |")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(lines[-1], flush=True)
    return lines


# -- (b) -----------------------------------------------------------------------------------------------------


def _dlrm_batches(args, n: int):
    from lightning_rec.data.batch import Batch

    g = torch.Generator().manual_seed(1)
    t, b = args.tables, args.dlrm_batch
    out = []
    for _ in range(n):
        lengths = torch.randint(1, 2 * args.ids, (t * b,), generator=g)
        values = torch.randint(0, args.dlrm_rows, (int(lengths.sum()),), generator=g)
        kjt = KeyedJaggedTensor([f"f{i}" for i in range(t)], values, lengths=lengths)
        out.append(Batch(torch.randn(b, 13, generator=g), kjt, torch.randint(0, 2, (b,), generator=g).float()))
    return out


class _PlainDLRM(nn.Module):
    """DLRM in plain PyTorch: the library's MLP / interaction modules, one ``nn.EmbeddingBag`` per table."""

    def __init__(self, tables: int, rows: int, dim: int) -> None:
        from lightning_rec.models.dlrm import DenseArch, InteractionArch, OverArch

        super().__init__()
        self.dense_arch = DenseArch(13, [64, dim])
        self.bags = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum", sparse=True) for _ in range(tables))
        self.inter_arch = InteractionArch(tables)
        self.over_arch = OverArch(dim + tables * (tables + 1) // 2, [64, 32, 1])

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        b = dense.shape[0]
        offsets = kjt.offsets()
        values = kjt.values()
        bounds = offsets[::b].tolist()  # where each feature's ids start
        sparse = torch.stack(
            [
                m(values[bounds[i] : bounds[i + 1]], offsets[i * b : (i + 1) * b] - bounds[i])
                for i, m in enumerate(self.bags)
            ],
            dim=1,
        )
        return self.over_arch(self.inter_arch(self.dense_arch(dense), sparse)).squeeze(1)


def part_b(args) -> list[str]:
    import lightning as L

    from lightning_rec.models import DLRM

    steps, warm = args.steps, args.warmup
    batches = _dlrm_batches(args, steps + warm)
    b = args.dlrm_batch
    # plain PyTorch
    torch.manual_seed(0)
    plain = _PlainDLRM(args.tables, args.dlrm_rows, args.dlrm_dim).to(args.device)
    dense_p = [p for n, p in plain.named_parameters() if not n.startswith("bags")]
    opts = [torch.optim.Adam(dense_p, lr=1e-3), torch.optim.Adagrad(plain.bags.parameters(), lr=0.05)]
    _sync()
    for i, batch in enumerate(batches):
        if i == warm:
            _sync()
            t0 = time.perf_counter()
        batch = batch.to(args.device, non_blocking=True)
        loss = F.binary_cross_entropy_with_logits(plain(batch.dense, batch.sparse), batch.labels)
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    _sync()
    plain_sps = steps * b / (time.perf_counter() - t0)
    del plain, opts
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, idx):
            if idx == warm:
                _sync()
                self.t0 = time.perf_counter()

        def on_train_end(self, trainer, module):
            _sync()
            self.t1 = time.perf_counter()

    model = DLRM(
        feature_names=[f"f{i}" for i in range(args.tables)],
        num_embeddings_per_feature=[args.dlrm_rows] * args.tables,
        embedding_dim=args.dlrm_dim,
    )
    timer = Timer()
    accelerator = "gpu" if args.device == "cuda" else "cpu"
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        strategy="rec_sharded",
        max_steps=steps + warm,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    rec_sps = steps * b / (timer.t1 - timer.t0)
    return [
        f"## (b) DLRM on one GPU: {args.tables} tables x {args.dlrm_rows:,} x {args.dlrm_dim}, batch {b:,}",
        "",
        "| model | samples/s |",
        "| --- | ---: |",
        f"| plain PyTorch DLRM | {plain_sps:,.0f} |",
        f"| lightning_rec DLRM (Trainer, rec_sharded) | {rec_sps:,.0f} |",
        f"| ratio lightning_rec / plain | {rec_sps / plain_sps:.2f}x |",
    ]


# -- (c) -----------------------------------------------------------------------------------------------------

_TYPES = ("data_parallel", "table_wise", "row_wise", "column_wise")


def _sharded_worker(rank: int, world: int, args, kind: str) -> float:
    import torch.distributed as dist

    from lightning_rec import sharding

    dev = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    torch.manual_seed(0)
    t = args.tables
    ebc = EmbeddingBagCollection(_configs(args, args.shard_rows, args.dim), sparse_grad=True)
    per_type = {
        "data_parallel": sharding.data_parallel(),
        "table_wise": None,
        "row_wise": sharding.row_wise(),
        "column_wise": sharding.column_wise(ranks=list(range(world))) if args.dim % (4 * world) == 0 else None,
    }
    specs = {f"t{i}": per_type[kind] or sharding.table_wise(rank=i % world) for i in range(t)}
    plan = sharding.ShardingPlan({"": sharding.construct_module_sharding_plan(ebc, specs, world_size=world)})
    model = sharding.shard_modules(ebc, plan, device=dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    b = args.batch // world
    g = torch.Generator().manual_seed(rank)
    values = torch.randint(0, args.shard_rows, (t * b * args.ids,), generator=g)
    kjt = KeyedJaggedTensor([f"f{i}" for i in range(t)], values, offsets=torch.arange(0, values.numel() + 1, args.ids))
    kjt = kjt.to(dev)

    def step():
        model(kjt).values().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    sec = _sync_time(step, args.steps, args.warmup)
    dist.barrier()
    return sec


def part_c(args) -> list[str]:
    from lightning_rec.testing import run_distributed

    lines = [
        f"## (c) sharded lookup on one GPU: {args.tables} tables x {args.shard_rows:,} x {args.dim}, global batch "
        f"{args.batch:,} (gloo, CUDA tensors)",
        "",
        "| type | world 1 ms/step | world 2 ms/step | samples/s ratio 2 / 1 |",
        "| --- | ---: | ---: | ---: |",
    ]
    for kind in _TYPES:
        try:
            t1 = max(run_distributed(_sharded_worker, 1, args, kind, timeout_s=600))
            t2 = max(run_distributed(_sharded_worker, 2, args, kind, timeout_s=600))
            lines.append(f"| {kind} | {t1 * 1e3:.1f} | {t2 * 1e3:.1f} | {t1 / t2:.2f}x |")
        except Exception as e:  # report the failing type and go on
            last = [ln for ln in str(e).splitlines() if ln.strip()][-1:]
            lines.append(f"| {kind} | failed: {(last[0] if last else repr(e))[:200]} | | |")
        print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(
            "bench_gpu.py needs a CUDA device, and torch.cuda.is_available() is False here: nothing measured. "
            "Run it on a GPU machine (make gpu-check)."
        )
    bw = copy_bandwidth(args.device)
    out = [
        "# GPU benchmarks (benchmarks/bench_gpu.py)",
        "",
        f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU (smoke run)'}, torch {torch.__version__}, "
        f"python {platform.python_version()}; "
        f"median of {args.steps} steps after {args.warmup} warm-up steps.",
        "",
    ]
    parts = {"a": lambda: part_a(args, bw), "b": lambda: part_b(args), "c": lambda: part_c(args)}
    for p in args.parts:
        try:
            out += parts[p]() + [""]
        except Exception:  # one failing part must not lose the others' results
            out += [f"## ({p}) failed", "", "```", traceback.format_exc().strip()[-2000:], "```", ""]
        print("\n".join(out), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
