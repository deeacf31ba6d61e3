"""What the planner refuses, and why: inputs that name nothing, fused tables no placement can hold, tables that
cannot fit in the group's memory, and the messages for a unit without a placement or without room.

Each check runs before or beside the search (``search.py``) and raises :class:`PlannerError` (or ``ValueError``
for misnamed inputs) with the fix in the message; none changes what the search chooses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

from lightning_rec.configs import ShardingType
from lightning_rec.kernels import fused_width_problem
from lightning_rec.plans.kinds import ParameterSharding
from lightning_rec.plans.plan import resolve_table
from lightning_rec.plans.planner.candidates import Candidate
from lightning_rec.plans.planner.cost import OPTIMIZER_STATE, Load, TableStats
from lightning_rec.plans.planner.report import placement_label
from lightning_rec.plans.planner.topology import PlannerError, TableConstraint, Topology, human_bytes


def check_names(
    stats: list[TableStats],
    pooling_factors: Mapping[str, float],
    constraints: Mapping[str, TableConstraint],
    together: Sequence[Sequence[str]],
) -> None:
    """Every feature and table the planner's arguments name exists in the model."""
    features = {f for s in stats for f in s.config.feature_names}
    unknown = sorted(f for f in pooling_factors if f not in features)
    if unknown:
        raise ValueError(f"pooling_factors name features {unknown} that no table has; features: {sorted(features)}")
    names = {s.config.name for s in stats}
    grouped = [n for g in together for n in g]
    for what, keys in (("constraints", list(constraints)), ("together", grouped)):
        bad = sorted({k for k in keys if k not in names})
        if bad:
            raise ValueError(f"{what} name tables {bad} that are not in the model; tables: {sorted(names)}")


def check_fused(stats: list[TableStats]) -> None:
    """Refuse, as sharding would, fused tables that no placement can hold, before searching for one."""
    for s in stats:
        if s.grads == "fused":
            problem = fused_width_problem(s.config.name, s.dim, [s.dim])
            if problem:
                raise PlannerError(f"{problem}. No sharding plan can hold it with a fused optimizer")


def check_fixed(topology: Topology, optimizer: str, s: TableStats, ps: ParameterSharding) -> None:
    """A fixed placement of a fused table that sharding would refuse is an error here already."""
    assert topology.model_parallel_size is not None and topology.local_size is not None  # resolved by Topology
    shards = resolve_table(s.config, ps, topology.model_parallel_size, topology.local_size)
    if s.grads != "fused" or shards is None:
        return
    widths = [m.cols for m in shards if m.rows > 0]
    where = f"the constraint's placement {placement_label(ps)}: "
    problem = fused_width_problem(s.config.name, s.dim, widths)
    if problem:
        raise PlannerError(where + problem)
    if OPTIMIZER_STATE[optimizer][1] and any(w != s.dim for w in widths):
        raise PlannerError(
            f"{where}table {s.config.name!r}: the fused {optimizer!r} optimizer keeps one "
            "statistic per row, which a column split would compute per column shard; give it a "
            "placement that keeps whole rows, or use an element-wise optimizer (sgd, adagrad)"
        )


def check_total(topology: Topology, stats: list[TableStats], needs: list[tuple[float, list[int]]], fixed: Load) -> None:
    """The units' least memory (``needs``: each unit's table-wise size) plus the fixed placements' fits in the
    group's device and host memory taken together; else no search can succeed."""
    if topology.device_memory is None:
        return
    M = topology.model_parallel_size
    assert M is not None  # resolved by Topology.__post_init__, which also parses sizes given as strings
    capacity = M * cast(int, topology.device_memory) + (
        0 if topology.host_memory is None else topology.num_hosts * cast(int, topology.host_memory)
    )
    need = sum(n for n, _ in needs) + float(fixed.mem.sum())
    if need > capacity:
        big = sorted(needs, key=lambda x: -x[0])[:5]
        names = ", ".join(f"{stats[u[0]].label!r}{'+' if len(u) > 1 else ''} {human_bytes(n)}" for n, u in big)
        raise PlannerError(
            f"the tables need at least {human_bytes(need)} "
            "(weights, optimizer state, gradients and lookup buffers) "
            f"but the {M} model-parallel ranks have {human_bytes(capacity)}: {human_bytes(need - capacity)} "
            "missing. "
            f"Largest: {names}. "
            "Add ranks or memory, lower the batch size, use a smaller optimizer state (rowwise_adagrad) or "
            "fused/sparse gradients"
        )


def no_candidate(
    topology: Topology, min_column_width: int, stats: list[TableStats], unit: list[int], allowed: list[ShardingType]
) -> str:
    """Why the allowed sharding types propose no placement of the unit on this layout."""
    names = [stats[i].label for i in unit]
    why = []
    if {ShardingType.TABLE_ROW_WISE, ShardingType.GRID_SHARD} & set(allowed):
        why.append(
            f"table_row_wise and grid_shard split rows over the ranks of one host and need several hosts "
            f"of several ranks (this layout: {topology.num_hosts} host(s) x {topology.local_size} rank(s); set "
            "local_size)"
        )
    if {ShardingType.COLUMN_WISE, ShardingType.GRID_SHARD} & set(allowed):
        dims = sorted({stats[i].dim for i in unit})
        why.append(
            f"column_wise and grid_shard need embedding_dim {dims} split into at least 2 shards of "
            f">= min_column_width={min_column_width} columns"
        )
    return (
        f"table{'s' if len(unit) > 1 else ''} {names}: no placement of the allowed sharding types "
        f"{[a.value for a in allowed]} exists here: " + "; ".join(why) + ". Allow another sharding type for it"
    )


def no_fit(
    topology: Topology, stats: list[TableStats], unit: list[int], cands: list[Candidate], total: Load, placed: int
) -> str:
    """Why none of the unit's placements fits after ``placed`` tables, naming its least demanding one."""
    used, M = total.mem.sum(0), topology.model_parallel_size
    # scored candidates carry terms; M is resolved by Topology.__post_init__
    best = min(cands, key=lambda c: (c.terms.mem_on(M) + used).max())  # type: ignore[union-attr, arg-type]
    names = [stats[i].label for i in unit]
    need = (best.terms.mem_on(M) + used).max()  # type: ignore[union-attr, arg-type]
    missing = need - topology.device_memory  # type: ignore[operator]
    return (
        f"no placement of table{'s' if len(unit) > 1 else ''} {names} fits in device memory after {placed} other "
        f"tables were placed: its least demanding placement, {placement_label(best.sharding)}, {best.short}; "
        f"about {human_bytes(max(missing, 0))} missing on the fullest rank. Add ranks or memory, allow more "
        "sharding types for it, or lower the batch size"
    )
