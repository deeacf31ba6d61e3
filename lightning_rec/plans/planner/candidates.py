"""The search's candidates: the places the sharding kinds may put a unit (:class:`Space`), each placement's
fit and sort key from its terms (:func:`score`), and the report's reasons (:func:`shortfall`, :func:`why`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import cast

import numpy as np

from lightning_rec.configs import ShardingType
from lightning_rec.plans.kinds import ParameterSharding
from lightning_rec.plans.planner.cost import MEMORY_PARTS, CostModel, Load, TableStats
from lightning_rec.plans.planner.terms import Terms, probe_memory, probe_need
from lightning_rec.plans.planner.topology import Topology, human_bytes, human_ms


@dataclass
class Candidate:
    """One placement the search scores: its terms, fit and sort key."""

    sharding: ParameterSharding
    offload: bool = False
    terms: Terms | None = None
    load: Load | None = None  # the unit's per-part load, where it was computed anyway
    fits: bool = True
    short: str = ""  # why it does not fit
    key: tuple = ()
    new: np.ndarray | None = None  # per rank: the time placed so far plus this placement's

    @property
    def kind(self) -> ShardingType:
        return self.sharding.sharding_type  # type: ignore[return-value]


class Space:
    """Where a unit's placements may go: the ``CandidateSpace`` the sharding kinds propose candidates in."""

    def __init__(
        self,
        model: CostModel,
        topo: Topology,
        stats: list[TableStats],
        widths: list[int],
        tot: np.ndarray,
        free: np.ndarray,
    ) -> None:
        assert topo.model_parallel_size is not None and topo.local_size is not None  # resolved by Topology
        self.group_size, self.local_size, self.num_hosts = topo.model_parallel_size, topo.local_size, topo.num_hosts
        self.column_shards: Sequence[int] = widths
        self._model, self._stats, self._tot, self._free = model, stats, tot, free

    def _need(self, probe: ParameterSharding, upto: int) -> np.ndarray:
        """Memory ranks ``0..upto-1`` would hold under ``probe`` (the unit's tables together)."""
        if len(self._stats) == 1:
            return probe_need(self._model, self._stats[0], probe, upto)
        total = np.zeros((len(MEMORY_PARTS), upto))
        for s in self._stats:
            total += probe_memory(self._model, s, probe, upto)
        return total.sum(0)

    @staticmethod
    def _lowest(scores: np.ndarray, room: np.ndarray, ok: np.ndarray, k: int) -> list[int]:
        # the k lowest-scoring places that fit; else the k with most room (the candidate then reports the shortfall)
        if ok.sum() >= k:  # the first k of a stable sort of the fitting places by score (ties: the lower index)
            vals = np.where(ok, scores, np.inf)
            if k == 1:
                return [int(np.argmin(vals))]
            if k < len(vals):
                idx = np.flatnonzero(vals <= np.partition(vals, k - 1)[k - 1])
            else:
                idx = np.arange(len(vals))
            return sorted(int(x) for x in idx[np.argsort(vals[idx], kind="stable")][:k])
        return sorted(int(x) for x in np.argsort(-room, kind="stable")[:k])

    def best_ranks(self, k: int, probe: ParameterSharding) -> list[int]:
        need = self._need(probe, 1)[0]  # every shard of the probe weighs what its first one does
        return self._lowest(self._tot, self._free, self._free >= need, k)

    def best_hosts(self, k: int, probe: ParameterSharding) -> list[int]:
        H, L = self.num_hosts, self.local_size
        need = self._need(probe, L)  # the probe's first host
        free = self._free.reshape(H, L)
        return self._lowest(
            _per_host(self._tot, H, L, np.maximum),
            _per_host(self._free, H, L, np.minimum),
            cast(np.ndarray, (free >= need).all(1)),
            k,
        )


def _per_host(x: np.ndarray, hosts: int, local: int, op: np.ufunc) -> np.ndarray:
    """``x.reshape(hosts, local).max(1)`` (``op=np.maximum``; min likewise), a host's ranks folded column by column:
    the same numbers at a fraction of the cost of numpy's reduction over short rows."""
    cols = x.reshape(hosts, local)
    out = cols[:, 0].copy()
    for j in range(1, local):
        op(out, cols[:, j], out=out)
    return out


def in_host_memory(ps: ParameterSharding) -> ParameterSharding:
    """The placement with its tables in host memory."""
    return replace(ps, compute_kernel="fused_uvm")


class Probes:
    """A ``CandidateSpace`` that puts every placement where its probe is: the shapes of a unit's candidates."""

    def __init__(self, topo: Topology, widths: list[int]) -> None:
        assert topo.model_parallel_size is not None and topo.local_size is not None  # resolved by Topology
        self.group_size, self.local_size, self.num_hosts = topo.model_parallel_size, topo.local_size, topo.num_hosts
        self.column_shards: Sequence[int] = widths

    def best_ranks(self, k: int, probe: ParameterSharding) -> list[int]:
        return list(probe.ranks or [])

    def best_hosts(self, k: int, probe: ParameterSharding) -> list[int]:
        return list(probe.host_indexes or [])


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    return [k for k in range(1, n + 1) if n % k == 0]


def score(
    cands: list[tuple[int, Candidate]],
    topo: Topology,
    tot: np.ndarray,
    used: np.ndarray,
    host_used: np.ndarray,
    remaining: float,
    mode: str,
) -> None:
    """Each candidate's fit and sort key (ties: its index), from the per-rank time and memory placed so far."""
    # Topology.__post_init__ parses sizes given as strings into bytes
    budget: float = np.inf if topo.device_memory is None else cast(int, topo.device_memory)
    host_budget: float = np.inf if topo.host_memory is None else cast(int, topo.host_memory)
    assert topo.local_size is not None
    # a rank without a shard of the candidate keeps its memory: only the shards' ranks can newly overflow
    used_ok, used_max = bool((used <= budget).all()), used.max()
    host_ok = bool((host_used <= host_budget).all())
    M = len(tot)
    for n, c in cands:
        t = c.terms
        assert t is not None  # the search computes a candidate's terms before scoring it
        c.new = new = t.time_after(tot, topo.local_size)
        after = used[t.ranks] + t.mem
        host_fits = host_ok if t.host is None else bool((host_used + t.host <= host_budget).all())
        c.fits = used_ok and bool((after <= budget).all()) and host_fits
        if not c.fits:
            c.short = shortfall(used + t.mem_on(M), host_used + t.host_on(len(host_used)), budget, host_budget)
        # the slowest rank can end no lower than the mean work once every table is placed: judging by that
        # bound keeps the greedy from spreading early tables thin at the cost of total work
        total_work = new.sum()
        projected = max(new.max(), (total_work + max(remaining, 0.0)) / M)
        if mode == "time":
            c.key = (projected, total_work, n)
        else:
            peak = max(used_max, after.max())  # (used + memory).max(): the memory is 0 off the shards
            c.key = (peak / (budget if np.isfinite(budget) else 1.0), projected, n)


def shortfall(mem: np.ndarray, host: np.ndarray, budget: float, host_budget: float) -> str:
    """Why a placement with these per-rank and per-host totals does not fit."""
    over, host_over = mem - budget, host - host_budget
    if over.max() > 0:
        r = int(np.argmax(over))
        return (
            f"does not fit: rank {r} would need {human_bytes(mem[r])} of {human_bytes(budget)} "
            f"({human_bytes(over[r])} short)"
        )
    return f"does not fit: host {int(np.argmax(host_over))} short of host memory by {human_bytes(host_over.max())}"


def why(best: Candidate, other: Candidate) -> str:
    """Why ``other`` lost to ``best``, for the report."""
    b, o = best.new, other.new
    assert b is not None and o is not None  # both were scored
    if o.max() > b.max():
        return f"slowest rank {human_ms(1e3 * o.max())} ms instead of {human_ms(1e3 * b.max())} ms"
    if o.sum() > b.sum():
        return f"same slowest rank, {human_ms(1e3 * (o.sum() - b.sum()))} ms more work over all ranks"
    return "placed by memory balance instead"
