"""Sharding plans and sharded embedding collections."""

from lightning_rec.configs import ShardingType
from lightning_rec.pipeline.clip_grad_norm import clip_grad_norm_
from lightning_rec.pipeline.shard_modules import (
    ShardedCollection,
    ShardedEmbeddingBagCollection,
    ShardedEmbeddingCollection,
    full_state_dict,
    fused_optimizer,
    shard_modules,
    sharded_collections,
    use_sparse_grads_where_possible,
)
from lightning_rec.plans.kinds import EnumerableShardingSpec, ShardMetadata, ShardPlacement
from lightning_rec.plans.plan import (
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    grid_shard,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from lightning_rec.plans.planner import Hardware, Planner, PlannerError, PlanReport, TableConstraint, Topology

__all__ = [
    "EmbeddingModuleShardingPlan",
    "EnumerableShardingSpec",
    "Hardware",
    "ParameterSharding",
    "PlanReport",
    "Planner",
    "PlannerError",
    "ShardMetadata",
    "ShardPlacement",
    "ShardedCollection",
    "ShardedEmbeddingBagCollection",
    "ShardedEmbeddingCollection",
    "ShardingPlan",
    "ShardingType",
    "TableConstraint",
    "Topology",
    "clip_grad_norm_",
    "column_wise",
    "construct_module_sharding_plan",
    "data_parallel",
    "full_state_dict",
    "fused_optimizer",
    "grid_shard",
    "row_wise",
    "shard_modules",
    "sharded_collections",
    "table_column_wise",
    "table_row_wise",
    "table_wise",
    "use_sparse_grads_where_possible",
]
