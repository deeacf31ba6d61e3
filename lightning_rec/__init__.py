"""lightning_rec: sharded embedding tables for PyTorch Lightning, with TorchRec's public names."""

from __future__ import annotations

import torch as _torch

from lightning_rec._compat import check_versions as _check_versions, fbgemm_distribution as _fbgemm_distribution

_check_versions(_torch.__version__, _fbgemm_distribution())

from lightning_rec.configs import (  # noqa: E402
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
    ShardingType,
)
from lightning_rec.modules import EmbeddingBagCollection, EmbeddingCollection  # noqa: E402
from lightning_rec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "PoolingType",
    "ShardingType",
]
