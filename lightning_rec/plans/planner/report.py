"""The explanation of a plan: each table's placement, cost and runner-up, and every rank's estimates."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from lightning_rec.plans.kinds import KINDS, ParameterSharding
from lightning_rec.plans.plan import ShardingPlan
from lightning_rec.plans.planner.cost import MEMORY_PARTS, TIME_PARTS
from lightning_rec.plans.planner.topology import Topology, human_bytes, human_ms, human_rate


def placement_label(ps: ParameterSharding) -> str:
    """``table_wise ranks [3]``, ``row_wise (all ranks)``, ...: the kind's label of a placement."""
    return KINDS[ps.sharding_type].label(ps)  # type: ignore[index]


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
            "module": self.module,
            "table": self.table,
            "sharding_type": ps.sharding_type.value,  # type: ignore[union-attr]
            "ranks": ps.ranks,
            "host_indexes": ps.host_indexes,
            "compute_kernel": ps.compute_kernel,
            "offloaded_to_host": self.offloaded,
            "fixed": self.fixed,
            "memory_per_rank_bytes": int(self.memory_per_rank),
            "memory_total_bytes": int(self.memory_total),
            "time_ms": self.time_ms,
            "runner_up": self.runner_up,
            "runner_up_rejected_because": self.rejected_because,
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
            "layout": {
                "world_size": topo.world_size,
                "model_parallel_size": topo.model_parallel_size,
                "local_size": topo.local_size,
                "replicas": topo.replicas,
                "device_memory_bytes": topo.device_memory,
                "host_memory_bytes": topo.host_memory,
                "device": topo.device,
                "backend": topo.backend,
                **({} if topo.host_link is None else {"host_link_bytes_per_s": topo.host_link}),
                **({"replicas_within_host": True} if topo.replicas_within_host else {}),
            },
            "settings": dict(self.settings),
            "step_time_ms": self.step_time_ms,
            "slowest_rank": self.slowest_rank,
            "time_ms_mean": float(t.mean()),
            "tables": [c.as_dict() for c in self.tables],
            "ranks": [
                {
                    "rank": r,
                    "time_ms": float(t[r]),
                    **{f"{p}_ms": float(1e3 * self.time[i, r]) for i, p in enumerate(TIME_PARTS)},
                    "latency_ms": 1e3 * self.latency_s,
                    "memory_bytes": int(self.memory[:, r].sum()),
                    **{f"{p}_bytes": int(self.memory[i, r]) for i, p in enumerate(MEMORY_PARTS)},
                }
                for r in range(self.time.shape[1])
            ],
            "host_memory_bytes": [int(x) for x in self.host_memory],
            "notes": list(self.notes),
        }

    def __str__(self) -> str:
        topo, M = self.topology, self.time.shape[1]
        # Topology.__post_init__ parses sizes given as strings into bytes
        budget = "unlimited" if topo.device_memory is None else human_bytes(cast(int, topo.device_memory))
        lines = [
            f"Sharding plan: world {topo.world_size} = {topo.replicas} replica(s) x {M} model-parallel ranks, "
            f"{topo.local_size} ranks per host"
            + (", replicas within a host" if topo.replicas_within_host and topo.replicas > 1 else "")
            + ("" if topo.host_link is None else f", {human_rate(cast(float, topo.host_link))} link between hosts"),
            f"memory: {budget} per rank (device)"
            + ("" if topo.host_memory is None else f", {human_bytes(cast(int, topo.host_memory))} per host"),
            *textwrap.wrap(
                "settings: " + ", ".join(f"{k}={v}" for k, v in self.settings.items()), 100, subsequent_indent=" " * 10
            ),
            f"estimated step time {human_ms(self.step_time_ms)} ms (slowest rank {self.slowest_rank}; "
            f"mean {human_ms(self.rank_time_ms.mean())} ms)",
            f"peak memory {human_bytes(self.memory.sum(0).max())} per rank",
            "",
        ]
        lines += _table_lines(self.tables)
        # the columns add up to the total: the collectives' fixed latency is a column of its own
        lines += [
            "",
            "per rank, ms: " + ", ".join((*TIME_PARTS, "latency")),
            "          memory: " + ", ".join(MEMORY_PARTS),
        ]
        t = self.rank_time_ms
        shown = range(M) if M <= 16 else sorted(np.argsort(-t, kind="stable")[:8].tolist())
        for r in shown:
            ms = " ".join(human_ms(1e3 * x) for x in (*self.time[:, r], self.latency_s))
            mem = " ".join(human_bytes(x) for x in self.memory[:, r])
            lines.append(f"  rank {r:>5}: {human_ms(t[r]):>9} ms = {ms}")
            lines.append(f"{'':13}{human_bytes(self.memory[:, r].sum()):>9} = {mem}")
        if M > 16:
            lines.append(
                f"  ... the {len(shown)} slowest of {M} ranks; time min/median/max "
                f"{human_ms(t.min())}/{human_ms(float(np.median(t)))}/{human_ms(t.max())} ms"
            )
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(w for line in lines for w in _fit(line, 100))


def _fit(line: str, width: int) -> list[str]:
    """``line``, wrapped at ``width`` with its continuation indented past the line's own indent."""
    if len(line) <= width:
        return [line]
    indent = " " * (len(line) - len(line.lstrip()) + 4)
    return textwrap.wrap(line, width, subsequent_indent=indent, break_on_hyphens=False) or [line[:width]]


def _table_lines(tables: list, width: int = 100) -> list[str]:
    """One row per table, the runner-up on the line below; a row too wide for ``width`` puts the name alone."""
    rows = []
    for c in tables:
        name = f"{c.module}/{c.table}" if c.module else c.table
        where = placement_label(c.sharding) + (" [host mem]" if c.offloaded else "") + (" [fixed]" if c.fixed else "")
        why = f"{c.runner_up}: {c.rejected_because}" if c.runner_up else c.rejected_because
        rows.append((name, where, human_bytes(c.memory_per_rank), human_ms(c.time_ms), why))
    name_w = min(max([5] + [len(r[0]) for r in rows]), 40)
    where_w = min(max([9] + [len(r[1]) for r in rows]), 34)
    lines = [f"{'table':<{name_w}}  {'placement':<{where_w}}  {'mem/rank':>10}  {'ms':>8}"]
    for name, where, mem, ms, why in rows:
        row = f"{name:<{name_w}}  {where:<{where_w}}  {mem:>10}  {ms:>8}"
        if len(row) > width:
            lines.append(name)
            row = f"{'':4}{where}  {mem}  {ms} ms"
        lines.append(row)
        if why:
            lines += textwrap.wrap(f"runner-up {why}", width, initial_indent=" " * 4, subsequent_indent=" " * 6)
    return lines
