"""The cost model: one training step's time and the memory of every rank, for a placement of a table.

It follows what the sharded pipeline actually does (``pipeline/shard_modules.py``, ``pipeline/collectives.py``):

* a sharded table's owner of a row block receives ``M x batch x ids_per_sample x row_fraction`` ids
  (every rank of the group sends its own), looks them up on its columns and updates what the gradient
  touched: the touched ids with sparse or fused gradients, the whole shard with dense gradients;
* input dist: ids (8 bytes) and bag lengths go to every shard with rows; output dist: pooled partial
  rows come back (all-to-all, so row-wise sends ``M`` partial sums per sample) and the reverse
  all-to-all in backward; ids are bucketized by row block on the sender when a table has several;
* data-parallel tables: a lookup on every rank, then the touched rows' union is gathered and all-reduced
  over the whole world (``comm.embedding_grad``); with 2D layouts, shards all-reduce their touched rows
  over the replica group likewise (across the hosts' links, or within a host where the 2D arrangement keeps
  the replicas there: ``Topology.replicas_within_host``). Fused data-parallel tables instead look up and
  update the union of every rank's batch on every replica, after an all-gather of the ids (and of the pooled
  gradients in backward).

An all-to-all costs each rank (bytes sent + bytes received) / 2 over the bandwidth of each link (within
a host or across hosts); an all-reduce ``2 (n - 1) / n x bytes`` over the slowest link it crosses.
Distinct ids are estimated as for uniformly spread ids, an upper bound for skewed ones.

Besides their bytes, the exchanges cost a fixed latency per step (:func:`exchange_latency`), once per plan
whatever its number of tables: the sharded kinds' all-to-alls, and the data-parallel sync's ring collectives,
whose messages go round the ring one hop after another (``4 (n - 1)`` hops over ``n`` ranks: two all-gathers
and an all-reduce). On the 2 x 2 simulated hosts (gloo across a 1 Gbit/s link, 4 ranks on 2 cores) a tiny
all-to-all took 1.5 ms, a ring all-gather 3.4 ms and a ring all-reduce 5 ms: the sync of 18 tables of a few
dozen rows (0.1 MB) took 10-12 ms of a 50-75 ms step, where its bytes alone would take under 1 ms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, overload

import numpy as np

from lightning_rec.configs import BaseEmbeddingConfig
from lightning_rec.fused_kinds import FUSED_KINDS
from lightning_rec.plans.kinds import KINDS, ParameterSharding
from lightning_rec.plans.planner.topology import Topology
from lightning_rec.plans.shard_geometry import ShardMeta

#: optimizer kind -> (fp32 state values per weight value, fp32 state values per row)
#: optimizer kind -> (state values per weight value, state values per row): the fused kinds from their table,
#: plus the torch optimizers' momentum
OPTIMIZER_STATE: dict[str, tuple[int, int]] = {
    **{k: (v.state_per_value, v.state_per_row) for k, v in FUSED_KINDS.items()},
    "momentum": (1, 0),
}
GRADIENTS = ("dense", "sparse", "fused")

#: the sharded kinds' collectives per step: the input dist's counts and payload, the output dist and its reverse
#: in backward, and their bookkeeping exchanges
SHARDED_COLLECTIVES = 6


def exchange_latency(kinds: set[str], world: int, collective_latency: float) -> float:
    """Seconds per step the exchanges of a plan using sharding types ``kinds`` wait whatever their bytes.

    An all-to-all's messages leave together (``log2(world)`` latencies, as before rings were counted); the
    data-parallel sync's two all-gathers and its all-reduce go round a ring of ``world`` ranks,
    ``4 (world - 1)`` hops in turn (``pipeline/collectives.py``: ``_union_of_touched_rows``, ``_sum_touched_rows``).
    """
    if world <= 1:
        return 0.0
    out = 0.0
    if set(kinds) - {"data_parallel"}:
        out += SHARDED_COLLECTIVES * collective_latency * max(1.0, math.log2(world))
    if "data_parallel" in kinds:
        out += 4 * (world - 1) * collective_latency
    return out


TIME_PARTS = ("lookup", "update", "input_dist", "output_dist", "bucketize", "dp_sync", "replica_sync")
MEMORY_PARTS = ("weights", "optimizer", "gradients", "buffers")


@dataclass
class TableStats:
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
    #: this table's speeds (bytes per second, as :class:`Hardware`'s): the topology's, or a profile's
    lookup_bw: float
    host_lookup_bw: float
    update_bw: float
    #: per-shard values of this table's small tilings, kept by the search (``terms.py``)
    shapes: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def label(self) -> str:
        return f"{self.path}/{self.config.name}" if self.path else self.config.name

    def state_bytes(self, cols: np.ndarray | float) -> np.ndarray | float:
        return 4 * (self.state[0] * cols + self.state[1])


@dataclass
class Load:
    """Per-rank time [len(TIME_PARTS), M], device memory [len(MEMORY_PARTS), M] and host memory [H]."""

    time: np.ndarray
    mem: np.ndarray
    host: np.ndarray

    def __iadd__(self, other: Load) -> Load:
        self.time += other.time
        self.mem += other.mem
        self.host += other.host
        return self


class CostModel:
    """Per-rank time and memory of placements on one topology, for ``batch_size`` samples per rank."""

    def __init__(self, topo: Topology, batch_size: int) -> None:
        # Topology.__post_init__ resolves the defaulted fields
        assert topo.hardware is not None and topo.model_parallel_size is not None and topo.local_size is not None
        self.topo, self.hw, self.B = topo, topo.hardware, batch_size
        self.M, self.local, self.R = topo.model_parallel_size, topo.local_size, topo.replicas
        self.H = topo.num_hosts
        self.host_of = np.arange(self.M) // self.local
        hw = self.hw
        # seconds per byte a shard owner receives from (or sends to) every other rank of the group
        self.k_in = (self.local - 1) / hw.intra_host_bandwidth + (self.M - self.local) / hw.inter_host_bandwidth
        self.world = topo.world_size
        # the replicas of a shard sync over one host's memory when the arrangement keeps them there; else
        # across the hosts, every rank of a host at once through its link (even when the shard group is a
        # whole host and no exchange of the group crosses)
        self.replica_bw = hw.intra_host_bandwidth if topo.replicas_within_host else hw.inter_host_bandwidth
        self.world_bw = hw.inter_host_bandwidth if self.world > self.local else hw.intra_host_bandwidth
        if topo.host_link is not None and self.world > self.local:
            # a ring crosses each host's link with one rank's stream: the whole link, not a rank's share
            self.world_bw = min(float(topo.host_link), hw.intra_host_bandwidth)

    def empty(self) -> Load:
        return Load(np.zeros((len(TIME_PARTS), self.M)), np.zeros((len(MEMORY_PARTS), self.M)), np.zeros(self.H))

    def _spread(self, ranks: np.ndarray, x: np.ndarray, distinct: bool) -> np.ndarray:
        """Per-shard values summed per rank. With distinct ranks (one shard per rank, true of every tiling of
        one table) a scatter gives the same numbers as ``np.bincount`` at a fraction of its cost."""
        if not distinct:
            return np.bincount(ranks, x, minlength=self.M)
        out = np.zeros(self.M)
        out[ranks] = x
        return out

    def _a2a(self, ranks: np.ndarray, x: np.ndarray, distinct: bool) -> tuple[np.ndarray, np.ndarray]:
        """Every rank of the group sends ``x[s]`` bytes to ``ranks[s]``: (owner-side, sender-side) seconds per rank."""
        hw = self.hw
        owner = self._spread(ranks, x * self.k_in, distinct)
        per_host = np.bincount(ranks // self.local, x, minlength=self.H)
        # a rank sends everything at the inter-host speed, less what stays on its host or on itself
        sender = (
            x.sum() / hw.inter_host_bandwidth - per_host * (1 / hw.inter_host_bandwidth - 1 / hw.intra_host_bandwidth)
        )[self.host_of]
        if distinct:
            sender[ranks] -= x / hw.intra_host_bandwidth
        else:
            sender -= np.bincount(ranks, x, minlength=self.M) / hw.intra_host_bandwidth
        return owner, np.maximum(sender, 0.0)

    def shard_memory(self, s: TableStats, rows: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, ...]:
        """Per-shard (weights, optimizer, gradients, buffers) bytes, one array each (MEMORY_PARTS)."""
        M, B = self.M, self.B
        ids = M * B * s.ids * (rows / s.rows)  # ids this shard receives per step
        out_per = B * (s.features if s.pooled else s.ids * (rows / s.rows))  # pooled rows, or one row per id
        if s.grads == "dense":
            grads = rows * cols * s.elem
        elif s.grads == "sparse":
            grads = ids * (cols * s.elem + 8)
        else:
            grads = 0 * ids
        return (rows * cols * s.elem, rows * s.state_bytes(cols), grads, ids * 16 + 2 * M * out_per * cols * s.wire)

    @overload
    def sharded(
        self,
        s: TableStats,
        ranks: np.ndarray,
        rows: np.ndarray,
        cols: np.ndarray,
        offload: bool,
        col_blocks: int,
        distinct: bool = ...,
        both: Literal[False] = ...,
    ) -> Load: ...
    @overload
    def sharded(
        self,
        s: TableStats,
        ranks: np.ndarray,
        rows: np.ndarray,
        cols: np.ndarray,
        offload: bool,
        col_blocks: int,
        distinct: bool,
        both: Literal[True],
    ) -> tuple[Load, Load]: ...
    @overload
    def sharded(
        self,
        s: TableStats,
        ranks: np.ndarray,
        rows: np.ndarray,
        cols: np.ndarray,
        offload: bool,
        col_blocks: int,
        distinct: bool = ...,
        both: bool = ...,
    ) -> Load | tuple[Load, Load]: ...
    def sharded(
        self,
        s: TableStats,
        ranks: np.ndarray,
        rows: np.ndarray,
        cols: np.ndarray,
        offload: bool,
        col_blocks: int,
        distinct: bool = False,
        both: bool = False,
    ) -> Load | tuple[Load, Load]:
        """The load of shards ``(ranks, rows, cols)``; ``both``: (in device memory, in host memory)."""
        hw, M, B = self.hw, self.M, self.B
        time = np.zeros((len(TIME_PARTS), M))
        live = rows > 0
        frac = rows / s.rows
        ids = M * B * s.ids * frac  # ids this shard receives per step
        put = lambda x: self._spread(ranks, x, distinct)  # noqa: E731 - per-shard values summed per rank
        t = time
        row_bytes = 2 * cols * s.elem + s.state_bytes(cols)
        if s.grads == "dense":  # the step and zero_grad run over the whole shard
            t[1] = put(rows * (row_bytes + cols * s.elem) / s.update_bw)
        else:
            t[1] = put(ids * row_bytes / s.update_bw)
        a = np.where(live, B * (8 * s.ids * frac + 8 * s.features), 0.0)
        out_per = B * (s.features if s.pooled else s.ids * frac)  # pooled rows, or one row per id
        o = np.where(live, out_per * cols * s.wire, 0.0)
        own, every = self._a2a(ranks, a, distinct)
        t[2] = (own + every) / 2
        own, every = self._a2a(ranks, o, distinct)
        t[3] = own + every  # forward and the reverse in backward, each (sent + received) / 2
        if np.count_nonzero(live) > col_blocks:
            t[4] = B * s.ids / hw.bucketize_rate  # several row blocks: every sender sorts ids by block
        if self.R > 1:
            uniq = rows * -np.expm1(-ids / np.maximum(rows, 1))
            union = rows * -np.expm1(-self.R * ids / np.maximum(rows, 1))
            rep = (self.R * uniq * 8 + 2 * (self.R - 1) / self.R * union * cols * s.wire) / self.replica_bw
            t[6] = put(rep)
        per_shard = self.shard_memory(s, rows, cols)
        mem = np.zeros((len(MEMORY_PARTS), M))
        for i in range(len(MEMORY_PARTS)):
            mem[i] = put(per_shard[i])
        loads = []
        for host in (False, True) if both else (offload,):
            bw = s.host_lookup_bw if host else s.lookup_bw
            tt = time.copy() if both else time
            tt[0] = put(ids * (cols * s.elem + hw.lookup_overhead_bytes) / bw)
            if host:  # weights, state and gradients in host memory; lookup buffers stay on the device
                hm = np.zeros_like(mem)
                hm[3] = mem[3]
                loads.append(Load(tt, hm, np.bincount(self.host_of, mem[:3].sum(0), minlength=self.H)))
            else:
                loads.append(Load(tt, mem.copy() if both else mem, np.zeros(self.H)))
        return (loads[0], loads[1]) if both else loads[0]

    def replicated(self, s: TableStats) -> Load:
        hw, B, N, D = self.hw, self.B, s.rows, s.dim
        load = self.empty()
        local_ids = B * s.ids
        uniq = N * -math.expm1(-local_ids / N)
        union = N * -math.expm1(-self.world * local_ids / N)
        t, m = load.time, load.mem
        row_bytes = 2 * D * s.elem + s.state_bytes(D)
        w = self.world
        fused = s.grads == "fused"
        # fused: every replica looks up, and updates in backward, the union of every rank's batch: the ids are
        # all-gathered in forward and the pooled gradients in backward (pipeline/fused_lookup.py)
        looked_up = w * local_ids if fused else local_ids
        t[0] = looked_up * (D * s.elem + hw.lookup_overhead_bytes) / s.lookup_bw
        if fused:
            t[1] = looked_up * row_bytes / s.update_bw
            if w > 1:
                rows_out = B * (s.features if s.pooled else s.ids)
                gathered = B * (8 * s.ids + 8 * s.features) + rows_out * D * s.wire
                t[5] = (w - 1) * gathered / self.world_bw
        else:
            t[1] = (N * (row_bytes + D * s.elem) if s.grads == "dense" else union * row_bytes) / s.update_bw
            if w > 1:
                t[5] = (w * uniq * 8 + 2 * (w - 1) / w * union * D * s.wire) / self.world_bw
        m[0] = N * D * s.elem
        m[1] = N * s.state_bytes(D)
        m[2] = N * D * s.elem if s.grads == "dense" else (local_ids + union) * D * s.elem
        m[3] = local_ids * 16
        return load

    @overload
    def of_placement(
        self, s: TableStats, ps: ParameterSharding, offload: bool = ..., both: Literal[False] = ...
    ) -> Load: ...
    @overload
    def of_placement(
        self, s: TableStats, ps: ParameterSharding, offload: bool = ..., *, both: Literal[True]
    ) -> tuple[Load, Load]: ...
    def of_placement(
        self, s: TableStats, ps: ParameterSharding, offload: bool = False, both: bool = False
    ) -> Load | tuple[Load, Load]:
        """The load of a valid placement (``both``: the pair in device memory, in host memory)."""
        tiling = KINDS[ps.sharding_type].layout(s.config, ps, self.M, self.local)  # type: ignore[index]
        if tiling is None:
            return self.replicated(s)
        return self.sharded(s, tiling.rank, tiling.rows, tiling.cols, offload, tiling.col_blocks, True, both)

    def of_shards(self, s: TableStats, shards: list[ShardMeta] | None, offload: bool = False) -> Load:
        if shards is None:
            return self.replicated(s)
        arr = np.array([[sh.rank, sh.rows, sh.cols] for sh in shards], dtype=np.int64).reshape(-1, 3)
        col_blocks = len({sh.col_offset for sh in shards})
        return self.sharded(s, arr[:, 0], arr[:, 1], arr[:, 2], offload, col_blocks)
