"""Table configurations and the enums shared by every layer (defined once, here)."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


class PoolingType(enum.Enum):
    """How the embeddings of one bag are combined."""

    SUM = "SUM"
    MEAN = "MEAN"
    NONE = "NONE"


class ShardingType(enum.Enum):
    """How a table is split across the ranks of the model-parallel group."""

    DATA_PARALLEL = "data_parallel"
    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    COLUMN_WISE = "column_wise"
    TABLE_ROW_WISE = "table_row_wise"
    GRID_SHARD = "grid_shard"


_DTYPES = {torch.float32, torch.float16, torch.bfloat16}


def _to_pooling(p: PoolingType | str) -> PoolingType:
    if isinstance(p, PoolingType):
        return p
    if isinstance(p, str) and p.upper() in PoolingType.__members__:
        return PoolingType[p.upper()]
    raise ValueError(f"unknown pooling {p!r}; choose one of {[m.name.lower() for m in PoolingType]}")


@dataclass
class BaseEmbeddingConfig:
    """Fields common to pooled and sequence tables.

    ``init_fn`` (called in place on the full ``[num_embeddings, embedding_dim]`` weight, or on each
    shard when a model built on the meta device is sharded) wins over the uniform bounds; the default
    bounds are TorchRec's ``+-sqrt(1 / num_embeddings)``.
    """

    num_embeddings: int
    embedding_dim: int
    name: str = ""
    feature_names: list[str] = field(default_factory=list)
    dtype: torch.dtype = torch.float32
    weight_init_min: float | None = None
    weight_init_max: float | None = None
    init_fn: Callable[[torch.Tensor], object] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"table name must be a non-empty string, got {self.name!r}")
        for attr in ("num_embeddings", "embedding_dim"):
            v = getattr(self, attr)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"table {self.name!r}: {attr} must be a positive int, got {v!r}")
        self.feature_names = list(self.feature_names)
        if not self.feature_names:
            raise ValueError(f"table {self.name!r}: feature_names is empty; list the features that look it up")
        for f in self.feature_names:
            if not isinstance(f, str):
                raise ValueError(f"table {self.name!r}: feature names must be strings, got {f!r}")
        if len(set(self.feature_names)) != len(self.feature_names):
            raise ValueError(f"table {self.name!r}: duplicate feature names in {self.feature_names}")
        if isinstance(self.dtype, str):
            self.dtype = getattr(torch, self.dtype, None)  # type: ignore[assignment]
        if self.dtype not in _DTYPES:
            raise ValueError(f"table {self.name!r}: dtype must be one of float32, float16, bfloat16, got {self.dtype}")
        bound = math.sqrt(1.0 / self.num_embeddings)
        if self.weight_init_min is None:
            self.weight_init_min = -bound
        if self.weight_init_max is None:
            self.weight_init_max = bound
        if self.weight_init_min > self.weight_init_max:
            raise ValueError(f"table {self.name!r}: weight_init_min > weight_init_max")

    def num_features(self) -> int:
        return len(self.feature_names)

    def init_weight(self, weight: torch.Tensor) -> None:
        """Initialise a full-size weight in place."""
        with torch.no_grad():
            if self.init_fn is not None:
                self.init_fn(weight)
            else:
                weight.uniform_(self.weight_init_min, self.weight_init_max)


@dataclass
class EmbeddingBagConfig(BaseEmbeddingConfig):
    """A pooled table: each bag of ids becomes one vector (SUM or MEAN)."""

    pooling: PoolingType | str = PoolingType.SUM

    def __post_init__(self) -> None:
        super().__post_init__()
        self.pooling = _to_pooling(self.pooling)
        if self.pooling == PoolingType.NONE:
            raise ValueError(
                f"table {self.name!r}: EmbeddingBagConfig pools with SUM or MEAN; use EmbeddingConfig for unpooled lookups"
            )


@dataclass
class EmbeddingConfig(BaseEmbeddingConfig):
    """A sequence table: every id gets its own vector."""

    pooling: PoolingType | str = PoolingType.NONE

    def __post_init__(self) -> None:
        super().__post_init__()
        self.pooling = _to_pooling(self.pooling)
        if self.pooling != PoolingType.NONE:
            raise ValueError(f"table {self.name!r}: EmbeddingConfig does not pool; use EmbeddingBagConfig")
