"""What the planner reads: the tables of a model (unsharded or already sharded collections) or of a list of
configs, checked as a collection checks them, and what the cost model needs of each."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

from torch import nn

from lightning_rec.configs import BaseEmbeddingConfig, EmbeddingBagConfig, EmbeddingConfig, PoolingType
from lightning_rec.embedding_modules import EmbeddingBagCollection, EmbeddingCollection, check_tables
from lightning_rec.plans.planner.cost import OPTIMIZER_STATE, TableStats
from lightning_rec.plans.planner.topology import Topology

if TYPE_CHECKING:
    from lightning_rec.plans.planner.speeds import TableSpeeds
from lightning_rec.plans.shard_geometry import ShardMeta


@runtime_checkable
class PlacedCollection(Protocol):
    """What the planner reads of an already-sharded collection (``ShardedCollection``'s public accessors).

    Matched structurally so the planner needs nothing from ``sharded.py``, which calls the planner.
    """

    tables: list[BaseEmbeddingConfig]
    shards: Mapping[str, list | None]
    is_fused: bool
    sparse_grad: bool


_INT64_MAX = 2**63 - 1


def _collections(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(p, m) for p, m in model.named_modules() if type(m) in (EmbeddingBagCollection, EmbeddingCollection)]


def _configs_of(m: EmbeddingBagCollection | EmbeddingCollection) -> list:
    # the bag collection has embedding_bag_configs, the other embedding_configs
    return m.embedding_bag_configs() if hasattr(m, "embedding_bag_configs") else m.embedding_configs()  # type: ignore[operator]


def plan_entries(
    model_or_tables: nn.Module | Sequence[BaseEmbeddingConfig], gradients: str | None
) -> list[tuple[str, BaseEmbeddingConfig, str, list[ShardMeta] | None]]:
    """(module path, config, gradients, sharded placement or None) for every table to plan or estimate."""
    if isinstance(model_or_tables, nn.Module):
        out = []
        unsharded = {id(m) for _, m in _collections(model_or_tables)}
        for path, m in model_or_tables.named_modules():
            sharded = isinstance(m, PlacedCollection)
            if not sharded and id(m) not in unsharded:
                continue
            # a collection whose only fused tables are data-parallel is fused too
            fused = sharded and m.is_fused
            grads = gradients or ("fused" if fused else "sparse" if m.sparse_grad else "dense")
            tables = m.tables if sharded else _configs_of(m)
            out += [(path, t, grads, m.shards[t.name] if sharded else None) for t in tables]
        return out
    tables = list(model_or_tables)
    for t in tables:
        if not isinstance(t, BaseEmbeddingConfig):
            raise TypeError(f"expected embedding table configs or a model, got {type(t).__name__}")
    check_tables(tables)
    return [("", t, gradients or "dense", None) for t in tables]


def table_stats(
    path: str,
    t: BaseEmbeddingConfig,
    grads: str,
    topology: Topology,
    optimizer: str,
    pooling_factors: Mapping[str, float],
    default_pooling_factor: float,
    speeds: TableSpeeds | None = None,
) -> TableStats:
    """What the cost model needs of table ``t`` (its ids per sample, wire width, optimizer state, speeds: the
    topology's, or those ``speeds`` give the table)."""
    for attr in ("num_embeddings", "embedding_dim"):
        if getattr(t, attr) > _INT64_MAX:  # no tensor can have that many rows or columns
            raise ValueError(
                f"table {t.name!r}: {attr}={getattr(t, attr)} is larger than the largest tensor size, 2**63 - 1"
            )
    ids = sum(pooling_factors.get(f, default_pooling_factor) for f in t.feature_names)
    backend = topology.backend or ("nccl" if topology.device == "cuda" else "gloo")
    # gloo carries bfloat16 as float32 (comm._wire_dtype); pooled outputs are at least the table's width
    assert t.dtype is not None  # resolved by the config's __post_init__
    wire = 4 if backend == "gloo" and t.dtype.itemsize < 4 else t.dtype.itemsize
    pooling = cast("EmbeddingBagConfig | EmbeddingConfig", t).pooling  # every table is one of the two
    hw = topology.hardware
    assert hw is not None  # resolved by Topology.__post_init__
    lookup, update = hw.lookup_bandwidth, hw.update_bandwidth
    if speeds is not None:
        lookup, update = speeds.table_speeds(t, float(ids), grads, hw)
    # a table in host memory is looked up as much slower than in device memory as the topology says, and never
    # faster than in device memory where the topology says so (the search relies on it)
    host = hw.host_lookup_bandwidth * (lookup / hw.lookup_bandwidth)
    if hw.host_lookup_bandwidth <= hw.lookup_bandwidth:
        host = min(host, lookup)
    return TableStats(
        path,
        t,
        t.num_embeddings,
        t.embedding_dim,
        t.dtype.itemsize,
        wire,
        len(t.feature_names),
        float(ids),
        pooling != PoolingType.NONE,
        grads,
        OPTIMIZER_STATE[optimizer],
        lookup,
        host,
        update,
    )
