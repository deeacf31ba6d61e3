"""The planner the sharding entry points use when no plan is given (``shard_modules``, the strategies), and
the 2D arrangement it estimates faster (:func:`choose_arrangement`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from torch import nn

from lightning_rec.configs import BaseEmbeddingConfig
from lightning_rec.fused_kinds import FusedOptimizerSpec, as_spec
from lightning_rec.plans.mesh import group_local_size
from lightning_rec.plans.planner.search import Planner
from lightning_rec.plans.planner.topology import Topology


def automatic_plan(
    model: nn.Module | Sequence[BaseEmbeddingConfig],
    group_size: int,
    local_size: int | None = None,
    world_size: int | None = None,
    embedding_optimizer: FusedOptimizerSpec | Mapping[str, Any] | None = None,
    table_optimizers: Mapping[str, Mapping[str, FusedOptimizerSpec | None]] | None = None,
    **planner_kwargs: Any,
) -> Planner:
    """The planner ``shard_modules`` and the strategy use when no plan is given; call ``.plan(model)`` on it.

    ``embedding_optimizer`` (a fused spec or dict) sets the optimizer state size and fused gradients;
    ``table_optimizers`` (``{collection path: {table: spec or None}}``) sets them per fused table instead;
    other keywords go to :class:`Planner` (``topology`` fields are built from the sizes here).
    """
    topo_kw = {
        k: planner_kwargs.pop(k)
        for k in ("device_memory", "host_memory", "device", "backend", "hardware", "host_link", "replicas_within_host")
        if k in planner_kwargs
    }
    topo = Topology(world_size or group_size, group_size, local_size, **topo_kw)
    fused = {t: s for per in (table_optimizers or {}).values() for t, s in per.items() if s is not None}
    if fused:
        planner_kwargs.setdefault("optimizer", {t: s.kind for t, s in fused.items()})
        planner_kwargs.setdefault("gradients", dict.fromkeys(fused, "fused"))
    spec = as_spec(embedding_optimizer)
    if spec is not None and not fused:
        planner_kwargs.setdefault("optimizer", spec.kind)
        planner_kwargs.setdefault("gradients", "fused")
    return Planner(topo, **planner_kwargs)


class Arrangement(NamedTuple):
    """The 2D arrangement :func:`choose_arrangement` picked, its planner (plan made), and both estimates."""

    replicas_within_host: bool
    local_size: int  # ranks of a model-parallel group per host, in that arrangement
    planner: Planner
    step_ms: dict[bool, float]  # estimated step time, by replicas_within_host


def choose_arrangement(
    model: nn.Module | Sequence[BaseEmbeddingConfig],
    group_size: int,
    world_size: int,
    ranks_per_host: int,
    **kwargs: Any,
) -> Arrangement:
    """Plan ``model`` for both 2D arrangements (``plans/mesh.py``) and keep the one with the lower estimated
    step time (model parallel within a host on a tie, or where the other cannot be built: one replica, one
    host, or a host that cannot hold whole replica groups). ``kwargs`` go to :func:`automatic_plan`; pure
    arithmetic on the configs, so every rank reaches the same answer without a collective."""
    replicas = world_size // group_size
    options = [False]
    if replicas > 1 and world_size > ranks_per_host and ranks_per_host % replicas == 0:
        options.append(True)
    found: dict[bool, tuple[int, Planner]] = {}
    step_ms: dict[bool, float] = {}
    for within in options:
        local = group_local_size(ranks_per_host, replicas, group_size, within)
        kw = dict(kwargs, replicas_within_host=within)
        planner = automatic_plan(model, group_size, local, world_size, **kw)
        planner.plan(model)
        found[within] = (local, planner)
        step_ms[within] = planner.explain().step_time_ms
    best = min(options, key=lambda w: (step_ms[w], w))
    return Arrangement(best, found[best][0], found[best][1], step_ms)
