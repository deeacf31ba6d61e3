"""lightning_rec against TorchRec on the same embedding jobs, side by side in one run (gloo, CPU).

TorchRec is the release built for the torch this script runs on (torch 2.14: TorchRec 1.9.2 with fbgemm-gpu 1.9.0;
torch 2.13: TorchRec 1.8.0 with fbgemm-gpu 1.8.0). It lives in a side environment, never in the project's: on
first use this script creates a venv (``--side-env``, or ``$LIGHTNING_REC_TORCHREC_ENV``, default
``benchmarks/.side_env/torchrec-<version>``, git-ignored) with the same torch release, its ``fbgemm-gpu-cpu``,
``tensordict pyre-extensions iopath tqdm`` and ``torchrec --no-deps`` (TorchRec's own requirements would pull a
different torch). ``--build-only`` just builds it.

The job, identical for both libraries:
  * jobs: ``big`` = ``--big-tables`` tables of ``--rows`` x ``--dim`` (default 8 x 100,000 x 64); ``dlrm`` =
    26 tables of mixed sizes (Criteo-like spread, capped at 200,000 rows, times ``--dlrm-scale``) x ``--dim``;
    one feature per table, SUM pooling, fp32;
  * ``--batch`` samples per rank per step (default 1,024), bags of ids/2 .. 3 ids/2 ids (mean ``--ids``, default
    20), ids Zipf-like (p(k) ~ 1/(k+1)^a, a=``--zipf``) scattered by one fixed permutation per table; each rank
    draws its own ``--distinct`` batches from the same seeds in both libraries (plain torch generators, the
    same torch build on both sides, so the ids are bitwise the same: the driver checks a checksum);
  * model = the embedding collection inside a one-attribute ``nn.Module`` (plan path ``"ebc"``); loss = binary
    cross-entropy with logits of (mean of the pooled vectors) against fixed random 0/1 labels; SGD, lr ``--lr``
    (0.5: the logit is a mean over many values, so its gradients are small). The losses of the repeated
    batches must drop (else the driver warns: nothing was trained); for dense, the driver also records how many
    elements the torch optimizer steps on each side (``opt_numel`` in the JSON, equal on both sides);
  * fused = the update happens inside backward (fbgemm EXACT_SGD): TorchRec's ``EmbeddingBagCollectionSharder
    (fused_params=...)`` with compute kernel ``fused``, stepped through ``model.fused_optimizer``; lightning_rec's
    ``shard_modules(..., embedding_optimizer={"kind": "sgd"})`` stepped through ``fused_optimizer(model)``;
  * dense = dense table gradients + ``torch.optim.SGD``: TorchRec's compute kernel ``dense`` (fbgemm's
    DenseTableBatchedEmbeddingBagsCodegen), lightning_rec's ``EmbeddingBagCollection(sparse_grad=False)``;
  * plans, explicit and the same on both sides (every table one type): ``table_wise`` (table i on rank
    i mod world; at world 1 this is the "one process" row), ``row_wise`` (even blocks), ``column_wise`` (two
    column shards on ranks 0 and 1), ``data_parallel``, ``table_row_wise`` (hosts of 2 ranks, tables round-robin
    over hosts) and, at world >= 4, ``grid_shard`` (2 column shards on hosts 0 and 1; TorchRec cuts columns in
    blocks of 128, so it needs dim >= 256). TorchRec's plans come from ``construct_module_sharding_plan`` with
    the helpers of ``torchrec.distributed.sharding_plan`` and an explicit compute kernel, and go to
    ``DistributedModelParallel``; lightning_rec's go to ``shard_modules``. TorchRec's fused data_parallel does
    not build in 1.8 or 1.9 (an assertion in its fused optimizer): that cell reads "fails", and the closing note
    compares our fused data_parallel with TorchRec's best working variant. Gradient convention: each library's
    default (TorchRec divides sharded gradients by the group size, lightning_rec sums); it changes the
    update's scale, not its cost.
  * timing: one thread per process; ``--warmup`` steps, then ``--steps`` steps between two barriers;
    samples/s = world x batch x steps / slowest rank's time. Also the median step (the slowest rank's step,
    median over steps), which resists interference. "scaling" = samples/s / (world x the best one-process
    samples/s of that job and variant); it can pass 100% for dense, whose per-rank optimizer work shrinks
    with the world size.
  * ``--bare`` (one-process fused rows): each library's step alternated with the bare fbgemm kernel's step
    (``SplitTableBatchedEmbeddingBagsCodegen``, EXACT_SGD, same tables, ids and loss) in the same process:
    the library's own per-step overhead, less sensitive to machine load than two separate runs.
  * ``--profile PREFIX``: after each configuration's timed steps, the same steps again under cProfile and
    torch.profiler, written per library and rank (``PREFIX-...-<library>-r<rank>.txt``).
  * ``--split`` (on by default): lightning_rec's fused rows at 2+ processes also record, over a few real steps,
    every fused-kernel call (its inputs) and every collective (its sizes), then time the kernel calls alone and
    the collectives alone on every rank at once: the step splits into kernels, collectives and the rest.

One group of persistent processes per (library, world size) receives the configurations one at a time over
stdin; the two libraries alternate per configuration within each variant (A then B, then B then A) so that a
slow phase of the machine does not land on one side only. A configuration that fails or hangs on one side
(``--timeout``) is reported as such and its process group is replaced. Noise gauge: rank 0 reads /proc/stat
at both ends of the timed section; "others" = CPU time the whole machine was busy minus the CPU time of our
own worker processes (``time.process_time`` deltas of every rank), in cores on average over the timed wall
time. Figures taken while others used a sizeable fraction of a core are not comparable to quiet-machine ones.

Writes ``benchmarks/results/vs_torchrec.md`` (and a JSON of every raw result next to it). Not part of the tests.

Usage:
    python benchmarks/bench_vs_torchrec.py --build-only                  # create the side environment
    python benchmarks/bench_vs_torchrec.py --small                       # smoke test, a minute or two
    python benchmarks/bench_vs_torchrec.py --bare                        # the full comparison
    python benchmarks/bench_vs_torchrec.py --world-sizes 1 --variants fused --profile /tmp/prof   # profiles
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib
import io
import json
import os
import platform
import pstats
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
# torch minor -> (TorchRec release, fbgemm-gpu release) built for it
TORCHREC_FOR_TORCH = {"2.13": ("1.8.0", "1.8.0"), "2.14": ("1.9.2", "1.9.0")}
_TORCH_RELEASE = torch.__version__.split("+")[0]
TORCHREC, SIDE_FBGEMM = TORCHREC_FOR_TORCH.get(".".join(_TORCH_RELEASE.split(".")[:2]), ("1.9.2", "1.9.0"))
DEFAULT_ENV = ROOT / "benchmarks" / ".side_env" / f"torchrec-{TORCHREC}"
SIDE_PACKAGES = [
    f"torch=={_TORCH_RELEASE}",
    f"fbgemm-gpu-cpu=={SIDE_FBGEMM}",
    "tensordict",
    "pyre-extensions",
    "iopath",
    "tqdm",
]
TORCHREC_MINOR = ".".join(TORCHREC.split(".")[:2])
LIBS = ("torchrec", "lightning_rec")
PLANS = ("table_wise", "row_wise", "column_wise", "data_parallel", "table_row_wise", "grid_shard")
LOCAL_SIZE = 2  # ranks per "host" for table_row_wise and grid_shard
VARIANTS = ("fused", "dense")
# per-table fused optimizers: even tables SGD, odd tables row-wise Adagrad (two kernels per rank); opt-in
EXTRA_VARIANTS = ("mixed",)
# Criteo-like spread of table sizes (26 sparse features), capped so that a full run fits in memory.
DLRM_ROWS = [
    200_000, 40_000, 200_000, 200_000, 300, 24, 12_000, 630, 3, 90_000, 5_700, 200_000, 3_200, 27, 15_000,
    200_000, 10, 5_600, 2_200, 4, 200_000, 18, 15, 200_000, 100, 140_000,
]  # fmt: skip
RESULT = "RESULT "


# -- side environment ---------------------------------------------------------------------------------------
def side_python(env: Path) -> Path:
    return env / "bin" / "python"


def build_side_env(env: Path) -> Path:
    """Create the TorchRec venv once (a marker file says it is complete); return its python."""
    py = side_python(env)
    marker = env / f".torchrec-{TORCHREC}-complete"
    if marker.exists():
        return py
    print(f"building the TorchRec side environment in {env} (once; a few minutes) ...", flush=True)
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE, "text": True}
    steps = [
        [sys.executable, "-m", "venv", str(env)],
        [str(py), "-m", "pip", "install", "-q", *SIDE_PACKAGES],
        # TorchRec's own requirements would replace torch / fbgemm: install it alone
        [str(py), "-m", "pip", "install", "-q", "--no-deps", f"torchrec=={TORCHREC}"],
        [str(py), "-c", "import torchrec.distributed.model_parallel, fbgemm_gpu"],
    ]
    for cmd in steps:
        r = subprocess.run(cmd, check=False, **quiet)
        if r.returncode != 0:
            raise SystemExit(f"building the side environment failed at: {' '.join(cmd)}\n{r.stderr[-3000:]}")
    marker.write_text("ok\n")
    return py


# -- the job (runs in both environments: plain torch only) ---------------------------------------------------
def job_tables(job: str, cfg: dict) -> list[tuple[str, int, int]]:
    """(table name, rows, dim) for one job; feature ``f<i>`` looks up table ``t<i>``."""
    if job == "big":
        return [(f"t{i}", cfg["rows"], cfg["dim"]) for i in range(cfg["big_tables"])]
    if job == "dlrm":
        return [(f"t{i}", max(4, int(r * cfg["dlrm_scale"])), cfg["dim"]) for i, r in enumerate(DLRM_ROWS)]
    if job == "seq":  # an EmbeddingCollection (sequence features, a row per id) of the big tables
        return [(f"t{i}", cfg["rows"], cfg["dim"]) for i in range(cfg["big_tables"])]
    raise ValueError(job)


def make_batches(tables: list[tuple[str, int, int]], cfg: dict, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """``cfg['distinct']`` batches (lengths [F*B], values, labels [B]), key-major; Zipf ids via fixed permutations."""
    b, n = cfg["batch"], len(tables)
    perm_gen = torch.Generator().manual_seed(1234)
    perms = [torch.randperm(rows, generator=perm_gen) for _, rows, _ in tables]
    cdfs: dict[int, torch.Tensor] = {}
    for _, rows, _ in tables:
        if rows not in cdfs:
            c = torch.cumsum(torch.arange(1, rows + 1, dtype=torch.float64).pow(-cfg["zipf"]), 0)
            cdfs[rows] = c / c[-1].clone()
    gen = torch.Generator().manual_seed(seed)
    lo, hi = max(1, cfg["ids"] // 2), cfg["ids"] + cfg["ids"] // 2
    out = []
    for _ in range(cfg["distinct"]):
        lengths = torch.randint(lo, hi + 1, (n * b,), generator=gen)
        values = []
        for t, cnt in enumerate(lengths.view(n, b).sum(1).tolist()):
            rows = tables[t][1]
            k = torch.searchsorted(cdfs[rows], torch.rand(cnt, generator=gen, dtype=torch.float64))
            values.append(perms[t][k.clamp_(max=rows - 1)])
        labels = torch.randint(0, 2, (b,), generator=gen).float()
        out.append((lengths, torch.cat(values), labels))
    return out


class Model(nn.Module):
    """The collection under one attribute, so that both libraries' plans address it as ``"ebc"``."""

    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt):
        return self.ebc(kjt)


def busy_seconds() -> float | None:
    """CPU-seconds the whole machine has been busy since boot (all processes), from /proc/stat."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal (guest is inside user)
    return (f[0] + f[1] + f[2] + f[5] + f[6] + (f[7] if len(f) > 7 else 0)) / os.sysconf("SC_CLK_TCK")


# -- the two libraries ----------------------------------------------------------------------------------------
def build_torchrec(tables, plan: str, variant: str, world: int, lr: float, sequence: bool = False):
    """TorchRec's DMP over the collection with an explicit plan; returns (model, kjt_factory, optimizer)."""
    # optional dependency: only the side environment has TorchRec
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner.constants import MIN_CW_DIM
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        data_parallel,
        grid_shard,
        row_wise,
        table_row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    if plan == "grid_shard" and min(d for _, _, d in tables) < 2 * MIN_CW_DIM:
        raise ValueError(
            f"TorchRec's grid_shard cuts columns in blocks of {MIN_CW_DIM}: 2 column shards need dim >= "
            f"{2 * MIN_CW_DIM}"
        )

    fused = variant in ("fused", "mixed")
    fused_params = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": lr} if variant == "fused" else None
    if sequence:
        from torchrec import EmbeddingCollection, EmbeddingConfig
        from torchrec.distributed.embedding import EmbeddingCollectionSharder

        configs = [
            EmbeddingConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=[f"f{n[1:]}"])
            for n, r, d in tables
        ]
        ebc = EmbeddingCollection(tables=configs, device=torch.device("meta"))
        sharder = EmbeddingCollectionSharder(fused_params=fused_params)
    else:
        configs = [
            EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=[f"f{n[1:]}"])
            for n, r, d in tables
        ]
        ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
        sharder = EmbeddingBagCollectionSharder(fused_params=fused_params)
    if variant == "mixed":  # TorchRec users' way: in-backward optimizers on subsets of the tables
        from torchrec.optim import RowWiseAdagrad
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

        weights = [ebc.embedding_bags[n].weight for n, _, _ in tables]
        apply_optimizer_in_backward(torch.optim.SGD, weights[0::2], {"lr": lr})
        apply_optimizer_in_backward(RowWiseAdagrad, weights[1::2], {"lr": lr, "eps": 1e-8})
    kernel = "fused" if fused else "dense"
    per_table = {}
    for i, (name, _, _) in enumerate(tables):
        if plan == "table_wise":
            per_table[name] = table_wise(rank=i % world, compute_kernel=kernel)
        elif plan == "row_wise":
            per_table[name] = row_wise(compute_kernel=kernel)
        elif plan == "column_wise":
            per_table[name] = column_wise(ranks=[0, 1], compute_kernel=kernel)
        elif plan in ("data_parallel", "table_row_wise", "grid_shard"):
            # these helpers take no compute kernel (data_parallel's is always "dense"): set it explicitly
            gen = {
                "data_parallel": data_parallel,
                "table_row_wise": lambda i=i: table_row_wise(host_index=i % (world // LOCAL_SIZE)),
                "grid_shard": lambda: grid_shard(host_indexes=[0, 1]),
            }[plan]()

            def with_kernel(*a, _gen=gen, **kw):
                ps = _gen(*a, **kw)
                ps.compute_kernel = kernel
                return ps

            per_table[name] = with_kernel
        else:
            raise ValueError(plan)
    module_plan = construct_module_sharding_plan(
        ebc,
        per_param_sharding=per_table,
        sharder=sharder,
        local_size=min(world, LOCAL_SIZE),
        world_size=world,
        device_type="cpu",
    )
    env = ShardingEnv.from_process_group(dist.GroupMember.WORLD)
    model = DistributedModelParallel(
        Model(ebc), env=env, device=torch.device("cpu"), plan=ShardingPlan({"ebc": module_plan}), sharders=[sharder]
    )
    if fused:
        opt = model.fused_optimizer
    else:
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    keys = [f"f{n[1:]}" for n, _, _ in tables]

    def kjt(lengths: torch.Tensor, values: torch.Tensor):
        return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)

    return model, kjt, opt


def build_lightning_rec(tables, plan: str, variant: str, world: int, lr: float, sequence: bool = False):
    """lightning_rec's shard_modules over the same collection and plan; returns (model, kjt_factory, optimizer)."""
    # imported here: this file also runs in the side environment, which has no lightning_rec
    from lightning_rec import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        KeyedJaggedTensor,
        ShardingPlan,
        column_wise,
        data_parallel,
        fused_optimizer,
        grid_shard,
        row_wise,
        shard_modules,
        table_row_wise,
        table_wise,
    )

    fused = variant in ("fused", "mixed")
    if sequence:
        from lightning_rec import EmbeddingCollection, EmbeddingConfig

        seq = [
            EmbeddingConfig(num_embeddings=r, embedding_dim=d, name=n, feature_names=[f"f{n[1:]}"])
            for n, r, d in tables
        ]
        ebc = EmbeddingCollection(seq, device="meta", sparse_grad=False)
    else:
        configs = [
            EmbeddingBagConfig(num_embeddings=r, embedding_dim=d, name=n, feature_names=[f"f{n[1:]}"])
            for n, r, d in tables
        ]
        ebc = EmbeddingBagCollection(configs, device="meta", sparse_grad=False)
    option: object = {"kind": "sgd", "lr": lr} if fused else None
    if variant == "mixed":
        from lightning_rec.fused_kinds import PerTableOptimizers

        adagrad = {"kind": "rowwise_adagrad", "lr": lr, "eps": 1e-8}
        option = PerTableOptimizers(default=option, tables={n: adagrad for n, _, _ in tables[1::2]})
    per_table = {}
    for i, (name, _, _) in enumerate(tables):
        per_table[name] = {
            "table_wise": lambda i=i: table_wise(i % world),
            "row_wise": row_wise,
            "column_wise": lambda: column_wise([0, 1]),
            "data_parallel": data_parallel,
            "table_row_wise": lambda i=i: table_row_wise(i % (world // LOCAL_SIZE)),
            "grid_shard": lambda: grid_shard([0, 1]),
        }[plan]()
    model = shard_modules(
        Model(ebc),
        ShardingPlan({"ebc": per_table}),
        local_size=LOCAL_SIZE if plan in ("table_row_wise", "grid_shard") else None,
        embedding_optimizer=option,
    )
    if fused:
        # None on a rank that holds no fused table (column_wise over ranks 0 and 1 at 4 ranks): nothing to step
        opt = fused_optimizer(model) or torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    else:
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    keys = [f"f{n[1:]}" for n, _, _ in tables]

    def kjt(lengths: torch.Tensor, values: torch.Tensor):
        return KeyedJaggedTensor(keys, values, lengths=lengths)

    return model, kjt, opt


# -- worker ---------------------------------------------------------------------------------------------------
def bare_kernel(tables, batches: list, cfg: dict) -> tuple[nn.Module, list[tuple[torch.Tensor, ...]]]:
    """fbgemm's split table-batched kernel over the job's tables (EXACT_SGD at the job's rate) and the batches as
    its (ids, offsets, labels) inputs."""
    # both environments have the fbgemm-gpu-cpu release of their (same) torch
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        OptimType,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(r, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for _, r, d in tables],
        optimizer=OptimType.EXACT_SGD,
        learning_rate=cfg["lr"],
    )
    tbe.init_embedding_weights_uniform(-0.01, 0.01)  # zeros otherwise
    return tbe, [(v, torch.cat([lg.new_zeros(1), lg.cumsum(0)]), y) for lg, v, y in batches]


def kernel_only(rank: int, world: int, cmd: dict) -> dict:
    """The bare fbgemm kernel (EXACT_SGD, every table of the job) on this rank's own batches, timed like a
    library's step with no communication but the barriers: what the cores do with no sharding overhead."""
    cfg = cmd["cfg"]
    tables = job_tables(cmd["job"], cfg)
    tbe, inputs = bare_kernel(tables, make_batches(tables, cfg, seed=1000 + rank), cfg)

    def step(i: int) -> None:
        values, offsets, labels = inputs[i % len(inputs)]
        F.binary_cross_entropy_with_logits(tbe(values, offsets).mean(1), labels).backward()

    timing, _ = timed_steps(step, cfg)
    return {
        **timing,
        "setup_s": 0.0,
        "checksum": 0,
        "last_loss": None,
        "losses": [],
        "trained": None,
        "opt_numel": None,
        "bare": None,
    }


def timed_steps(step, cfg: dict) -> tuple[dict, list]:
    """``cfg['warmup']`` untimed calls of ``step(i)``, then ``cfg['steps']`` timed ones between two barriers:
    the timing fields of a result (wall time, per-step times, own CPU time, machine busy time) and the timed
    calls' return values."""
    for i in range(cfg["warmup"]):
        step(i)
    dist.barrier()
    busy0, cpu0, t0 = busy_seconds(), time.process_time(), time.perf_counter()
    step_times, results = [], []
    for i in range(cfg["steps"]):
        s0 = time.perf_counter()
        results.append(step(i))
        step_times.append(time.perf_counter() - s0)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    cpu, busy1 = time.process_time() - cpu0, busy_seconds()
    return {
        "elapsed": elapsed,
        "step_times": step_times,
        "own_cpu": cpu,
        "busy": None if busy0 is None or busy1 is None else busy1 - busy0,
    }, results


# name -> module, as TorchRec's golden example and the port (examples/from_torchrec.py) import them
GOLDEN_TORCHREC = {
    "EmbeddingBagCollection": "torchrec",
    "EmbeddingBagConfig": "torchrec",
    "DEFAULT_CAT_NAMES": "torchrec.datasets.criteo",
    "DEFAULT_INT_NAMES": "torchrec.datasets.criteo",
    "RandomRecDataset": "torchrec.datasets.random",
    "TrainPipelineSparseDist": "torchrec.distributed",
    "EmbeddingBagCollectionSharder": "torchrec.distributed.embeddingbag",
    "DistributedModelParallel": "torchrec.distributed.model_parallel",
    "DLRM": "torchrec.models.dlrm",
    "DLRMTrain": "torchrec.models.dlrm",
    "apply_optimizer_in_backward": "torchrec.optim.apply_optimizer_in_backward",
    "KeyedOptimizerWrapper": "torchrec.optim.keyed",
    "in_backward_optimizer_filter": "torchrec.optim.optimizers",
    "RowWiseAdagrad": "torchrec.optim.rowwise_adagrad",
}
GOLDEN_LIGHTNING_REC = {
    "EmbeddingBagCollection": "lightning_rec",
    "EmbeddingBagConfig": "lightning_rec",
    "DEFAULT_CAT_NAMES": "lightning_rec.data",
    "DEFAULT_INT_NAMES": "lightning_rec.data",
    "RandomRecDataset": "lightning_rec.data",
    **dict.fromkeys(
        (
            "TrainPipelineSparseDist",
            "EmbeddingBagCollectionSharder",
            "DistributedModelParallel",
            "apply_optimizer_in_backward",
            "KeyedOptimizerWrapper",
            "in_backward_optimizer_filter",
            "RowWiseAdagrad",
        ),
        "lightning_rec.distributed",
    ),
    "DLRM": "lightning_rec.models.dlrm",
    "DLRMTrain": "lightning_rec.models.dlrm",
}


def release_buffers(lib: str) -> None:
    """A worker serves many configurations: lightning_rec's gives back each one's shared-memory buffers, which
    would otherwise pile up, one set per configuration."""
    if lib == "lightning_rec":
        from lightning_rec import transport

        dist.barrier()
        transport.close_all()


def golden_names(lib: str) -> SimpleNamespace:
    """The names TorchRec's golden training example imports: from TorchRec, or from lightning_rec as
    ``examples/from_torchrec.py`` imports them (the port changes nothing else)."""
    where = GOLDEN_TORCHREC if lib == "torchrec" else GOLDEN_LIGHTNING_REC
    return SimpleNamespace(**{name: getattr(importlib.import_module(mod), name) for name, mod in where.items()})


def run_golden(lib: str, rank: int, world: int, cmd: dict) -> dict:
    """TorchRec's golden training example (DLRM, 26 tables of ``--rows`` x ``--dim``, one id per bag, row-wise
    Adagrad in backward, dense Adagrad, DMP's own plan, ``TrainPipelineSparseDist``), ``--batch`` samples per
    rank, timed like the other jobs: the same code on both sides, only the imports differ."""
    cfg, ns = cmd["cfg"], golden_names(lib)
    dim, rows, lr = cfg["dim"], cfg["rows"], 0.1
    torch.manual_seed(0)
    dist.barrier()
    t0 = time.perf_counter()
    tables = [
        ns.EmbeddingBagConfig(name=f"t_{f}", embedding_dim=dim, num_embeddings=rows, feature_names=[f])
        for f in ns.DEFAULT_CAT_NAMES
    ]
    dlrm = ns.DLRM(
        embedding_bag_collection=ns.EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=len(ns.DEFAULT_INT_NAMES),
        dense_arch_layer_sizes=[64, dim],
        over_arch_layer_sizes=[64, 1],
        dense_device=torch.device("cpu"),
    )
    train_model = ns.DLRMTrain(dlrm)
    ns.apply_optimizer_in_backward(ns.RowWiseAdagrad, train_model.model.sparse_arch.parameters(), {"lr": lr})
    model = ns.DistributedModelParallel(
        module=train_model, device=torch.device("cpu"), sharders=[ns.EmbeddingBagCollectionSharder()]
    )
    opt = ns.KeyedOptimizerWrapper(
        dict(ns.in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=lr),
    )
    pipeline = ns.TrainPipelineSparseDist(model, opt, torch.device("cpu"))
    setup_s = time.perf_counter() - t0
    batches = iter(
        ns.RandomRecDataset(
            keys=ns.DEFAULT_CAT_NAMES,
            batch_size=cfg["batch"],
            hash_size=rows,
            ids_per_feature=1,
            num_dense=len(ns.DEFAULT_INT_NAMES),
            manual_seed=1000 + rank,
        )
    )
    timing, losses = timed_steps(lambda i: pipeline.progress(batches)[0].detach(), cfg)
    release_buffers(lib)
    return {**timing, "setup_s": setup_s, "last_loss": float(losses[-1]) if losses else None, "trained": None}


def run_config(lib: str, rank: int, world: int, cmd: dict) -> dict:
    if cmd.get("kernel_only"):
        return kernel_only(rank, world, cmd)
    if cmd["job"] == "golden":
        return run_golden(lib, rank, world, cmd)
    cfg, job, plan, variant = cmd["cfg"], cmd["job"], cmd["plan"], cmd["variant"]
    tables = job_tables(job, cfg)
    batches = make_batches(tables, cfg, seed=1000 + rank)
    checksum = sum(int(v.sum()) + 7 * int(lg.sum()) + 11 * int(y.sum()) for lg, v, y in batches)
    torch.manual_seed(0)
    dist.barrier()
    t0 = time.perf_counter()
    build = build_torchrec if lib == "torchrec" else build_lightning_rec
    sequence = job == "seq"
    model, make_kjt, opt = build(tables, plan, variant, world, cfg["lr"], sequence)
    setup_s = time.perf_counter() - t0
    kjts = [(make_kjt(lg, v), y) for lg, v, y in batches]

    def step(batch) -> torch.Tensor:
        kjt, labels = batch
        if sequence:  # every id's row: a bounded loss on their means (the same on both libraries)
            rows = torch.cat([jt.values() for jt in model(kjt).values()])
            loss = F.binary_cross_entropy_with_logits(rows.mean(1), torch.ones(rows.shape[0]) * 0.5)
        else:
            out = model(kjt).values()
            # a click model's loss on the mean of the pooled vectors: bounded gradients, so no divergence at any lr
            loss = F.binary_cross_entropy_with_logits(out.mean(1), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    timing, losses = timed_steps(lambda i: step(kjts[i % len(kjts)]), cfg)
    if cmd.get("profile"):
        profile_steps(step, kjts, cfg, f"{cmd['profile']}-{lib}-r{rank}.txt")
    split = None
    if cmd.get("split") and lib == "lightning_rec" and world > 1 and variant == "fused":
        split = split_step(step, kjts, cfg, opt)
    bare = None
    if cmd.get("bare") and world == 1 and variant == "fused":
        bare = versus_bare_kernel(step, kjts, tables, batches, cfg)
    # the same batches come back every `distinct` steps: their losses, summed, must have dropped between their
    # first and last showing, or nothing was trained
    d = cfg["distinct"]
    first, last = losses[:d], losses[-d:] if len(losses) >= 2 * d else []
    trained = bool(sum(last) < sum(first)) if last else None
    opt_numel = sum(p.numel() for g in opt.param_groups for p in g["params"]) if variant == "dense" else None
    release_buffers(lib)
    return {
        **timing,
        "setup_s": setup_s,
        "checksum": checksum,
        "last_loss": float(losses[-1]) if losses else None,
        "losses": [float(x) for x in losses],
        "trained": trained,
        "opt_numel": opt_numel,  # elements the torch optimizer steps (dense variant): both sides should agree
        "bare": bare,
        "split": split,
    }


def versus_bare_kernel(step, kjts: list, tables, batches: list, cfg: dict) -> dict:
    """Median ms of the library's step and of the bare fbgemm kernel's step (same tables, ids, loss, EXACT_SGD),
    alternated in this one process so that both see the same machine: the library's own overhead."""
    tbe, inputs = bare_kernel(tables, batches, cfg)

    def bare_step(batch) -> None:
        values, offsets, labels = batch
        F.binary_cross_entropy_with_logits(tbe(values, offsets).mean(1), labels).backward()

    ours, theirs = [], []
    for i in range(cfg["warmup"]):
        bare_step(inputs[i % len(inputs)])
    for i in range(cfg["steps"]):
        t0 = time.perf_counter()
        step(kjts[i % len(kjts)])
        t1 = time.perf_counter()
        bare_step(inputs[i % len(inputs)])
        t2 = time.perf_counter()
        ours.append(t1 - t0)
        theirs.append(t2 - t1)
    return {"lib_ms": 1e3 * statistics.median(ours), "bare_ms": 1e3 * statistics.median(theirs)}


def split_step(step, kjts: list, cfg: dict, opt) -> dict:
    """Where lightning_rec's fused step goes: record, over ``cfg['distinct']`` steps, every call of the fused
    kernel (its inputs) and every collective (its sizes); then time the kernel calls alone (forward, backward
    with a random output gradient, the optimizer's end of step) and the collectives alone (same ops, sizes and
    order, fresh buffers, synchronous), each on every rank at once and timed like a step. What is left of the
    step is the library's own work (routing, copies, Python) plus whatever waits the two do not overlap.
    """
    from lightning_rec import transport
    from lightning_rec.kernels._fused_tbe import FusedPooledKernel

    kernel_calls: list[list] = []
    coll_calls: list[list] = []
    real = {
        name: getattr(transport, name)
        for name in ("all_to_all_single", "all_gather_single", "all_to_all_views", "all_to_all_pieces")
    }
    real_forward = FusedPooledKernel.forward

    def forward(self, *a, **kw):
        out = real_forward(self, *a, **kw)
        if torch.is_grad_enabled():
            kernel_calls[-1].append((self, a, kw, torch.randn(out.shape, dtype=out.dtype) / out.numel()))
        return out

    def fresh(ts):
        return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in ts]

    def a2a(output, input, output_split_sizes, input_split_sizes, group, async_op=False):
        coll_calls[-1].append(
            (
                "all_to_all_single",
                (
                    torch.empty_like(output),
                    torch.empty_like(input),
                    list(output_split_sizes),
                    list(input_split_sizes),
                    group,
                ),
            )
        )
        return real["all_to_all_single"](output, input, output_split_sizes, input_split_sizes, group, async_op=async_op)

    def gather(output, input, group):
        coll_calls[-1].append(("all_gather_single", (torch.empty_like(output), torch.empty_like(input), group)))
        return real["all_gather_single"](output, input, group)

    def views(sends, recvs, group):
        coll_calls[-1].append(("all_to_all_views", ([fresh(x) for x in sends], [fresh(x) for x in recvs], group)))
        return real["all_to_all_views"](sends, recvs, group)

    def pieces(sends, recv_sizes, consume, group, device, async_op=False):
        # replayed with one copy out of what arrived, as the input dist's route-major cat does
        coll_calls[-1].append(
            (
                "all_to_all_pieces",
                (
                    [fresh(x) for x in sends],
                    recv_sizes,
                    lambda got: torch.cat([t for x in got for t in x]),
                    group,
                    device,
                ),
            )
        )
        return real["all_to_all_pieces"](sends, recv_sizes, consume, group, device, async_op=async_op)

    patched = {
        "all_to_all_single": a2a,
        "all_gather_single": gather,
        "all_to_all_views": views,
        "all_to_all_pieces": pieces,
    }
    FusedPooledKernel.forward = forward
    for name, fn in patched.items():
        setattr(transport, name, fn)
    try:
        for i in range(cfg["distinct"]):
            kernel_calls.append([])
            coll_calls.append([])
            step(kjts[i])
    finally:
        FusedPooledKernel.forward = real_forward
        for name, fn in real.items():
            setattr(transport, name, fn)

    def kernels_alone(i: int) -> None:
        for k, a, kw, grad in kernel_calls[i % len(kernel_calls)]:
            k(*a, **kw).backward(grad)
        opt.step()

    def collectives_alone(i: int) -> None:
        for name, args in coll_calls[i % len(coll_calls)]:
            work = real[name](*args)
            if work is not None:
                work.wait()

    kernel_timing, _ = timed_steps(kernels_alone, cfg)
    comm_timing, _ = timed_steps(collectives_alone, cfg)
    return {
        "kernel_elapsed": kernel_timing["elapsed"],
        "comm_elapsed": comm_timing["elapsed"],
        "kernel_calls": len(kernel_calls[0]),
        "collectives": len(coll_calls[0]),
    }


def profile_steps(step, kjts: list, cfg: dict, path: str | None) -> None:
    """After the timed steps: the same steps again under cProfile, then under torch.profiler; text to ``path``.

    Every rank runs the steps (their collectives must match); ranks with ``path=None`` write nothing.
    """
    n = cfg["steps"]
    prof = cProfile.Profile()
    prof.enable()
    for i in range(n):
        step(kjts[i % len(kjts)])
    prof.disable()
    text = io.StringIO()
    text.write(f"# cProfile over {n} steps (per-step ms = cumtime / {n} x 1000)\n")
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(35)
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        for i in range(n):
            step(kjts[i % len(kjts)])
    text.write(f"\n# torch.profiler over {n} steps (self CPU time by op)\n")
    text.write(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    if path:
        Path(path).write_text(text.getvalue())


def transport_line() -> str:
    """How each library's ranks exchanged tensors in this run (the workers inherit this environment)."""
    if os.environ.get("LIGHTNING_REC_SHM", "1") == "0":
        ours = "gloo (LIGHTNING_REC_SHM=0)"
    else:
        ours = (
            "shared memory between the processes of this host for its all-to-alls, all-gathers and "
            "all-reduces (`lightning_rec/transport/__init__.py`, the default; LIGHTNING_REC_SHM=0 for gloo)"
        )
    return f"Collectives: TorchRec through gloo; lightning_rec through {ours}."


def malloc_line(torchrec_malloc: bool) -> str:
    """How each library's workers allocate host memory in this run."""
    if os.environ.get("LIGHTNING_REC_MALLOC", "1") == "0":
        ours = "glibc's defaults (LIGHTNING_REC_MALLOC=0)"
    else:
        ours = (
            "glibc keeping freed memory for reuse (mmap threshold 256 MiB, trim threshold 1 GiB: "
            "`lightning_rec/memory.py`, the default)"
        )
    theirs = (
        "the same thresholds, set through glibc's MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ (--torchrec-malloc)"
        if torchrec_malloc
        else "glibc's defaults"
    )
    return f"Host memory: lightning_rec's workers (and the bare kernel, which runs in them) with {ours}; TorchRec's with {theirs}."


def worker(lib: str, rank: int, world: int, port: int) -> None:
    """Run configurations read from stdin until EOF; one RESULT line of JSON each on stdout."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            res = {"ok": True, **run_config(lib, rank, world, cmd)}
        except Exception as e:  # reported to the driver, which restarts the group
            traceback.print_exc()
            where = traceback.extract_tb(e.__traceback__)[-1]
            msg = str(e).splitlines()[0] if str(e) else f"at {Path(where.filename).name}:{where.lineno} {where.line}"
            res = {"ok": False, "error": f"{type(e).__name__}: {msg}"[:300]}
        print(RESULT + json.dumps(res), flush=True)
        if not res["ok"]:
            break
    dist.destroy_process_group()


# -- driver ---------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Group:
    """``world`` persistent worker processes of one library."""

    def __init__(
        self,
        lib: str,
        world: int,
        python: str,
        log_dir: Path,
        nice: int,
        malloc_env: bool = False,
        baseline: Path | None = None,
    ) -> None:
        self.lib, self.world = lib, world
        label = lib
        if baseline is not None and lib == "torchrec":  # --baseline: the first column is lightning_rec from there
            lib, label = "lightning_rec", "baseline"
        port = free_port()
        # TorchRec reads the host size for table_row_wise / grid_shard from LOCAL_WORLD_SIZE
        env = dict(
            os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", LOCAL_WORLD_SIZE=str(min(world, LOCAL_SIZE))
        )
        if lib == "lightning_rec":
            root = baseline if label == "baseline" else ROOT
            env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
        else:
            env.pop("PYTHONPATH", None)
            if malloc_env:  # what memory.py sets in lightning_rec's workers, through glibc's tunables
                from lightning_rec import memory as _memory  # (the driver runs in the project's environment)

                env.update(MALLOC_MMAP_THRESHOLD_=str(_memory._MMAP), MALLOC_TRIM_THRESHOLD_=str(_memory._TRIM))
        self.procs, self.queues = [], []
        for r in range(world):
            log = open(log_dir / f"{label}-w{world}-r{r}.log", "a")  # noqa: SIM115 (kept open with the process)
            cmd = [
                python,
                str(
                    (baseline or ROOT) / "benchmarks" / Path(__file__).name
                    if label == "baseline"
                    else Path(__file__).resolve()
                ),
                "--worker",
                lib,
                "--rank",
                str(r),
                "--world",
                str(world),
                "--port",
                str(port),
            ]
            if nice:
                cmd = ["nice", "-n", str(nice), *cmd]
            p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
            q: queue.Queue = queue.Queue()
            threading.Thread(target=self._read, args=(p, q), daemon=True).start()
            self.procs.append(p)
            self.queues.append(q)

    @staticmethod
    def _read(p: subprocess.Popen, q: queue.Queue) -> None:
        for line in p.stdout:
            if line.startswith(RESULT):
                q.put(json.loads(line[len(RESULT) :]))
        q.put({"ok": False, "error": f"process exited (code {p.wait()})"})

    def run(self, cmd: dict, timeout_s: float) -> list[dict]:
        """Every rank's result; stops waiting as soon as one rank fails (the others may be stuck in a collective
        that will never complete: the caller then kills the group)."""
        line = json.dumps(cmd) + "\n"
        for p in self.procs:
            try:
                p.stdin.write(line)
                p.stdin.flush()
            except OSError:  # it died since the last configuration (killed for memory, say): a failed row
                return [
                    {"ok": False, "error": f"worker exited (code {p.poll()}) before this configuration"}
                    for _ in self.procs
                ]
        deadline = time.monotonic() + timeout_s
        out: list[dict | None] = [None] * len(self.procs)
        while any(r is None for r in out):
            for i, q in enumerate(self.queues):
                if out[i] is None:
                    with contextlib.suppress(queue.Empty):
                        out[i] = q.get(timeout=0.05)
            failed = [r for r in out if r is not None and not r.get("ok")]
            if failed or time.monotonic() > deadline:
                why = failed[0]["error"] if failed else f"timeout after {timeout_s:.0f} s"
                return [r if r is not None else {"ok": False, "error": why} for r in out]
        return out  # type: ignore[return-value]

    def close(self, kill: bool = False) -> None:
        for p in self.procs:
            if kill:
                p.kill()
            elif p.stdin:
                with contextlib.suppress(OSError):
                    p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def summarize(res: list[dict], cfg: dict, world: int) -> dict:
    bad = [r for r in res if not r.get("ok")]
    if bad:
        return {"error": bad[0]["error"]}
    elapsed = max(r["elapsed"] for r in res)
    steps = cfg["steps"]
    med = statistics.median(max(ts) for ts in zip(*(r["step_times"] for r in res)))
    busy = res[0]["busy"]
    others = None if busy is None else max(0.0, busy - sum(r["own_cpu"] for r in res)) / res[0]["elapsed"]
    return {
        "sps": world * cfg["batch"] * steps / elapsed,
        "med_sps": world * cfg["batch"] / med,
        "ms_step": 1e3 * elapsed / steps,
        "others": others,
        "setup_s": max(r["setup_s"] for r in res),
        "checksum": [r.get("checksum") for r in res],
        "last_loss": res[0]["last_loss"],
        "trained": [r["trained"] for r in res],
        "bare": res[0].get("bare"),
        "split": split_summary(res, steps),
        "opt_numel": [r.get("opt_numel") for r in res],
    }


def split_summary(res: list[dict], steps: int) -> dict | None:
    """ms per step of the kernels alone and the collectives alone (slowest rank), from :func:`split_step`."""
    if not all(r.get("split") for r in res):
        return None
    return {
        "kernel_ms": 1e3 * max(r["split"]["kernel_elapsed"] for r in res) / steps,
        "comm_ms": 1e3 * max(r["split"]["comm_elapsed"] for r in res) / steps,
        "collectives": res[0]["split"]["collectives"],
    }


def median_round(rounds: list[dict]) -> dict:
    """Of one library's rounds of a configuration, the one with the median samples/s (the lower middle of an
    even count); a failed round stands for all (failures repeat). Its ``sps_rounds`` lists every round's."""
    failed = [r for r in rounds if "error" in r]
    if failed:
        return failed[0]
    ranked = sorted(rounds, key=lambda r: r["sps"])
    return {**ranked[(len(ranked) - 1) // 2], "sps_rounds": [r["sps"] for r in rounds]}


def machine() -> str:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{os.cpu_count()} CPUs ({model}); {platform.system()} {platform.release()}; "
        f"Python {platform.python_version()}, torch {torch.__version__} on both sides, gloo, 1 thread per process"
    )


def fmt_cell(s: dict | None) -> str:
    if s is None:
        return "not run"
    if "error" in s:
        return f"fails: {s['error'][:90]}"
    noise = "?" if s["others"] is None else f"{s['others']:.2f}"
    rounds = s.get("sps_rounds", [])
    every = f"; rounds {'/'.join(f'{x / 1e3:.1f}' for x in rounds)}" if len(rounds) > 1 else ""
    return f"{s['sps'] / 1e3:.1f}k (med {s['med_sps'] / 1e3:.1f}k; others {noise}{every})"


def ok(s: dict | None) -> bool:
    return bool(s) and "error" not in s


def write_report(
    path: Path,
    rows: list[dict],
    cfg: dict,
    args: argparse.Namespace,
    total_s: float,
    limits: dict[tuple[str, int], dict] | None = None,
) -> None:
    from lightning_rec.memory import thp_mode  # (the side environment never writes the report)

    dlrm_rows = [r for _, r, _ in job_tables("dlrm", cfg)]
    # perfect scaling: world x the best single-process figure of that job and variant (either library)
    single: dict[tuple[str, str], float] = {}
    for row in rows:
        if row["world"] == 1:
            for lib in LIBS:
                if ok(row[lib]):
                    key = (row["job"], row["variant"])
                    single[key] = max(single.get(key, 0.0), row[lib]["sps"])
    lines = [
        f"# lightning_rec vs TorchRec {TORCHREC} (gloo, CPU, one run)",
        "",
        f"Machine: {machine()}. TorchRec {TORCHREC} + fbgemm-gpu-cpu {SIDE_FBGEMM} in a side venv.",
        "",
        transport_line(),
        "",
        malloc_line(args.torchrec_malloc),
        "",
        (
            f"Job: `big` = {cfg['big_tables']} tables x {cfg['rows']:,} rows x {cfg['dim']}; `dlrm` = 26 tables, "
            f"{min(dlrm_rows):,}..{max(dlrm_rows):,} rows x {cfg['dim']}; SUM, fp32, one feature per table; "
            f"{cfg['batch']:,} samples per rank, ~{cfg['ids']} Zipf ids per bag (a={cfg['zipf']}); "
            f"loss = BCE-with-logits(mean of pooled, random 0/1 labels); SGD lr {cfg['lr']}; {cfg['warmup']} warm-up + "
            f"{cfg['steps']} timed steps between barriers, {cfg['distinct']} distinct batches per rank. "
            "Same ids on both sides (checksums compared)."
            + (
                f" `golden` = TorchRec's golden training example end to end, the same code with either library's "
                f"imports: DLRM over 26 tables x {cfg['rows']:,} x {cfg['dim']}, one id per bag, "
                f"{cfg['batch']:,} samples per rank, each library's DMP default plan, row-wise Adagrad in backward "
                "+ dense Adagrad, TrainPipelineSparseDist; each side's own RandomRecDataset (no checksum)."
                if any(r["job"] == "golden" for r in rows)
                else ""
            )
        ),
        "",
        "Cells: global samples/s over the timed steps (med = from the median step of the slowest rank); "
        "others = cores other processes used on average meanwhile (0.00 = quiet; machine total busy from "
        "/proc/stat minus our workers' CPU time). ratio = lightning_rec / TorchRec samples/s. fused = "
        "update inside backward (fbgemm EXACT_SGD); dense = dense table gradients + torch.optim.SGD; mixed = "
        "fused per table, even tables SGD and odd tables row-wise Adagrad (eps 1e-8), as TorchRec users mark "
        "them with two apply_optimizer_in_backward calls (a kernel per optimizer on each rank); seq = an "
        "EmbeddingCollection of the big tables (a row per id, no pooling). "
        "`table_wise` at world 1 is the single-process row. first = which library ran first for that row "
        f"(in its first round; {args.rounds} round(s) per library and row, the order alternating between "
        "rounds; each cell is that library's median round, its samples/s in every round after 'rounds'). "
        "scaling = samples/s / (world x the best single-process samples/s of that job and variant), "
        "TorchRec / lightning_rec.",
        "",
        "of limit = samples/s / the bare kernel's samples/s at that world size, every process on its own batches "
        "with no communication (the table below), TorchRec / lightning_rec: the fraction of what the cores do "
        "with no sharding at all. The bare kernel is fbgemm's own module, on 4 KiB pages as TorchRec's tables "
        f"are; lightning_rec's fused tables are on 2 MiB pages (THP here: {thp_mode()}; "
        "`lightning_rec/memory.py`), so its fraction can pass 100%.",
        "",
        f"| job | world | plan | variant | first | TorchRec {TORCHREC_MINOR} | lightning_rec | ratio | scaling | of limit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for row in rows:
        tr, lr = row["torchrec"], row["lightning_rec"]
        ratio = f"{lr['sps'] / tr['sps']:.2f}x" if ok(tr) and ok(lr) else "-"
        if ratio != "-":
            ratios.append(f"{row['job']} w{row['world']} {row['plan']} {row['variant']} {ratio}")
        limit = row["world"] * single.get((row["job"], row["variant"]), 0.0)
        scaling = "-"
        if row["world"] > 1 and limit:
            scaling = " / ".join(f"{row[lib]['sps'] / limit:.0%}" if ok(row[lib]) else "-" for lib in LIBS)
        bound = (limits or {}).get((row["job"], row["world"]))
        of_limit = "-"
        if bound is not None and ok(bound):
            of_limit = " / ".join(f"{row[lib]['sps'] / bound['sps']:.0%}" if ok(row[lib]) else "-" for lib in LIBS)
        lines.append(
            f"| {row['job']} | {row['world']} | {row['plan']} | {row['variant']} | {row['first']} | "
            f"{fmt_cell(tr)} | {fmt_cell(lr)} | {ratio} | {scaling} | {of_limit} |"
        )
    # data_parallel: TorchRec's fused kernel does not build for it, so compare our fused with its best
    for row in rows:
        if row["plan"] == "data_parallel" and row["variant"] == "fused" and ok(row["lightning_rec"]):
            best = [
                r["torchrec"]["sps"]
                for r in rows
                if r["plan"] == "data_parallel"
                and r["job"] == row["job"]
                and r["world"] == row["world"]
                and ok(r["torchrec"])
            ]
            if best:
                ratios.append(
                    f"{row['job']} w{row['world']} data_parallel, our fused vs TorchRec's best working variant "
                    f"{row['lightning_rec']['sps'] / max(best):.2f}x"
                )
    bare_lines = []
    for row in rows:
        cells = [row[lib].get("bare") if ok(row[lib]) else None for lib in LIBS]
        if any(cells):
            txt = [
                f"{c['lib_ms']:.2f} ms vs bare {c['bare_ms']:.2f} ms (+{c['lib_ms'] - c['bare_ms']:.2f} ms)"
                if c
                else "-"
                for c in cells
            ]
            bare_lines.append(f"| {row['job']} | {row['variant']} | {txt[0]} | {txt[1]} |")
    if bare_lines:
        lines += [
            "",
            "One process, fused: median step of each library alternated with the bare fbgemm kernel "
            "(`SplitTableBatchedEmbeddingBagsCodegen`, EXACT_SGD, same tables, ids and loss) in the same process; "
            "the difference is the library's own per-step overhead.",
            "",
            f"| job | variant | TorchRec {TORCHREC_MINOR} | lightning_rec |",
            "|---|---|---|---|",
            *bare_lines,
        ]
    split_lines = []
    for row in rows:
        tr, lr = row["torchrec"], row["lightning_rec"]
        sp = lr.get("split") if ok(lr) else None
        if not sp:
            continue
        k, c = sp["kernel_ms"], sp["comm_ms"]
        floor_sps = row["world"] * cfg["batch"] / ((k + c) / 1e3)
        target = f"{1.5 * tr['sps'] / 1e3:.1f}k" if ok(tr) else "-"
        above = ("yes" if 1.5 * tr["sps"] > floor_sps else "no") if ok(tr) else "-"
        split_lines.append(
            f"| {row['job']} | {row['world']} | {row['plan']} | {lr['ms_step']:.1f} | {k:.1f} | {c:.1f} "
            f"({sp['collectives']}) | {lr['ms_step'] - k - c:.1f} | {floor_sps / 1e3:.1f}k | {target} | {above} |"
        )
    if split_lines:
        lines += [
            "",
            "Where lightning_rec's fused step goes: its fbgemm kernel calls alone (forward, backward, end of "
            "step, on the very inputs the shards received) and its collectives alone (the same ops, sizes and "
            "order, synchronous; their count per step in brackets), each recorded from real steps and replayed "
            "on every rank at once, timed like a step; rest = step - both (routing, copies, Python, and waits "
            "the two did not overlap). With both cores busy in the kernels, the collectives' CPU work "
            "(copies through shared memory or gloo's TCP) cannot hide behind them, so kernels + collectives is close to a floor for this "
            "data flow; the last column says whether 1.5x TorchRec's samples/s lies beyond it.",
            "",
            "| job | world | plan | step ms | kernels alone ms | collectives alone ms | rest ms | "
            "kernels + collectives as samples/s | 1.5 x TorchRec | beyond |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *split_lines,
        ]
    if limits:
        lines += [
            "",
            "Bare kernel, no communication: every process runs fbgemm's EXACT_SGD kernel over all the job's tables "
            "on its own batches (same ids and loss as above), timed the same way. At 2 processes the two cores share "
            "the memory system; 'x one' = samples/s over the one-process figure (2.00x would be perfect scaling).",
            "",
            "| job | world | samples/s | x one |",
            "|---|---|---|---|",
        ]
        for (job, world), cell in sorted(limits.items()):
            one = limits.get((job, 1))
            x = f"{cell['sps'] / one['sps']:.2f}x" if one and ok(one) and ok(cell) else "-"
            lines.append(f"| {job} | {world} | {fmt_cell(cell)} | {x} |")
    noise = [row[lib]["others"] for row in rows for lib in LIBS if ok(row[lib]) and row[lib]["others"] is not None]
    lines += [
        "",
        "Ratios (lightning_rec / TorchRec): " + ("; ".join(ratios) if ratios else "none") + ".",
        "",
        (
            f"Noise: other processes used {min(noise):.2f}..{max(noise):.2f} cores during the timed sections."
            if noise
            else "Noise: not measured (no /proc/stat)."
        ),
        f"Total run time {total_s / 60:.1f} min; load average before/after: {args.load0} / {load()}.",
        f"Command: `python benchmarks/bench_vs_torchrec.py {' '.join(sys.argv[1:])}`",
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def configs(args: argparse.Namespace) -> list[tuple[str, int, str, str]]:
    out = []
    for job in args.jobs:
        for world in args.world_sizes:
            if job == "golden":  # its own plan (DMP's planner) and optimizers
                out.append((job, world, "dmp_default", "golden"))
                continue
            for plan in args.plans:
                if world == 1 and plan != "table_wise":
                    continue  # one process: every plan is the same local table
                if plan in ("column_wise", "table_row_wise") and world < 2:
                    continue
                if plan == "grid_shard" and world < 2 * LOCAL_SIZE:
                    continue  # needs two hosts
                for variant in args.variants:
                    out.append((job, world, plan, variant))
    return out


def write_before_after(out: Path, rows: list[dict], cfg: dict, args, total: float) -> None:
    """``--baseline``: both versions of lightning_rec per configuration, and the run's noise to judge them by."""
    lines = [
        "# lightning_rec before / after (gloo, CPU, one run)",
        "",
        f"Machine: {machine()}. Baseline: `{args.baseline}`; after: this checkout. Same jobs, ids and plans as "
        "`bench_vs_torchrec.py`; each configuration runs both versions in alternating order, "
        f"{args.rounds} round(s) each, the median round kept. spread = (max - min) / median samples/s over one "
        "version's rounds: the run's noise on that row.",
        "",
        "| job | world | plan | variant | before samples/s | after samples/s | after / before | spread before | "
        "spread after |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def spread(cell: dict) -> str:
        r = cell.get("sps_rounds") or []
        return f"{(max(r) - min(r)) / sorted(r)[len(r) // 2]:.0%}" if len(r) > 1 else "-"

    for row in rows:
        a, b = row["torchrec"], row["lightning_rec"]
        ratio = f"{b['sps'] / a['sps']:.2f}" if ok(a) and ok(b) else "-"
        lines.append(
            f"| {row['job']} | {row['world']} | {row['plan']} | {row['variant']} | "
            f"{fmt_cell(a)} | {fmt_cell(b)} | {ratio} | {spread(a) if ok(a) else '-'} | "
            f"{spread(b) if ok(b) else '-'} |"
        )
    lines += [
        "",
        f"Total {total / 60:.1f} min. Command: `python benchmarks/bench_vs_torchrec.py {' '.join(sys.argv[1:])}`",
        "",
    ]
    out.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--side-env",
        default=os.environ.get("LIGHTNING_REC_TORCHREC_ENV", str(DEFAULT_ENV)),
        help="TorchRec venv (built on first use); default $LIGHTNING_REC_TORCHREC_ENV, else benchmarks/.side_env",
    )
    ap.add_argument("--build-only", action="store_true", help="only build the side environment")
    ap.add_argument(
        "--jobs",
        nargs="+",
        default=["big", "dlrm"],
        choices=["big", "dlrm", "golden", "seq"],
        help="golden: TorchRec's golden training example end to end (26 tables of --rows x --dim, --batch per rank)",
    )
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--plans", nargs="+", default=list(PLANS), choices=PLANS)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS + EXTRA_VARIANTS)
    ap.add_argument("--big-tables", type=int, default=8)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dlrm-scale", type=float, default=1.0, help="multiplies the dlrm job's table sizes")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1024, help="samples per rank per step")
    ap.add_argument("--ids", type=int, default=20, help="mean ids per bag")
    ap.add_argument("--zipf", type=float, default=1.05)
    ap.add_argument("--lr", type=float, default=0.5, help="SGD learning rate, both libraries")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--distinct", type=int, default=4, help="distinct batches per rank, cycled")
    ap.add_argument("--small", action="store_true", help="smoke test: tiny tables and batches, few steps")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every configuration this many times per library, alternating which goes first (A B, B A, "
        "...), and report each library's median round: less sensitive to the machine drifting between runs",
    )
    ap.add_argument(
        "--kernel-limit",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the bare fbgemm kernel on every rank's own batches at each world size, with no "
        "communication: what the cores reach with no sharding at all (the denominator of 'of limit')",
    )
    ap.add_argument("--nice", type=int, default=0, help="run the workers under nice -n N (shared machines)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one configuration may take")
    ap.add_argument(
        "--profile",
        metavar="PREFIX",
        help="after each configuration's timed steps, profile the same steps on every rank of both libraries "
        "(cProfile, then torch.profiler) and write PREFIX-<job>-w<world>-<plan>-<variant>-<library>-r<rank>.txt",
    )
    ap.add_argument(
        "--bare",
        action="store_true",
        help="one-process fused rows: also time the bare fbgemm kernel on the same job, alternating with the "
        "library's step in the same process (each library's overhead over the kernel, robust to machine load)",
    )
    ap.add_argument(
        "--split",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="lightning_rec's fused rows at world >= 2: also time its kernel calls alone and its collectives "
        "alone (recorded from real steps, replayed on every rank at once): where the step goes",
    )
    ap.add_argument(
        "--torchrec-malloc",
        action="store_true",
        help="run TorchRec's workers with the glibc malloc thresholds lightning_rec sets for itself "
        "(memory.py), through glibc's environment tunables: how much of the gap that setting is",
    )
    ap.add_argument(
        "--baseline",
        type=Path,
        help="a checkout of an earlier lightning_rec (e.g. a git worktree): it takes TorchRec's place, so the run "
        "compares the two versions side by side (A B, B A rounds); the report is a before / after table",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vs_torchrec.md"))
    ap.add_argument("--worker", choices=LIBS, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.rank, args.world, args.port)
        return 0

    side = Path(sys.executable) if args.baseline else build_side_env(Path(args.side_env).resolve())
    if args.build_only:
        print(f"side environment ready: {side}")
        return 0
    if args.small:
        args.big_tables, args.rows, args.dlrm_scale, args.batch = 4, 5_000, 0.02, 128
        args.warmup, args.steps, args.distinct = 1, 3, 2
    cfg = {
        k: getattr(args, k)
        for k in (
            "big_tables",
            "rows",
            "dlrm_scale",
            "dim",
            "batch",
            "ids",
            "zipf",
            "lr",
            "warmup",
            "steps",
            "distinct",
        )
    }
    args.load0 = load()
    pythons = {"torchrec": str(side), "lightning_rec": sys.executable}
    out = Path(args.out)
    log_dir = out.parent / "vs_torchrec_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    groups: dict[tuple[str, int], Group] = {}
    rows, raw = [], []
    limits: dict[tuple[str, int], dict] = {}
    t_start = time.perf_counter()
    try:
        seen: dict[str, int] = {}
        for job, world, plan, variant in configs(args):
            # alternate which library goes first, separately within each variant (rows of one variant are
            # compared with each other), starting differently per variant
            n = seen[variant] = (
                seen.get(variant, args.variants.index(variant) - 1 if variant in args.variants else 0) + 1
            )
            order = LIBS if n % 2 == 0 else LIBS[::-1]
            row = {"job": job, "world": world, "plan": plan, "variant": variant, "first": order[0]}
            cmd = {"cfg": cfg, "job": job, "plan": plan, "variant": variant}
            if args.bare:
                cmd["bare"] = True
            if args.split:
                cmd["split"] = True
            if args.profile:
                cmd["profile"] = f"{args.profile}-{job}-w{world}-{plan}-{variant}"
            rounds: dict[str, list[dict]] = {lib: [] for lib in LIBS}
            for rnd in range(args.rounds):
                for lib in order if rnd % 2 == 0 else order[::-1]:  # A B, B A, A B, ...
                    if rounds[lib] and "error" in rounds[lib][-1]:
                        continue  # a configuration that failed once fails again: no second timeout
                    key = (lib, world)
                    if key not in groups:
                        groups[key] = Group(
                            lib, world, pythons[lib], log_dir, args.nice, args.torchrec_malloc, args.baseline
                        )
                    res = groups[key].run(cmd, args.timeout)
                    if not all(r.get("ok") for r in res):  # a failed group may be stuck: a fresh one next time
                        groups.pop(key).close(kill=True)
                    rounds[lib].append(summarize(res, cfg, world))
                    raw.append(
                        {
                            "lib": lib,
                            "round": rnd,
                            **{k: v for k, v in row.items() if k in ("job", "world", "plan", "variant")},
                            "ranks": res,
                        }
                    )
            for lib in LIBS:
                row[lib] = median_round(rounds[lib])
            tr, lr = row["torchrec"], row["lightning_rec"]
            if (
                job != "golden"
                and "checksum" in tr
                and "checksum" in lr
                and tr["checksum"] != lr["checksum"]
                and not args.baseline
            ):
                raise SystemExit(f"the two libraries saw different ids for {row}: a bug in this benchmark")
            for lib in LIBS:
                if False in row[lib].get("trained", []):
                    print(f"WARNING: {lib} {job} w{world} {plan} {variant}: the loss of a repeated batch did not drop")
            print(
                f"{job} w{world} {plan} {variant}: TorchRec {fmt_cell(tr)} | lightning_rec {fmt_cell(lr)}", flush=True
            )
            rows.append(row)
        if args.kernel_limit:
            for job in [j for j in args.jobs if j != "golden"]:  # (the golden job is end to end: no bare kernel)
                for world in args.world_sizes:
                    key = ("lightning_rec", world)
                    if key not in groups:
                        groups[key] = Group("lightning_rec", world, pythons["lightning_rec"], log_dir, args.nice)
                    got = [
                        summarize(
                            groups[key].run({"cfg": cfg, "job": job, "kernel_only": True}, args.timeout), cfg, world
                        )
                        for _ in range(args.rounds)
                    ]
                    limits[(job, world)] = median_round(got)
                    print(f"{job} w{world} bare kernel, no communication: {fmt_cell(limits[(job, world)])}", flush=True)
    finally:
        for g in groups.values():
            g.close()
    total = time.perf_counter() - t_start
    if args.baseline:
        write_before_after(out, rows, cfg, args, total)
    else:
        write_report(out, rows, cfg, args, total, limits)
    out.with_suffix(".json").write_text(json.dumps({"cfg": cfg, "rows": rows, "raw": raw}, indent=1))
    print(f"wrote {out} ({total / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
