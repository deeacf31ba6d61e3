"""lightning_rec: sharded embedding tables for PyTorch Lightning, with TorchRec's public names."""

from __future__ import annotations

import importlib as _importlib
import sys as _sys

import torch as _torch
from lightning.fabric.strategies import STRATEGY_REGISTRY as _FabricStrategyRegistry
from lightning.pytorch.strategies import StrategyRegistry as _StrategyRegistry

from lightning_rec._compat import check_versions as _check_versions
from lightning_rec._compat import fbgemm_distribution as _fbgemm_distribution

_check_versions(_torch.__version__, _fbgemm_distribution())

from lightning_rec.checkpoint import CheckpointError, DiskFullError, UnsafeCheckpointError  # noqa: E402
from lightning_rec.configs import (  # noqa: E402
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
    ShardingType,
)
from lightning_rec.distributed import (  # noqa: E402
    CommType,
    DistributedModelParallel,
    EmbeddingBagCollectionSharder,
    EmbeddingCollectionSharder,
    KeyedOptimizerWrapper,
    QCommsConfig,
    RowWiseAdagrad,
    ShardingEnv,
    TrainPipelineSparseDist,
    apply_optimizer_in_backward,
    get_qcomm_codecs_registry,
    in_backward_optimizer_filter,
)
from lightning_rec.embedding_modules import EmbeddingBagCollection, EmbeddingCollection  # noqa: E402
from lightning_rec.fused_kinds import PerTableOptimizers  # noqa: E402
from lightning_rec.lightning.fabric import RecShardedFabricStrategy  # noqa: E402
from lightning_rec.lightning.rec_module import RecModule  # noqa: E402
from lightning_rec.lightning.strategy import RecShardedStrategy  # noqa: E402
from lightning_rec.mc import (  # noqa: E402
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCallback,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
    MCHManagedCollisionModule,
)
from lightning_rec.optim import CombinedOptimizer, FusedOptimizer, FusedOptimizerSpec  # noqa: E402
from lightning_rec.quant import load_quantized, quantize_embeddings  # noqa: E402
from lightning_rec.sharding import (  # noqa: E402
    ParameterSharding,
    Planner,
    PlannerError,
    ShardingPlan,
    TableConstraint,
    Topology,
    clip_grad_norm_,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    full_state_dict,
    fused_optimizer,
    grid_shard,
    row_wise,
    shard_modules,
    table_column_wise,
    table_row_wise,
    table_wise,
    use_sparse_grads_where_possible,
)
from lightning_rec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor  # noqa: E402


def _register() -> None:
    # Lightning only scans its own modules for strategies; a plugin registers at import, once (both registries)
    RecShardedStrategy.register_strategies(_StrategyRegistry)
    RecShardedFabricStrategy.register_strategies(_FabricStrategyRegistry)


_register()

# The Lightning front end moved into lightning_rec.lightning; its old module paths stay importable (as the same
# module objects) because users' YAML class_paths and pickled checkpoints and hyper-parameters name them.
_MOVED = ("strategy", "fabric", "shard_setup", "uneven", "preemption", "child_exits", "callbacks", "rec_module")


def _alias_moved_modules() -> None:
    for name in _MOVED:
        module = _importlib.import_module(f"lightning_rec.lightning.{name}")
        _sys.modules[f"{__name__}.{name}"] = module
        globals()[name] = module  # `import lightning_rec.strategy` then `lightning_rec.strategy.X`, as before


_alias_moved_modules()

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CombinedOptimizer",
    "CommType",
    "DataType",
    "DiskFullError",
    "DistributedModelParallel",
    "EmbeddingBagCollection",
    "EmbeddingBagCollectionSharder",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingCollectionSharder",
    "EmbeddingConfig",
    "FusedOptimizer",
    "FusedOptimizerSpec",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedOptimizerWrapper",
    "KeyedTensor",
    "LFU_EvictionPolicy",
    "LRU_EvictionPolicy",
    "MCHManagedCollisionModule",
    "ManagedCollisionCallback",
    "ManagedCollisionCollection",
    "ManagedCollisionEmbeddingBagCollection",
    "ManagedCollisionEmbeddingCollection",
    "ParameterSharding",
    "PerTableOptimizers",
    "Planner",
    "PlannerError",
    "PoolingType",
    "QCommsConfig",
    "RecModule",
    "RecShardedFabricStrategy",
    "RecShardedStrategy",
    "RowWiseAdagrad",
    "ShardingEnv",
    "ShardingPlan",
    "ShardingType",
    "TableConstraint",
    "Topology",
    "TrainPipelineSparseDist",
    "UnsafeCheckpointError",
    "apply_optimizer_in_backward",
    "clip_grad_norm_",
    "column_wise",
    "construct_module_sharding_plan",
    "data_parallel",
    "full_state_dict",
    "fused_optimizer",
    "get_qcomm_codecs_registry",
    "grid_shard",
    "in_backward_optimizer_filter",
    "load_quantized",
    "quantize_embeddings",
    "row_wise",
    "shard_modules",
    "table_column_wise",
    "table_row_wise",
    "table_wise",
    "use_sparse_grads_where_possible",
]
