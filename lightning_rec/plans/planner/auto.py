"""The planner the sharding entry points use when no plan is given (``shard_modules``, the strategies)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from lightning_rec.configs import BaseEmbeddingConfig
from lightning_rec.fused_kinds import FusedOptimizerSpec, as_spec
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
        for k in ("device_memory", "host_memory", "device", "backend", "hardware", "host_link")
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
