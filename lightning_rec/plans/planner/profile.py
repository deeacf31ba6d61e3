"""A short profiling run on a job's own batches, and the fit of the planner's speeds to it (:func:`profile_speeds`).

What is timed, on this machine and device, through the kernels training uses (each table sharded table-wise
onto this rank, in a process group of its own, with the job's fused optimizer or a torch SGD step):

* every table alone, forward + backward, then its optimizer step, on the batches' ids of its features: once on
  the whole batches and once on their first sample (what a call costs whatever its size, taken out);
* all the tables together in one collection per gradient mode, the same two ways: the per-table work is
  scaled so that it adds up to this step's (one call over many tables is not the sum of many calls), and its
  one-sample time is the step's fixed cost (``step_overhead``);
* with a process group of several ranks: all-to-alls of 8 bytes and of a step's pooled rows per peer among
  the ranks of each host (the bandwidth within a host; hosts are told apart by hostname), the same big one over
  every rank where they span several hosts (a rank's share of its host's link), the latency of the
  exchanges over every rank (across the hosts' links where the ranks span several): an all-to-all of 8 bytes,
  and the data-parallel sync's ring collectives on 8 bytes (two all-gathers and an all-reduce), and a training
  step of the whole job, its tables table-wise round-robin over the ranks: what the model leaves unexplained
  of that step, with the speeds above, is the pipeline's fixed cost per step (``step_overhead``, see
  ``fit.calibrate_step``). Every rank profiles at once, so the lookups share the host's memory system as in
  training, and the ranks' timings are averaged: every rank fits the same speeds.

Each measurement is the median over ``repeats`` passes of its sum over the batches, after one warm-up pass.
The fit (``fit.py``: :func:`fit_speeds`, :func:`calibrate_step`) is a pure function of the timings.
"""

from __future__ import annotations

import platform
import socket
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import islice
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from lightning_rec import transport
from lightning_rec.configs import BaseEmbeddingConfig, EmbeddingBagConfig
from lightning_rec.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from lightning_rec.fused_kinds import FusedOptimizerSpec, as_spec
from lightning_rec.pipeline.shard_modules import fused_optimizer, shard_modules
from lightning_rec.plans.plan import ShardingPlan, table_wise
from lightning_rec.plans.planner.cost import OPTIMIZER_STATE
from lightning_rec.plans.planner.fit import (
    TableTiming,
    Timings,
    calibrate_step,
    fit_speeds,
    reference_mixed_plan,
    reference_plan,
)
from lightning_rec.plans.planner.inputs import plan_entries
from lightning_rec.plans.planner.speeds import ProfiledSpeeds, machine_info
from lightning_rec.plans.planner.topology import Hardware
from lightning_rec.sparse import KeyedJaggedTensor


# -- the run ---------------------------------------------------------------------------------------------------
def take(kjt: KeyedJaggedTensor, keys: Sequence[str], samples: int | None, device: torch.device) -> KeyedJaggedTensor:
    """The bags of ``keys`` (in that order) of the first ``samples`` samples (None: all), on ``device``."""
    if kjt.variable_stride_per_key():
        raise ValueError("profiling needs batches with one batch size for every feature (no variable batch sizes)")
    index, stride = kjt.index_per_key(), kjt.stride()
    missing = [k for k in keys if k not in index]
    if missing:
        raise ValueError(f"the profiling batches have no feature {missing}; their features are {kjt.keys()}")
    lengths = kjt.lengths().view(len(kjt.keys()), stride)
    starts = kjt.offset_per_key()
    n = stride if samples is None else min(samples, stride)
    weights = kjt.weights_or_none()
    ls, vs, ws = [], [], []
    for k in keys:
        i = index[k]
        ln = lengths[i, :n]
        count = int(ln.sum())
        ls.append(ln)
        vs.append(kjt.values()[starts[i] : starts[i] + count])
        if weights is not None:
            ws.append(weights[starts[i] : starts[i] + count])
    return KeyedJaggedTensor(
        list(keys),
        torch.cat(vs).to(device),
        weights=torch.cat(ws).to(device) if weights is not None else None,
        lengths=torch.cat(ls).to(device),
        stride=n,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loss(out: Any) -> torch.Tensor:
    # a loss whose gradient is a dense tensor, as a model's is: a plain sum's gradient is one broadcast value,
    # which the output dist's backward and the kernel read far faster than a real gradient
    if hasattr(out, "values") and callable(out.values) and isinstance(out.values(), torch.Tensor):
        return out.values().square().mean()
    zero = torch.zeros((), device=next(iter(out.values())).device)
    return sum((jt.values().square().mean() for jt in out.values()), zero)


class _Job:
    """One collection of some of the tables, sharded onto this rank alone, and its optimizer."""

    def __init__(
        self,
        tables: list[BaseEmbeddingConfig],
        grads: str,
        spec: FusedOptimizerSpec | None,
        device: torch.device,
        group: dist.ProcessGroup,
        lr: float,
    ) -> None:
        cls: Any = EmbeddingBagCollection if isinstance(tables[0], EmbeddingBagConfig) else EmbeddingCollection
        model = cls(tables, device="meta", sparse_grad=grads == "sparse")
        plan = ShardingPlan({"": {t.name: table_wise(0) for t in tables}})
        self.model: nn.Module = shard_modules(model, plan, process_group=group, device=device, embedding_optimizer=spec)
        self.fused = spec is not None
        self.opt: Any = fused_optimizer(self.model) if self.fused else torch.optim.SGD(self.model.parameters(), lr=lr)
        self.device = device

    def step(self, kjt: KeyedJaggedTensor) -> tuple[float, float]:
        _sync(self.device)
        t0 = time.perf_counter()
        _loss(self.model(kjt)).backward()
        _sync(self.device)
        t1 = time.perf_counter()
        if self.opt is not None:
            self.opt.step()
            if not self.fused:
                self.opt.zero_grad(set_to_none=True)
        _sync(self.device)
        t2 = time.perf_counter()
        if self.fused:  # the update ran inside backward
            return t2 - t0, 0.0
        return t1 - t0, t2 - t1

    def time(self, batches: list[KeyedJaggedTensor], repeats: int) -> tuple[float, float]:
        """Seconds per batch (lookup, update): the median over ``repeats`` passes, after one warm-up pass."""
        for kjt in batches[:2]:
            self.step(kjt)
        passes = []
        for _ in range(repeats):
            sums = [0.0, 0.0]
            for kjt in batches:
                lookup, update = self.step(kjt)
                sums[0] += lookup
                sums[1] += update
            passes.append(sums)
        return (
            statistics.median(p[0] for p in passes) / len(batches),
            statistics.median(p[1] for p in passes) / len(batches),
        )


def _timed(device: torch.device, op: Callable[[], object], repeats: int) -> float:
    """Seconds of one ``op`` (a collective every rank of the world calls): the median over ``repeats`` timings."""
    for _ in range(3):
        op()
    times = []
    for _ in range(max(repeats, 3)):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(10):  # ten per timing: a barrier would dominate a microsecond collective
            op()
        _sync(device)
        times.append((time.perf_counter() - t0) / 10)
    return statistics.median(times)


def _a2a(device: torch.device, peer_bytes: int, repeats: int, group: dist.ProcessGroup | None = None) -> float:
    """Seconds of an all-to-all of ``peer_bytes`` (whole int64 words, at least one) per peer over ``group``
    (None: the world)."""
    world, n = dist.get_world_size(group), max(peer_bytes // 8, 1)
    x = torch.ones(world * n, dtype=torch.int64, device=device)
    y = torch.empty_like(x)
    return _timed(device, lambda: transport.all_to_all_single(y, x, [n] * world, [n] * world, group), repeats)


def _ring(device: torch.device, repeats: int) -> float:
    """Seconds of the data-parallel sync's collectives on 8 bytes over the world (``pipeline/collectives.py``:
    the touched rows' counts and ids all-gathered, their gradients all-reduced): what its ring hops wait."""
    x = torch.ones(1, dtype=torch.int64, device=device)
    out = torch.empty(dist.get_world_size(), dtype=torch.int64, device=device)
    grad = torch.zeros(2, dtype=torch.float32, device=device)  # zeros: its sums stay finite over every repeat

    def sync() -> None:
        transport.all_gather_single(out, x, None)
        transport.all_gather_single(out, x, None)
        transport.all_reduce_sum(grad, None)

    return _timed(device, sync, repeats)


def host_groups() -> tuple[list[list[int]], dist.ProcessGroup | None]:
    """The world's ranks by host (ranks whose machine has one hostname), and a process group of this rank's
    host (None when it is the whole world). Collective: every rank creates every host's group, in one order."""
    names: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    hosts = [[r for r, n in enumerate(names) if n == name] for name in dict.fromkeys(names)]
    if len(hosts) == 1:
        return hosts, None
    groups = [dist.new_group(ranks) for ranks in hosts]
    return hosts, cast(dist.ProcessGroup, next(g for g, ranks in zip(groups, hosts) if dist.get_rank() in ranks))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def measure(
    model_or_tables: nn.Module | Sequence[BaseEmbeddingConfig],
    batches: Iterable[Any],
    *,
    device: torch.device | str | None = None,
    embedding_optimizer: FusedOptimizerSpec | Mapping[str, Any] | None = None,
    gradients: str | None = None,
    max_batches: int = 16,
    repeats: int = 3,
    exchange: bool = True,
    lr: float = 0.01,
) -> Timings:
    """The timings :func:`fit_speeds` takes (see the module docstring); collective under a process group."""
    dev = torch.device(device if device is not None else "cpu")
    spec = as_spec(embedding_optimizer)
    entries = plan_entries(model_or_tables, "fused" if spec is not None else gradients)
    if not entries:
        raise ValueError("profiling: the model has no embedding tables")
    sparse = [getattr(b, "sparse", b) for b in islice(batches, max_batches)]  # a Batch, or its KJT
    if not sparse or not all(isinstance(b, KeyedJaggedTensor) for b in sparse):
        raise ValueError("profiling needs batches: KeyedJaggedTensors, or Batch objects holding them in .sparse")
    owned = not dist.is_initialized()
    if owned:  # a process group of one, for the sharded kernels, and gone afterwards
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group, in one order
        mine = cast(dist.ProcessGroup, groups[rank])  # this rank is the member of its own group
        timings, plans = [], []
        grads_of: dict[str, str] = {}
        kinds: dict[tuple[bool, str], list[BaseEmbeddingConfig]] = {}
        for _, t, grads, _ in entries:
            kind = spec.kind if spec is not None else "sgd"
            full = [take(b, t.feature_names, None, dev) for b in sparse]
            tiny = [take(b, t.feature_names, 1, dev) for b in sparse]
            job = _Job([t], grads, spec, dev, mine, lr)
            lookup, update = job.time(full, repeats)
            lookup_tiny, update_tiny = job.time(tiny, repeats)
            del job
            ids = sum(int(b.values().numel()) for b in full) / sum(b.stride() for b in full)
            assert t.dtype is not None  # resolved by the config's __post_init__
            timings.append(
                TableTiming(
                    t.name,
                    t.num_embeddings,
                    t.embedding_dim,
                    t.dtype.itemsize,
                    len(t.feature_names),
                    ids,
                    sum(b.stride() for b in full) / len(full),
                    grads,
                    OPTIMIZER_STATE[kind],
                    lookup,
                    update,
                    lookup_tiny,
                    update_tiny,
                )
            )
            kinds.setdefault((isinstance(t, EmbeddingBagConfig), grads), []).append(t)
            plans.append(t)
            grads_of[t.name] = grads
        group = [0.0, 0.0]
        for (_, grads), tables in kinds.items():
            keys = [f for t in tables for f in t.feature_names]
            job = _Job(tables, grads, spec, dev, mine, lr)
            for i, n in enumerate((None, 1)):
                group[i] += sum(job.time([take(b, keys, n, dev) for b in sparse], repeats))
            del job
        out = Timings(timings, group[0], group[1], processes=world)
        if exchange and world > 1:
            hosts, local = host_groups()
            out.hosts = len(hosts)
            per_host = len(next(h for h in hosts if rank in h))
            # a step's pooled rows per peer: what the output dist of a table-wise plan moves
            stride = sparse[0].stride()
            peer = max(int(stride * sum(len(t.feature_names) * t.embedding_dim * 4 for t in plans) / world), 1 << 16)
            # the bandwidth within a host: every host's ranks at once, as in training (one rank alone: none)
            every = min(len(h) for h in hosts) > 1
            if every:
                out.a2a_tiny_s, out.a2a_big_s = (_a2a(dev, n, repeats, local) for n in (8, peer))
                out.a2a_bytes = (per_host - 1) * peer
            # the latency over every rank, across the hosts' links where there are several
            out.latency_a2a_s = _a2a(dev, 8, repeats)
            out.latency_ring_s = _ring(dev, repeats)
            if len(hosts) > 1:  # the link: every rank sends a step's pooled rows to every other at once
                out.world_a2a_big_s, out.world_a2a_peer_bytes = _a2a(dev, peer, repeats), peer
            out.step_s = _job_step(plans, grads_of, spec, dev, sparse, repeats, lr, reference_plan(plans, world))
            mixed = reference_mixed_plan(plans, world)
            if mixed is not None:
                out.step_mixed_s = _job_step(plans, grads_of, spec, dev, sparse, repeats, lr, mixed)
        return _agree(out, dev) if world > 1 else out
    finally:
        if owned:
            dist.destroy_process_group()


def _agree(t: Timings, device: torch.device) -> Timings:
    """Every rank's timings replaced by their mean over the ranks: every rank fits the same speeds."""
    names = ("lookup_s", "update_s", "lookup_tiny_s", "update_tiny_s")
    flat = [getattr(tt, n) for tt in t.tables for n in names] + [t.group_s, t.group_tiny_s]
    flat += [t.a2a_tiny_s or 0.0, t.a2a_big_s or 0.0] + [tt.ids for tt in t.tables] + [tt.batch for tt in t.tables]
    flat += [t.latency_a2a_s or 0.0, t.latency_ring_s or 0.0, t.step_mixed_s or 0.0, t.step_s or 0.0]
    flat += [t.world_a2a_big_s or 0.0]
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    x = torch.tensor(flat, dtype=torch.float64, device=on)
    dist.all_reduce(x)
    v = (x / dist.get_world_size()).tolist()
    k = len(names) * len(t.tables)
    for i, tt in enumerate(t.tables):
        for j, n in enumerate(names):
            setattr(tt, n, v[i * len(names) + j])
        tt.ids, tt.batch = v[k + 4 + i], v[k + 4 + len(t.tables) + i]
    t.group_s, t.group_tiny_s = v[k], v[k + 1]
    if t.a2a_tiny_s is not None:
        t.a2a_tiny_s, t.a2a_big_s = v[k + 2], v[k + 3]
    if t.latency_a2a_s is not None:
        t.latency_a2a_s, t.latency_ring_s = v[-5], v[-4]
    if t.step_mixed_s is not None:
        t.step_mixed_s = v[-3]
    if t.step_s is not None:
        t.step_s = v[-2]
    if t.world_a2a_big_s is not None:
        t.world_a2a_big_s = v[-1]
    return t


def _job_step(
    tables: list[BaseEmbeddingConfig],
    grads_of: Mapping[str, str],
    spec: FusedOptimizerSpec | None,
    device: torch.device,
    sparse: list[KeyedJaggedTensor],
    repeats: int,
    lr: float,
    plan: ShardingPlan,
) -> float | None:
    """Seconds of the slowest rank's training step of the whole job under ``plan`` (median); None where that
    step cannot be built as one collection (mixed gradients or table types)."""
    grads = set(grads_of.values())
    if len(grads) != 1 or not all(isinstance(t, EmbeddingBagConfig) for t in tables):
        return None
    model = EmbeddingBagCollection(tables, device="meta", sparse_grad=grads == {"sparse"})  # type: ignore[arg-type]
    sharded = shard_modules(model, plan, device=device, embedding_optimizer=spec)
    opt: Any = fused_optimizer(sharded) if spec is not None else torch.optim.SGD(sharded.parameters(), lr=lr)
    keys = [f for t in tables for f in t.feature_names]
    batches = [take(b, keys, None, device) for b in sparse]
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    times = []
    for i in range(2 + max(repeats, 3) * 4):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        _loss(sharded(batches[i % len(batches)])).backward()
        if opt is not None:
            opt.step()
            if spec is None:
                opt.zero_grad(set_to_none=True)
        _sync(device)
        slowest = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=on)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if i >= 2:  # after two warm-up steps
            times.append(float(slowest))
    return statistics.median(times)


def profile_speeds(
    model_or_tables: nn.Module | Sequence[BaseEmbeddingConfig],
    batches: Iterable[Any],
    *,
    device: torch.device | str | None = None,
    embedding_optimizer: FusedOptimizerSpec | Mapping[str, Any] | None = None,
    gradients: str | None = None,
    max_batches: int = 16,
    repeats: int = 3,
    exchange: bool = True,
    hardware: Hardware | None = None,
) -> ProfiledSpeeds:
    """Profile the tables of ``model`` (or a list of configs) on ``batches`` (KeyedJaggedTensors or ``Batch``es
    from the job's loader: the first ``max_batches``) and fit the planner's speeds to what was measured.

    ``embedding_optimizer``: the job's fused optimizer spec (the tables then update inside backward, as in
    training); without it the tables train with sparse or dense gradients (``gradients``, default: each
    collection's ``sparse_grad``) and a torch SGD step. Collective when a process group exists (every rank
    calls it, with its own batches); otherwise it runs in a process group of its own. Save the result with
    ``.save("speeds.json")``; give it, or the file, to ``Planner(speeds=...)``,
    ``RecShardedStrategy(planner_speeds=...)`` or ``lightning-rec plan --speeds``.
    """
    dev = torch.device(device if device is not None else "cpu")
    timings = measure(
        model_or_tables,
        batches,
        device=dev,
        embedding_optimizer=embedding_optimizer,
        gradients=gradients,
        max_batches=max_batches,
        repeats=repeats,
        exchange=exchange,
    )
    return fitted(timings, model_or_tables, device=dev, embedding_optimizer=embedding_optimizer, hardware=hardware)


def fitted(
    timings: Timings,
    model_or_tables: nn.Module | Sequence[BaseEmbeddingConfig],
    *,
    device: torch.device | str | None = None,
    embedding_optimizer: FusedOptimizerSpec | Mapping[str, Any] | None = None,
    hardware: Hardware | None = None,
) -> ProfiledSpeeds:
    """The speeds :func:`profile_speeds` fits to ``timings`` (:func:`measure`'s, of the same tables)."""
    dev = torch.device(device if device is not None else "cpu")
    base = hardware or Hardware.defaults("cuda" if dev.type == "cuda" else "cpu")
    speeds = fit_speeds(timings, base, machine_info(dev.type, device_name(dev)))
    if timings.step_s is None:
        return speeds
    tables = [t for _, t, _, _ in plan_entries(model_or_tables, None)]
    pooling = {f: tt.ids / tt.features for tt, t in zip(timings.tables, tables) for f in t.feature_names}
    batch = max(1, round(statistics.mean(tt.batch for tt in timings.tables)))
    kind = as_spec(embedding_optimizer)
    grads = timings.tables[0].grads
    return calibrate_step(
        speeds,
        tables,
        timings.step_s,
        timings.processes,
        batch,
        pooling,
        kind.kind if kind else "sgd",
        grads,
        step_mixed_s=timings.step_mixed_s,
        local_size=timings.processes // timings.hosts,
        hardware=base,
    )
