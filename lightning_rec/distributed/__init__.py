"""TorchRec's distributed training API for loops without Lightning: DistributedModelParallel, sharders,
in-backward and keyed optimizers, the training-loop helper, and quantized comms (``QCommsConfig``)."""

from lightning_rec.distributed.model_parallel import (
    DefaultDataParallelWrapper,
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

# TorchRec's torchrec.distributed.fbgemm_qcomm_codec
from lightning_rec.pipeline.output_dist import (
    CommOp,
    CommType,
    QCommsConfig,
    QuantizedCommCodecs,
    get_qcomm_codecs_registry,
)

__all__ = [
    "CommOp",
    "CommType",
    "DefaultDataParallelWrapper",
    "DistributedModelParallel",
    "EmbeddingBagCollectionSharder",
    "EmbeddingCollectionSharder",
    "KeyedOptimizerWrapper",
    "ModuleSharder",
    "QCommsConfig",
    "QuantizedCommCodecs",
    "RowWiseAdagrad",
    "ShardingEnv",
    "TrainPipelineSparseDist",
    "apply_optimizer_in_backward",
    "get_default_sharders",
    "get_module_to_default_sharders",
    "get_qcomm_codecs_registry",
    "in_backward_optimizer_filter",
    "spec_from_fused_params",
    "spec_from_optimizer",
]
