"""TorchRec's distributed training API for loops without Lightning: DistributedModelParallel, sharders,
in-backward and keyed optimizers, and the training-loop helper."""

from lightning_rec.distributed.model_parallel import (
    DistributedModelParallel,
    EmbeddingBagCollectionSharder,
    EmbeddingCollectionSharder,
    ModuleSharder,
    ShardingEnv,
    get_default_sharders,
    get_module_to_default_sharders,
)
from lightning_rec.distributed.optimizers import (
    KeyedOptimizerWrapper,
    RowWiseAdagrad,
    apply_optimizer_in_backward,
    in_backward_optimizer_filter,
    spec_from_fused_params,
    spec_from_optimizer,
)
from lightning_rec.distributed.train_pipeline import TrainPipelineSparseDist

__all__ = [
    "DistributedModelParallel",
    "EmbeddingBagCollectionSharder",
    "EmbeddingCollectionSharder",
    "KeyedOptimizerWrapper",
    "ModuleSharder",
    "RowWiseAdagrad",
    "ShardingEnv",
    "TrainPipelineSparseDist",
    "apply_optimizer_in_backward",
    "get_default_sharders",
    "get_module_to_default_sharders",
    "in_backward_optimizer_filter",
    "spec_from_fused_params",
    "spec_from_optimizer",
]
