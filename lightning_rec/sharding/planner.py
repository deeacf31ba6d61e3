"""Automatic sharding plans: a cost model of the sharded pipeline and a greedy planner over it.

The cost model estimates, for every rank of the model-parallel group, one training step's time and the
memory its tables need, following what ``sharded.py`` and ``comm.py`` actually do:

* a sharded table's owner of a row block receives ``M x batch x ids_per_sample x row_fraction`` ids
  (every rank of the group sends its own), looks them up on its columns and updates what the gradient
  touched: the touched ids with sparse or fused gradients, the whole shard with dense gradients;
* input dist: ids (8 bytes) and bag lengths go to every shard with rows; output dist: pooled partial
  rows come back (all-to-all, so row-wise sends ``M`` partial sums per sample) and the reverse
  all-to-all in backward; ids are bucketized by row block on the sender when a table has several;
* data-parallel tables: a lookup on every rank, then the touched rows' union is gathered and all-reduced
  over the whole world (``comm.embedding_grad``); with 2D layouts, shards all-reduce their touched rows
  over the replica group likewise.

An all-to-all costs each rank (bytes sent + bytes received) / 2 over the bandwidth of each link (within
a host or across hosts); an all-reduce ``2 (n - 1) / n x bytes`` over the slowest link it crosses.
Distinct ids are estimated as for uniformly spread ids, an upper bound for skewed ones.

The planner places tables (or groups kept together) largest first, each where the estimated step time
of the slowest rank grows least (ties: less total work, then the earlier candidate), among placements
that fit every rank's memory. It is deterministic for the same inputs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from lightning_rec.configs import BaseEmbeddingConfig, PoolingType, ShardingType
from lightning_rec.sharding.plan import (
    ParameterSharding,
    ShardingPlan,
    column_wise,
    data_parallel,
    grid_shard,
    resolve_table,
    row_wise,
    table_row_wise,
    table_wise,
)

# -- the original rule, kept for callers that want plain byte-balanced table-wise plans ---------------------


def default_module_plan(tables: list[BaseEmbeddingConfig], group_size: int) -> dict[str, ParameterSharding]:
    """Table-wise, balancing bytes: deterministic for the same tables and group size."""
    load = [0] * group_size
    plan = {}
    order = sorted(
        range(len(tables)),
        key=lambda i: (-tables[i].num_embeddings * tables[i].embedding_dim * tables[i].dtype.itemsize, i),
    )
    for i in order:
        t = tables[i]
        rank = min(range(group_size), key=lambda r: (load[r], r))
        load[rank] += t.num_embeddings * t.embedding_dim * t.dtype.itemsize
        plan[t.name] = table_wise(rank)
    return {t.name: plan[t.name] for t in tables}


# -- inputs ------------------------------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(value: int | float | str | None, what: str = "memory") -> int | None:
    """``"80GB"`` -> 80e9 bytes (SI), ``"64GiB"`` -> 64 * 2**30; ints and floats are bytes; None stays None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a size such as 80GB or 64GiB, got {value!r}")
    if isinstance(value, (int, float)):
        if not value > 0 or not math.isfinite(value):
            raise ValueError(f"{what}: must be a positive number of bytes, got {value!r}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?i?)[bB]?\s*", str(value))
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{what}: expected a size such as 80GB, 64GiB or 1TB, got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


#: optimizer kind -> (fp32 state values per weight value, fp32 state values per row)
OPTIMIZER_STATE: dict[str, tuple[int, int]] = {
    "sgd": (0, 0), "momentum": (1, 0), "adagrad": (1, 0), "rowwise_adagrad": (0, 1), "adam": (2, 0),
    "lamb": (2, 0), "partial_rowwise_adam": (1, 1), "partial_rowwise_lamb": (1, 1),
}
GRADIENTS = ("dense", "sparse", "fused")


@dataclass(frozen=True)
class Hardware:
    """Speeds the cost model assumes; bandwidths in bytes per second.

    ``lookup_bandwidth``: embedding bytes a lookup processes per second, forward and backward together
    (each id also costs ``lookup_overhead_bytes``); ``update_bandwidth``: bytes per second of an optimizer
    step over rows (weight, gradient, state); ``host_lookup_bandwidth``: lookups of tables kept in host
    memory; ``bucketize_rate``: ids per second a sender sorts into row blocks.
    The CPU / gloo defaults were fitted to ``benchmarks/results/sharding.md``; the CUDA / NCCL ones are
    round numbers for a current GPU node (NVLink within a host, a 200 Gb/s NIC per GPU across hosts).
    """

    lookup_bandwidth: float
    update_bandwidth: float
    intra_host_bandwidth: float
    inter_host_bandwidth: float
    host_lookup_bandwidth: float
    bucketize_rate: float
    collective_latency: float
    lookup_overhead_bytes: float = 64.0

    @staticmethod
    def defaults(device: str = "cpu", backend: str | None = None) -> Hardware:
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        backend = backend or ("nccl" if device == "cuda" else "gloo")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if device == "cpu":
            hw = Hardware(4e9, 6e9, 1e9, 1e9, 4e9, 2.7e7, 2e-4)
        else:
            hw = Hardware(1e12, 1.5e12, 1.5e11, 2.5e10, 2e10, 5e9, 3e-5)
        if backend == "gloo" and device == "cuda":  # gloo moves GPU tensors through host memory over TCP
            hw = replace(hw, intra_host_bandwidth=5e9, inter_host_bandwidth=2e9, collective_latency=2e-4)
        return hw


@dataclass(frozen=True)
class Topology:
    """The cluster a plan is for.

    Args:
        world_size: all ranks (``replicas x model_parallel_size``).
        model_parallel_size: ranks of one model-parallel group, the ranks plans speak of (default: world).
        local_size: ranks per host within that group (default: the whole group is one host).
        device_memory: per rank, for tables (weights, optimizer state, gradients, lookup buffers); an int
            in bytes or a string such as ``"80GB"``; None: unlimited.
        host_memory: per host, for tables kept in host memory (looked up at ``host_lookup_bandwidth``);
            None: tables stay in device memory.
        device, backend: pick default ``hardware`` speeds (``"cpu"``/``"gloo"``, ``"cuda"``/``"nccl"``).
        hardware: explicit speeds (see :class:`Hardware`).
    """

    world_size: int = 1
    model_parallel_size: int | None = None
    local_size: int | None = None
    device_memory: int | str | None = None
    host_memory: int | str | None = None
    device: str = "cpu"
    backend: str | None = None
    hardware: Hardware | None = None

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen: fields resolved once here
        for k in ("world_size", "model_parallel_size", "local_size"):
            v = getattr(self, k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"{k} must be a positive int, got {v!r}")
        mp = self.model_parallel_size or self.world_size
        if self.world_size % mp:
            raise ValueError(f"model_parallel_size={mp} must divide world_size={self.world_size}")
        local = self.local_size or mp
        if mp % local:
            raise ValueError(f"local_size={local} (ranks per host) must divide model_parallel_size={mp}")
        set_("model_parallel_size", mp)
        set_("local_size", local)
        set_("device_memory", parse_bytes(self.device_memory, "device_memory"))
        set_("host_memory", parse_bytes(self.host_memory, "host_memory"))
        if self.hardware is None:
            set_("hardware", Hardware.defaults(self.device, self.backend))

    @property
    def replicas(self) -> int:
        return self.world_size // self.model_parallel_size  # type: ignore[operator]

    @property
    def num_hosts(self) -> int:
        return self.model_parallel_size // self.local_size  # type: ignore[operator]


@dataclass(frozen=True)
class TableConstraint:
    """Per-table limits: the sharding types the planner may use, or one fixed placement."""

    sharding_types: Sequence[ShardingType | str] | None = None
    placement: ParameterSharding | None = None
    allow_host_memory: bool = True


class PlannerError(ValueError):
    """No plan fits: the message says which tables and how much memory is missing."""


# -- cost model --------------------------------------------------------------------------------------------
TIME_PARTS = ("lookup", "update", "input_dist", "output_dist", "bucketize", "dp_sync", "replica_sync")
MEMORY_PARTS = ("weights", "optimizer", "gradients", "buffers")


@dataclass
class _Stats:
    """What the cost model needs of one table."""

    path: str
    config: BaseEmbeddingConfig
    rows: int
    dim: int
    elem: int  # bytes per weight value
    wire: int  # bytes per value on the wire and in pooled outputs (bf16 travels as fp32 on gloo)
    features: int
    ids: float  # ids per sample over the table's features
    pooled: bool
    grads: str
    state: tuple[int, int]

    @property
    def label(self) -> str:
        return f"{self.path}/{self.config.name}" if self.path else self.config.name

    def state_bytes(self, cols: np.ndarray | float) -> np.ndarray | float:
        return 4 * (self.state[0] * cols + self.state[1])


@dataclass
class _Load:
    """Per-rank time [len(TIME_PARTS), M], device memory [len(MEMORY_PARTS), M] and host memory [H]."""

    time: np.ndarray
    mem: np.ndarray
    host: np.ndarray

    def __iadd__(self, other: _Load) -> _Load:
        self.time += other.time
        self.mem += other.mem
        self.host += other.host
        return self


def _even_split(total: int, parts: int) -> np.ndarray:
    """``layout.even_split`` as an array (torch.chunk-style blocks)."""
    block = -(-total // parts)
    return np.clip(total - np.arange(parts) * block, 0, block)


@dataclass
class _Candidate:
    sharding: ParameterSharding
    offload: bool = False
    load: _Load | None = None
    fits: bool = True
    short: str = ""  # why it does not fit
    key: tuple = ()

    @property
    def kind(self) -> ShardingType:
        return self.sharding.sharding_type  # type: ignore[return-value]


class _CostModel:
    def __init__(self, topo: Topology, batch_size: int) -> None:
        self.topo, self.hw, self.B = topo, topo.hardware, batch_size
        self.M, self.local, self.R = topo.model_parallel_size, topo.local_size, topo.replicas
        self.H = topo.num_hosts
        self.host_of = np.arange(self.M) // self.local
        hw = self.hw
        # seconds per byte a shard owner receives from (or sends to) every other rank of the group
        self.k_in = (self.local - 1) / hw.intra_host_bandwidth + (self.M - self.local) / hw.inter_host_bandwidth
        self.world = topo.world_size
        self.world_bw = hw.inter_host_bandwidth if self.world > self.local else hw.intra_host_bandwidth

    def empty(self) -> _Load:
        return _Load(np.zeros((len(TIME_PARTS), self.M)), np.zeros((len(MEMORY_PARTS), self.M)), np.zeros(self.H))

    def _a2a(self, ranks: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every rank of the group sends ``x[s]`` bytes to ``ranks[s]``: (owner-side, sender-side) seconds per rank."""
        hw, M = self.hw, self.M
        owner = np.bincount(ranks, x * self.k_in, minlength=M)
        per_rank = np.bincount(ranks, x, minlength=M)
        per_host = np.bincount(ranks // self.local, x, minlength=self.H)
        sender = (x.sum() / hw.inter_host_bandwidth
                  - per_host[self.host_of] * (1 / hw.inter_host_bandwidth - 1 / hw.intra_host_bandwidth)
                  - per_rank / hw.intra_host_bandwidth)
        return owner, np.maximum(sender, 0.0)

    def sharded(
        self, s: _Stats, ranks: np.ndarray, rows: np.ndarray, cols: np.ndarray, offload: bool, col_blocks: int
    ) -> _Load:
        hw, M, B = self.hw, self.M, self.B
        load = self.empty()
        live = rows > 0
        frac = rows / s.rows
        ids = M * B * s.ids * frac  # ids this shard receives per step
        lookup_bw = hw.host_lookup_bandwidth if offload else hw.lookup_bandwidth
        bc = lambda x: np.bincount(ranks, x, minlength=M)  # noqa: E731 - per-shard values summed per rank
        t, m = load.time, load.mem
        t[0] = bc(ids * (cols * s.elem + hw.lookup_overhead_bytes) / lookup_bw)
        row_bytes = 2 * cols * s.elem + s.state_bytes(cols)
        if s.grads == "dense":  # the step and zero_grad run over the whole shard
            t[1] = bc(rows * (row_bytes + cols * s.elem) / hw.update_bandwidth)
        else:
            t[1] = bc(ids * row_bytes / hw.update_bandwidth)
        a = np.where(live, B * (8 * s.ids * frac + 8 * s.features), 0.0)
        out_per = B * (s.features if s.pooled else s.ids * frac)  # pooled rows, or one row per id
        o = np.where(live, out_per * cols * s.wire, 0.0)
        own, every = self._a2a(ranks, a)
        t[2] = (own + every) / 2
        own, every = self._a2a(ranks, o)
        t[3] = own + every  # forward and the reverse in backward, each (sent + received) / 2
        if np.count_nonzero(live) > col_blocks:
            t[4] = B * s.ids / hw.bucketize_rate  # several row blocks: every sender sorts ids by block
        if self.R > 1:
            uniq = rows * -np.expm1(-ids / np.maximum(rows, 1))
            union = rows * -np.expm1(-self.R * ids / np.maximum(rows, 1))
            rep = (self.R * uniq * 8 + 2 * (self.R - 1) / self.R * union * cols * s.wire) / hw.inter_host_bandwidth
            t[6] = bc(rep)
        where = np.zeros_like(m) if offload else m
        where[0] = bc(rows * cols * s.elem)
        where[1] = bc(rows * s.state_bytes(cols))
        grads = {"dense": rows * cols * s.elem, "sparse": ids * (cols * s.elem + 8), "fused": 0 * ids}[s.grads]
        where[2] = bc(grads)
        if offload:
            load.host = np.bincount(self.host_of, where[:3].sum(0), minlength=self.H)
        m[3] = bc(ids * 16 + 2 * M * out_per * cols * s.wire)
        return load

    def replicated(self, s: _Stats) -> _Load:
        hw, B, N, D = self.hw, self.B, s.rows, s.dim
        load = self.empty()
        local_ids = B * s.ids
        uniq = N * -math.expm1(-local_ids / N)
        union = N * -math.expm1(-self.world * local_ids / N)
        t, m = load.time, load.mem
        t[0] = local_ids * (D * s.elem + hw.lookup_overhead_bytes) / hw.lookup_bandwidth
        row_bytes = 2 * D * s.elem + s.state_bytes(D)
        t[1] = (N * (row_bytes + D * s.elem) if s.grads == "dense" else union * row_bytes) / hw.update_bandwidth
        if self.world > 1:
            w = self.world
            t[5] = (w * uniq * 8 + 2 * (w - 1) / w * union * D * s.wire) / self.world_bw
        m[0] = N * D * s.elem
        m[1] = N * s.state_bytes(D)
        m[2] = N * D * s.elem if s.grads == "dense" else (local_ids + union) * D * s.elem
        m[3] = local_ids * 16
        return load

    def of_placement(self, s: _Stats, ps: ParameterSharding, offload: bool = False) -> _Load:
        st = ps.sharding_type
        N, D, M, L = s.rows, s.dim, self.M, self.local
        if st == ShardingType.DATA_PARALLEL:
            return self.replicated(s)
        if st == ShardingType.TABLE_WISE:
            ranks, rows, cols, k = np.array(ps.ranks), np.array([N]), np.array([D]), 1
        elif st == ShardingType.ROW_WISE and ps.row_sizes is None:
            ranks, rows, cols, k = np.arange(M), _even_split(N, M), np.full(M, D), 1
        elif st == ShardingType.COLUMN_WISE and ps.col_sizes is None:
            k = len(ps.ranks)
            ranks, rows, cols = np.array(ps.ranks), np.full(k, N), np.full(k, D // k)
        elif st == ShardingType.TABLE_ROW_WISE:
            ranks = np.arange(L) + ps.host_indexes[0] * L
            rows, cols, k = _even_split(N, L), np.full(L, D), 1
        elif st == ShardingType.GRID_SHARD and ps.col_sizes is None:
            k = len(ps.host_indexes)
            ranks = (np.array(ps.host_indexes)[:, None] * L + np.arange(L)).reshape(-1)
            rows, cols = np.tile(_even_split(N, L), k), np.full(k * L, D // k)
        else:  # explicit sizes: the plan module's own tiling
            return self.of_shards(s, resolve_table(s.config, ps, M, L), offload)
        return self.sharded(s, ranks, rows.astype(np.int64), cols.astype(np.int64), offload, k)

    def of_shards(self, s: _Stats, shards, offload: bool = False) -> _Load:
        if shards is None:
            return self.replicated(s)
        arr = np.array([[sh.rank, sh.rows, sh.cols] for sh in shards], dtype=np.int64).reshape(-1, 3)
        col_blocks = len({sh.col_offset for sh in shards})
        return self.sharded(s, arr[:, 0], arr[:, 1], arr[:, 2], offload, col_blocks)


# -- the explanation ---------------------------------------------------------------------------------------
def _placement(ps: ParameterSharding) -> str:
    st = ps.sharding_type
    if st == ShardingType.DATA_PARALLEL:
        return "data_parallel (every rank)"
    if st == ShardingType.ROW_WISE:
        return "row_wise (all ranks)"
    if st in (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE):
        return f"{st.value} ranks {ps.ranks}"
    return f"{st.value} hosts {ps.host_indexes}"


@dataclass
class TableChoice:
    """One table's placement in a plan and what it costs."""

    module: str
    table: str
    sharding: ParameterSharding
    memory_per_rank: float  # bytes on the rank holding the most of it
    memory_total: float  # bytes over all ranks of the group
    time_ms: float  # its share of the step time on the rank it costs most
    offloaded: bool = False
    fixed: bool = False
    runner_up: str | None = None
    rejected_because: str = ""

    def as_dict(self) -> dict:
        ps = self.sharding
        return {
            "module": self.module, "table": self.table, "sharding_type": ps.sharding_type.value,  # type: ignore[union-attr]
            "ranks": ps.ranks, "host_indexes": ps.host_indexes, "compute_kernel": ps.compute_kernel,
            "offloaded_to_host": self.offloaded, "fixed": self.fixed,
            "memory_per_rank_bytes": int(self.memory_per_rank), "memory_total_bytes": int(self.memory_total),
            "time_ms": self.time_ms, "runner_up": self.runner_up, "runner_up_rejected_because": self.rejected_because,
        }


@dataclass
class PlanReport:
    """A plan with its estimates: per table, per rank (memory and step-time components), and why.

    ``str(report)`` is a readable table; :meth:`as_dict` the same for programs. ``plan`` is the
    ``ShardingPlan``; ``step_time_ms`` the estimated step time of the slowest rank.
    """

    plan: ShardingPlan
    tables: list[TableChoice]
    topology: Topology
    settings: dict
    time: np.ndarray  # seconds [TIME_PARTS, M]
    memory: np.ndarray  # bytes [MEMORY_PARTS, M]
    host_memory: np.ndarray  # bytes per host of tables kept in host memory
    latency_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def rank_time_ms(self) -> np.ndarray:
        return 1e3 * (self.time.sum(0) + self.latency_s)

    @property
    def step_time_ms(self) -> float:
        return float(self.rank_time_ms.max())

    @property
    def slowest_rank(self) -> int:
        return int(np.argmax(self.rank_time_ms))

    def module_plan(self, module_path: str = "") -> dict[str, ParameterSharding]:
        return dict(self.plan.plan.get(module_path, {}))

    def as_dict(self) -> dict:
        topo = self.topology
        t = self.rank_time_ms
        return {
            "layout": {"world_size": topo.world_size, "model_parallel_size": topo.model_parallel_size,
                       "local_size": topo.local_size, "replicas": topo.replicas,
                       "device_memory_bytes": topo.device_memory, "host_memory_bytes": topo.host_memory,
                       "device": topo.device, "backend": topo.backend},
            "settings": dict(self.settings),
            "step_time_ms": self.step_time_ms, "slowest_rank": self.slowest_rank,
            "time_ms_mean": float(t.mean()),
            "tables": [c.as_dict() for c in self.tables],
            "ranks": [
                {"rank": r, "time_ms": float(t[r]),
                 **{f"{p}_ms": float(1e3 * self.time[i, r]) for i, p in enumerate(TIME_PARTS)},
                 "memory_bytes": int(self.memory[:, r].sum()),
                 **{f"{p}_bytes": int(self.memory[i, r]) for i, p in enumerate(MEMORY_PARTS)}}
                for r in range(self.time.shape[1])
            ],
            "host_memory_bytes": [int(x) for x in self.host_memory],
            "notes": list(self.notes),
        }

    def __str__(self) -> str:
        topo, M = self.topology, self.time.shape[1]
        budget = "unlimited" if topo.device_memory is None else _gib(topo.device_memory)
        lines = [
            f"Sharding plan: world {topo.world_size} = {topo.replicas} replica(s) x {M} model-parallel ranks, "
            f"{topo.local_size} ranks per host; device memory {budget} per rank"
            + ("" if topo.host_memory is None else f", host memory {_gib(topo.host_memory)} per host"),
            "settings: " + ", ".join(f"{k}={v}" for k, v in self.settings.items()),
            f"estimated step time {self.step_time_ms:.3f} ms (slowest rank {self.slowest_rank}; "
            f"mean {self.rank_time_ms.mean():.3f} ms); peak memory {_gib(self.memory.sum(0).max())} per rank",
            "",
            f"{'table':<28} {'placement':<34} {'mem/rank':>10} {'ms':>8}  runner-up: why not",
        ]
        for c in self.tables:
            name = f"{c.module}/{c.table}" if c.module else c.table
            where = _placement(c.sharding) + (" [host mem]" if c.offloaded else "") + (" [fixed]" if c.fixed else "")
            why = f"{c.runner_up}: {c.rejected_because}" if c.runner_up else c.rejected_because
            lines.append(f"{name:<28} {where:<34} {_gib(c.memory_per_rank):>10} {c.time_ms:>8.3f}  {why}")
        lines += ["", "per rank (ms: " + ", ".join(TIME_PARTS) + " | GiB: " + ", ".join(MEMORY_PARTS) + "):"]
        t = self.rank_time_ms
        shown = range(M) if M <= 16 else sorted(np.argsort(-t, kind="stable")[:8].tolist())
        for r in shown:
            ms = " ".join(f"{1e3 * x:.3f}" for x in self.time[:, r])
            gb = " ".join(f"{x / 2**30:.3g}" for x in self.memory[:, r])
            lines.append(f"  rank {r:>5}: {t[r]:9.3f} ms = {ms} | {_gib(self.memory[:, r].sum())} = {gb}")
        if M > 16:
            lines.append(f"  ... the {len(shown)} slowest of {M} ranks; time min/median/max "
                         f"{t.min():.3f}/{np.median(t):.3f}/{t.max():.3f} ms")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


# -- the planner -------------------------------------------------------------------------------------------
def _collections(model) -> list[tuple[str, object]]:
    from lightning_rec.modules import EmbeddingBagCollection, EmbeddingCollection

    return [(p, m) for p, m in model.named_modules() if type(m) in (EmbeddingBagCollection, EmbeddingCollection)]


def _configs_of(m) -> list:
    return m.embedding_bag_configs() if hasattr(m, "embedding_bag_configs") else m.embedding_configs()


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


class Planner:
    """Chooses a sharding plan by estimated step time, within memory budgets.

    Args:
        topology: the cluster (:class:`Topology`); default one CPU rank.
        batch_size: samples per rank per step.
        pooling_factors: ``{feature name: mean ids per sample}``; others use ``default_pooling_factor``.
        optimizer: kind of the embedding optimizer, which fixes its state size (see ``OPTIMIZER_STATE``).
        gradients: ``"dense"``, ``"sparse"`` or ``"fused"`` (updated inside backward; data_parallel is
            then only used where a constraint allows it); default: each collection's ``sparse_grad``, dense for bare table lists.
        constraints: ``{table name: TableConstraint}`` (allowed types, a fixed placement).
        together: groups of table names that get one placement together (same type and ranks).
        min_column_width: narrowest column shard considered for column_wise / grid_shard.

    ``plan(model or tables)`` returns a ``ShardingPlan``; ``explain()`` the last :class:`PlanReport`;
    ``estimate(model or tables, plan)`` the same report for any given plan.
    """

    def __init__(
        self,
        topology: Topology | None = None,
        *,
        batch_size: int = 512,
        pooling_factors: Mapping[str, float] | None = None,
        default_pooling_factor: float = 1.0,
        optimizer: str = "sgd",
        gradients: str | None = None,
        constraints: Mapping[str, TableConstraint] | None = None,
        together: Sequence[Sequence[str]] = (),
        min_column_width: int = 32,
    ) -> None:
        self.topology = topology if topology is not None else Topology()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int (samples per rank per step), got {batch_size!r}")
        if optimizer not in OPTIMIZER_STATE:
            raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {list(OPTIMIZER_STATE)}")
        if gradients is not None and gradients not in GRADIENTS:
            raise ValueError(f"gradients must be one of {GRADIENTS} or None, got {gradients!r}")
        self.pooling_factors = dict(pooling_factors or {})
        for f, v in [("<default>", default_pooling_factor), *self.pooling_factors.items()]:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"pooling factor of feature {f!r} must be a number >= 0 (ids per sample), got {v!r}")
        self.batch_size, self.default_pooling_factor = batch_size, float(default_pooling_factor)
        self.optimizer, self.gradients = optimizer, gradients
        self.constraints = dict(constraints or {})
        for name, c in self.constraints.items():
            if not isinstance(c, TableConstraint):
                raise TypeError(f"constraint for table {name!r} must be a TableConstraint, got {type(c).__name__}")
            for st in c.sharding_types or ():
                ParameterSharding(st)  # raises naming the valid types
        self.together = [list(g) for g in together]
        self.min_column_width = min_column_width
        self._model = _CostModel(self.topology, batch_size)
        self._last: PlanReport | None = None

    # -- inputs --------------------------------------------------------------------------------------------
    def _entries(self, model_or_tables) -> list[tuple[str, BaseEmbeddingConfig, str, object]]:
        """(module path, config, gradients, sharded placement or None) for every table to plan or estimate."""
        from torch import nn

        from lightning_rec.sharding.sharded import ShardedCollection

        if isinstance(model_or_tables, nn.Module):
            out = []
            unsharded = {id(m) for _, m in _collections(model_or_tables)}
            for path, m in model_or_tables.named_modules():
                sharded = isinstance(m, ShardedCollection)
                if not sharded and id(m) not in unsharded:
                    continue
                # a collection whose only fused tables are data-parallel is fused too
                fused = sharded and m.is_fused
                grads = self.gradients or ("fused" if fused else "sparse" if m.sparse_grad else "dense")
                tables = m.tables if sharded else _configs_of(m)
                out += [(path, t, grads, m.shards[t.name] if sharded else None) for t in tables]
            return out
        tables = list(model_or_tables)
        for t in tables:
            if not isinstance(t, BaseEmbeddingConfig):
                raise TypeError(f"expected embedding table configs or a model, got {type(t).__name__}")
        names = [t.name for t in tables]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"table names must be unique within a collection; repeated: {dup}")
        return [("", t, self.gradients or "dense", None) for t in tables]

    def _stats(self, path: str, t: BaseEmbeddingConfig, grads: str) -> _Stats:
        ids = sum(self.pooling_factors.get(f, self.default_pooling_factor) for f in t.feature_names)
        backend = self.topology.backend or ("nccl" if self.topology.device == "cuda" else "gloo")
        # gloo carries bfloat16 as float32 (comm._wire_dtype); pooled outputs are at least the table's width
        wire = 4 if backend == "gloo" and t.dtype.itemsize < 4 else t.dtype.itemsize
        return _Stats(path, t, t.num_embeddings, t.embedding_dim, t.dtype.itemsize, wire, len(t.feature_names),
                      float(ids), t.pooling != PoolingType.NONE, grads, OPTIMIZER_STATE[self.optimizer])

    def _check_names(self, stats: list[_Stats]) -> None:
        features = {f for s in stats for f in s.config.feature_names}
        unknown = sorted(f for f in self.pooling_factors if f not in features)
        if unknown:
            raise ValueError(f"pooling_factors name features {unknown} that no table has; features: {sorted(features)}")
        names = {s.config.name for s in stats}
        for what, keys in (("constraints", list(self.constraints)), ("together", [n for g in self.together for n in g])):
            bad = sorted({k for k in keys if k not in names})
            if bad:
                raise ValueError(f"{what} name tables {bad} that are not in the model; tables: {sorted(names)}")

    def _settings(self) -> dict:
        return {"batch_size": self.batch_size, "default_pooling_factor": self.default_pooling_factor,
                "optimizer": self.optimizer, "gradients": self.gradients or "per collection",
                "min_column_width": self.min_column_width}

    def _report(self, stats, choices, load, notes) -> PlanReport:
        plan: dict[str, dict[str, ParameterSharding]] = {}
        for s, c in zip(stats, choices):
            plan.setdefault(s.path, {})[s.config.name] = c.sharding
        kinds = {c.sharding.sharding_type for c in choices}
        lat = self.topology.hardware.collective_latency  # type: ignore[union-attr]
        n_coll = (6 if kinds - {ShardingType.DATA_PARALLEL} else 0) + (3 if ShardingType.DATA_PARALLEL in kinds else 0)
        latency = 0.0 if self.topology.world_size == 1 else n_coll * lat * max(1.0, math.log2(self.topology.world_size))
        return PlanReport(ShardingPlan(plan), choices, self.topology, self._settings(), load.time, load.mem,
                          load.host, latency, notes)

    # -- public ----------------------------------------------------------------------------------------------
    def estimate(self, model_or_tables, plan: ShardingPlan | None = None) -> PlanReport:
        """The cost model's report for ``plan`` (default: the placement of ``model``'s sharded collections)."""
        M, L = self.topology.model_parallel_size, self.topology.local_size
        entries = self._entries(model_or_tables)
        total = self._model.empty()
        choices, stats = [], []
        for path, t, grads, shards in entries:
            s = self._stats(path, t, grads)
            if plan is not None:
                mod = plan.get_plan_for_module(path)
                if mod is None or t.name not in mod:
                    raise ValueError(f"the plan has no entry for table {t.name!r} of module {path!r}")
                ps = mod[t.name]
                shards = resolve_table(t, ps, M, L)  # type: ignore[arg-type]
            elif shards is None and not self._is_sharded(model_or_tables, path):
                raise ValueError(f"table {t.name!r} of module {path!r} is not sharded; pass the plan to estimate")
            load = self._model.of_shards(s, shards)
            total += load
            ps = plan.plan[path][t.name] if plan is not None else _from_shards(shards, M, L)
            choices.append(self._choice(s, ps, load, False, fixed=True))
            stats.append(s)
        return self._report(stats, choices, total, [])

    @staticmethod
    def _is_sharded(model, path: str) -> bool:
        from lightning_rec.sharding.sharded import ShardedCollection

        return hasattr(model, "get_submodule") and isinstance(model.get_submodule(path), ShardedCollection)

    def plan(self, model_or_tables) -> ShardingPlan:
        """A plan for every unsharded collection of ``model`` (or for a list of table configs, module ``""``)."""
        entries = [e for e in self._entries(model_or_tables) if e[3] is None]
        self._last = self._plan([self._stats(p, t, g) for p, t, g, _ in entries])
        return self._last.plan

    def explain(self) -> PlanReport:
        """The report of the last :meth:`plan` call."""
        if self._last is None:
            raise RuntimeError("explain() describes the last plan: call plan(...) first")
        return self._last

    # -- search ----------------------------------------------------------------------------------------------
    def _choice(self, s: _Stats, ps: ParameterSharding, load: _Load, offload: bool, fixed: bool = False) -> TableChoice:
        per_rank = load.mem[:3].sum(0) + load.mem[3]
        t = load.time.sum(0)
        return TableChoice(s.path, s.config.name, ps, float(per_rank.max()) + float(load.host.max(initial=0)),
                           float(per_rank.sum() + load.host.sum()), float(1e3 * t.max()), offload, fixed)

    def _units(self, stats: list[_Stats]) -> list[list[int]]:
        by_name: dict[str, list[int]] = {}
        for i, s in enumerate(stats):
            by_name.setdefault(s.config.name, []).append(i)
        seen: dict[int, int] = {}
        units = []
        for g, group in enumerate(self.together):
            members = [i for n in group for i in by_name.get(n, [])]
            for i in members:
                if i in seen:
                    raise ValueError(f"table {stats[i].config.name!r} is in two 'together' groups: {self.together[seen[i]]} "
                                     f"and {group}")
                seen[i] = g
            units.append(sorted(members))
        units += [[i] for i in range(len(stats)) if i not in seen]
        return units

    def _allowed(self, stats: list[_Stats], unit: list[int]) -> list[ShardingType]:
        allowed = list(ShardingType)
        for i in unit:
            c = self.constraints.get(stats[i].config.name)
            if c is not None and c.sharding_types is not None:
                mine = {ParameterSharding(x).sharding_type for x in c.sharding_types}
                allowed = [a for a in allowed if a in mine]
            # fused data-parallel copies each look up the whole world's batch (the union), a cost not modelled
            # here: never chosen automatically (a plan or a constraint may still ask for it)
            if stats[i].grads == "fused" and not (c is not None and c.sharding_types is not None):
                allowed = [a for a in allowed if a != ShardingType.DATA_PARALLEL]
        if not allowed:
            names = [stats[i].config.name for i in unit]
            raise PlannerError(f"tables {names}: no sharding type is allowed by their constraints"
                               + (" (data_parallel is excluded with fused gradients)" if any(
                                   stats[i].grads == "fused" for i in unit) else ""))
        return allowed

    def _unit_load(self, stats, unit, ps: ParameterSharding, offload: bool) -> _Load:
        total = self._model.empty()
        for i in unit:
            total += self._model.of_placement(stats[i], ps, offload)
        return total

    def _candidates(self, stats, unit, allowed, tot, used, host_used) -> list[_Candidate]:
        topo, M, L, H = self.topology, self.topology.model_parallel_size, self.topology.local_size, self.topology.num_hosts
        budget = np.inf if topo.device_memory is None else topo.device_memory
        free = budget - used
        dims = [stats[i].dim for i in unit]
        widths = [k for k in _divisors(math.gcd(*dims)) if k > 1 and min(dims) // k >= self.min_column_width]
        out: list[ParameterSharding] = []

        def lowest(scores: np.ndarray, room: np.ndarray, ok: np.ndarray, k: int) -> list[int]:
            # the k lowest-scoring places that fit; else the k with most room (the candidate then reports the shortfall)
            if ok.sum() >= k:
                order = np.lexsort((np.arange(len(scores)), scores))
                return sorted(int(x) for x in order[ok[order]][:k])
            return sorted(int(x) for x in np.argsort(-room, kind="stable")[:k])

        for st in allowed:
            if st == ShardingType.DATA_PARALLEL:
                out.append(data_parallel())
            elif st == ShardingType.TABLE_WISE:
                need = self._unit_load(stats, unit, table_wise(0), False).mem.sum(0)[0]
                out.append(table_wise(lowest(tot, free, free >= need, 1)[0]))
            elif st == ShardingType.ROW_WISE:
                out.append(row_wise())
            elif st == ShardingType.COLUMN_WISE:
                for k in (k for k in widths if k <= M):
                    need = self._unit_load(stats, unit, column_wise(list(range(k))), False).mem.sum(0)[0]
                    out.append(column_wise(lowest(tot, free, free >= need, k)))
            elif L > 1 and H > 1 and st in (ShardingType.TABLE_ROW_WISE, ShardingType.GRID_SHARD):
                host_tot = tot.reshape(H, L).max(1)
                for k in ([1] if st == ShardingType.TABLE_ROW_WISE else [k for k in widths if k <= H]):
                    ps = table_row_wise(0) if k == 1 else grid_shard(list(range(k)))
                    need = self._unit_load(stats, unit, ps, False).mem.sum(0)[:L]
                    hosts = lowest(host_tot, free.reshape(H, L).min(1), (free.reshape(H, L) >= need).all(1), k)
                    out.append(table_row_wise(hosts[0]) if k == 1 else grid_shard(hosts))
        cands = [_Candidate(ps) for ps in out]
        if topo.host_memory is not None and all(
                self.constraints.get(stats[i].config.name, TableConstraint()).allow_host_memory for i in unit):
            cands += [_Candidate(replace(c.sharding, compute_kernel="fused_uvm"), offload=True)
                      for c in cands if c.kind != ShardingType.DATA_PARALLEL]
        host_budget = np.inf if topo.host_memory is None else topo.host_memory
        for c in cands:
            c.load = self._unit_load(stats, unit, c.sharding, c.offload)
            over = used + c.load.mem.sum(0) - budget
            host_over = host_used + c.load.host - host_budget
            c.fits = bool((over <= 0).all() and (host_over <= 0).all())
            if not c.fits:
                r = int(np.argmax(over)) if over.max() > 0 else None
                c.short = (f"does not fit: rank {r} would need {_gib(used[r] + c.load.mem[:, r].sum())} of "
                           f"{_gib(budget)} ({_gib(over[r])} short)" if r is not None else
                           f"does not fit: host {int(np.argmax(host_over))} short of host memory by "
                           f"{_gib(host_over.max())}")
        return cands

    def _plan(self, stats: list[_Stats]) -> PlanReport:
        self._check_names(stats)
        topo, model = self.topology, self._model
        budget = np.inf if topo.device_memory is None else topo.device_memory
        total = model.empty()
        choices: list[TableChoice | None] = [None] * len(stats)
        notes: list[str] = []
        units = []
        for unit in self._units(stats):
            fixed = [i for i in unit if self.constraints.get(stats[i].config.name, TableConstraint()).placement]
            if fixed:
                for i in unit:
                    c = self.constraints.get(stats[i].config.name)
                    if c is None or c.placement is None:
                        raise ValueError(f"table {stats[i].config.name!r} is kept together with tables that have a fixed "
                                         "placement: give it the same placement")
                    resolve_table(stats[i].config, c.placement, topo.model_parallel_size, topo.local_size)
                    load = model.of_placement(stats[i], c.placement)
                    total += load
                    choices[i] = self._choice(stats[i], c.placement, load, False, fixed=True)
            elif unit:
                units.append(unit)
        self._check_total(stats, units, total)
        if topo.replicas > 1 and any(s.grads == "fused" for s in stats):
            notes.append("fused tables under replica groups look up the union of the replicas' batches; the "
                         "estimates do not include that extra lookup")
        failures = []
        for mode in ("time", "memory"):
            # a second pass places by memory balance when the time-first pass leaves a table without room
            trial = _Load(total.time.copy(), total.mem.copy(), total.host.copy())
            trial_choices = list(choices)
            failure = self._greedy(stats, units, trial, trial_choices, mode)
            if failure is None:
                if mode == "memory":
                    notes.append("placed by memory balance: placing by time first left a table without room")
                return self._report(stats, trial_choices, trial, notes)
            failures.append(failure)
        raise PlannerError(failures[0])

    def _order(self, stats, units) -> tuple[list[list[int]], list[float]]:
        """Units largest first (memory and work shares), and each one's least total work (its table-wise cost)."""
        mem, work = [], []
        for unit in units:
            only_dp = self._allowed(stats, unit) == [ShardingType.DATA_PARALLEL]
            load = self._unit_load(stats, unit, data_parallel() if only_dp else table_wise(0), False)
            mem.append(load.mem.sum())
            work.append(load.time.sum())
        mem_a, work_a = np.array(mem), np.array(work)
        size = mem_a / max(mem_a.sum(), 1e-30) + work_a / max(work_a.sum(), 1e-30)
        order = np.lexsort((np.arange(len(units)), -size))
        return [units[i] for i in order], [float(work_a[i]) for i in order]

    def _greedy(self, stats, units, total: _Load, choices: list, mode: str) -> str | None:
        topo = self.topology
        budget = np.inf if topo.device_memory is None else topo.device_memory
        ordered, work = self._order(stats, units)
        remaining = float(sum(work))
        for unit, own_work in zip(ordered, work):
            remaining -= own_work
            allowed = self._allowed(stats, unit)
            tot, used = total.time.sum(0), total.mem.sum(0)
            cands = self._candidates(stats, unit, allowed, tot, used, total.host)
            for n, c in enumerate(cands):
                new = tot + c.load.time.sum(0)  # type: ignore[union-attr]
                # the slowest rank can end no lower than the mean work once every table is placed: judging by that
                # bound keeps the greedy from spreading early tables thin at the cost of total work
                projected = max(new.max(), (new.sum() + max(remaining, 0.0)) / len(new))
                mem_peak = (used + c.load.mem.sum(0)).max() / (budget if np.isfinite(budget) else 1.0)  # type: ignore[union-attr]
                c.key = (projected, new.sum(), n) if mode == "time" else (mem_peak, projected, n)
            fitting = sorted((c for c in cands if c.fits), key=lambda c: c.key)
            if not fitting:
                return self._no_fit(stats, unit, cands, total, sum(x is not None for x in choices))
            best = fitting[0]
            total += best.load  # type: ignore[arg-type]
            # the runner-up is the best other sharding type; another placement of the same type only if none
            others = sorted((c for c in cands if c is not best), key=lambda c: (c.kind == best.kind, not c.fits, c.key))
            for i in unit:
                own = self._model.of_placement(stats[i], best.sharding, best.offload)
                ch = self._choice(stats[i], best.sharding, own, best.offload)
                if others:
                    ru = others[0]
                    ch.runner_up = _placement(ru.sharding) + (" [host mem]" if ru.offload else "")
                    ch.rejected_because = ru.short if not ru.fits else self._why(best, ru, tot)
                else:
                    ch.rejected_because = "the only allowed placement"
                choices[i] = ch
        return None

    @staticmethod
    def _why(best: _Candidate, other: _Candidate, tot: np.ndarray) -> str:
        b, o = tot + best.load.time.sum(0), tot + other.load.time.sum(0)  # type: ignore[union-attr]
        if o.max() > b.max():
            return f"slowest rank {1e3 * o.max():.3f} ms instead of {1e3 * b.max():.3f} ms"
        if o.sum() > b.sum():
            return f"same slowest rank, {1e3 * (o.sum() - b.sum()):.3f} ms more work over all ranks"
        return "placed by memory balance instead"

    def _check_total(self, stats, units, fixed: _Load) -> None:
        topo = self.topology
        if topo.device_memory is None:
            return
        M = topo.model_parallel_size
        capacity = M * topo.device_memory + (0 if topo.host_memory is None else topo.num_hosts * topo.host_memory)
        needs = []
        for unit in units:
            allowed = self._allowed(stats, unit)
            ps = data_parallel() if allowed == [ShardingType.DATA_PARALLEL] else table_wise(0)
            needs.append((float(self._unit_load(stats, unit, ps, False).mem.sum()), unit))
        need = sum(n for n, _ in needs) + float(fixed.mem.sum())
        if need > capacity:
            big = sorted(needs, key=lambda x: -x[0])[:5]
            names = ", ".join(f"{stats[u[0]].label!r}{'+' if len(u) > 1 else ''} {_gib(n)}" for n, u in big)
            raise PlannerError(
                f"the tables need at least {_gib(need)} (weights, optimizer state, gradients and lookup buffers) but "
                f"the {M} model-parallel ranks have {_gib(capacity)}: {_gib(need - capacity)} missing. Largest: {names}. "
                "Add ranks or memory, lower the batch size, use a smaller optimizer state (rowwise_adagrad) or "
                "fused/sparse gradients"
            )

    def _no_fit(self, stats, unit, cands, total: _Load, placed: int) -> str:
        best = min(cands, key=lambda c: (c.load.mem.sum(0) + total.mem.sum(0)).max())  # type: ignore[union-attr]
        names = [stats[i].label for i in unit]
        need = (best.load.mem.sum(0) + total.mem.sum(0)).max()  # type: ignore[union-attr]
        missing = need - self.topology.device_memory  # type: ignore[operator]
        return (
            f"no placement of table{'s' if len(unit) > 1 else ''} {names} fits in device memory after {placed} other "
            f"tables were placed: its least demanding placement, {_placement(best.sharding)}, {best.short}; "
            f"about {_gib(max(missing, 0))} missing on the fullest rank. Add ranks or memory, allow more sharding types "
            "for it, or lower the batch size"
        )


def _from_shards(shards, group_size: int, local_size: int) -> ParameterSharding:
    """A ParameterSharding describing resolved shards (for reports of already-sharded modules)."""
    if shards is None:
        return data_parallel()
    by_col = sorted({(s.col_offset, s.cols) for s in shards})
    ranks = sorted({s.rank for s in shards})
    sizes = [c for _, c in by_col]
    if len(shards) == 1:
        return table_wise(shards[0].rank)
    if len(by_col) == len(shards):
        return column_wise([s.rank for s in sorted(shards, key=lambda s: s.col_offset)], sizes)
    hosts = sorted({r // local_size for r in ranks})
    if len(by_col) == 1:
        return row_wise([s.rows for s in sorted(shards, key=lambda s: s.rank)]) if len(ranks) == group_size \
            else table_row_wise(hosts[0])
    return grid_shard(hosts, sizes)


def automatic_plan(
    model,
    group_size: int,
    local_size: int | None = None,
    world_size: int | None = None,
    embedding_optimizer=None,
    **planner_kwargs,
) -> Planner:
    """The planner ``shard_modules`` and the strategy use when no plan is given; call ``.plan(model)`` on it.

    ``embedding_optimizer`` (a fused spec or dict) sets the optimizer state size and fused gradients;
    other keywords go to :class:`Planner` (``topology`` fields are built from the sizes here).
    """
    from lightning_rec.optim import as_spec

    topo_kw = {k: planner_kwargs.pop(k) for k in ("device_memory", "host_memory", "device", "backend", "hardware")
               if k in planner_kwargs}
    topo = Topology(world_size or group_size, group_size, local_size, **topo_kw)
    spec = as_spec(embedding_optimizer)
    if spec is not None:
        planner_kwargs.setdefault("optimizer", spec.kind)
        planner_kwargs.setdefault("gradients", "fused")
    return Planner(topo, **planner_kwargs)
