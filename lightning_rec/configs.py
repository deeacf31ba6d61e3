"""Table configurations and the enums shared by every layer (defined once, here)."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch


class PoolingType(enum.Enum):
    """How the embeddings of one bag are combined."""

    SUM = "SUM"
    MEAN = "MEAN"
    NONE = "NONE"


class ShardingType(str, enum.Enum):
    """How a table is split across the ranks of the model-parallel group.

    A member compares (and hashes) equal to its TorchRec string, so ``ps.sharding_type == "table_wise"``
    holds as it does in TorchRec. ``TABLE_COLUMN_WISE`` is TorchRec's column-wise placement kept within one
    host: column shards on the given ranks, which must all belong to one host.
    """

    DATA_PARALLEL = "data_parallel"
    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    COLUMN_WISE = "column_wise"
    TABLE_ROW_WISE = "table_row_wise"
    GRID_SHARD = "grid_shard"
    TABLE_COLUMN_WISE = "table_column_wise"


class DataType(enum.Enum):
    """Storage type of a table's weights (TorchRec's names). The lookup kernels here take FP32, FP16, BF16."""

    FP32 = "FP32"
    FP16 = "FP16"
    BF16 = "BF16"
    INT64 = "INT64"
    INT32 = "INT32"
    INT8 = "INT8"
    UINT8 = "UINT8"
    INT4 = "INT4"
    INT2 = "INT2"


_DTYPES = {torch.float32, torch.float16, torch.bfloat16}
_DATA_TYPE_TO_DTYPE = {DataType.FP32: torch.float32, DataType.FP16: torch.float16, DataType.BF16: torch.bfloat16}
_DTYPE_TO_DATA_TYPE = {v: k for k, v in _DATA_TYPE_TO_DTYPE.items()}


def data_type_to_dtype(data_type: DataType) -> torch.dtype:
    """TorchRec's helper: the torch dtype of a (floating point) ``DataType``."""
    if data_type not in _DATA_TYPE_TO_DTYPE:
        raise ValueError(f"DataType.{data_type.name} tables are not supported: use FP32, FP16 or BF16")
    return _DATA_TYPE_TO_DTYPE[data_type]


def _to_pooling(p: PoolingType | str) -> PoolingType:
    if isinstance(p, PoolingType):
        return p
    if isinstance(p, str) and p.upper() in PoolingType.__members__:
        return PoolingType[p.upper()]
    raise ValueError(f"unknown pooling {p!r}; choose one of {[m.name.lower() for m in PoolingType]}")


@dataclass
class BaseEmbeddingConfig:
    """Fields common to pooled and sequence tables.

    Fields in TorchRec's order, except ``feature_names`` before ``data_type``. ``init_fn`` (called in place on the
    full ``[num_embeddings, embedding_dim]`` weight, or on each shard when a model built on the meta device is
    sharded; an ``init_fn`` with keyword parameters ``row_offset`` and ``col_offset`` is told where that shard
    sits) wins over the uniform bounds; the default bounds are TorchRec's ``+-sqrt(1 / num_embeddings)``.
    ``feature_names`` defaults to ``[name]``. The weight type is ``data_type`` (TorchRec) or ``dtype`` (a torch
    dtype); give either.
    """

    num_embeddings: int
    embedding_dim: int
    name: str = ""
    # TorchRec puts data_type before feature_names; lightning_rec code passes feature_names 4th positionally,
    # so that order stays (TorchRec code names data_type= by keyword)
    feature_names: list[str] = field(default_factory=list)
    data_type: DataType | None = None
    weight_init_max: float | None = None
    weight_init_min: float | None = None
    num_embeddings_post_pruning: int | None = None
    init_fn: Callable[[torch.Tensor], object] | None = None
    need_pos: bool = False
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"table name must be a non-empty string, got {self.name!r}")
        for attr in ("num_embeddings", "embedding_dim"):
            v = getattr(self, attr)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"table {self.name!r}: {attr} must be a positive int, got {v!r}")
        self.feature_names = list(self.feature_names) or [self.name]
        for f in self.feature_names:
            if not isinstance(f, str):
                raise ValueError(f"table {self.name!r}: feature names must be strings, got {f!r}")
        if len(set(self.feature_names)) != len(self.feature_names):
            raise ValueError(f"table {self.name!r}: duplicate feature names in {self.feature_names}")
        if isinstance(self.dtype, str):
            self.dtype = getattr(torch, self.dtype, None)  # type: ignore[assignment]
        if isinstance(self.data_type, str) and self.data_type.upper() in DataType.__members__:
            self.data_type = DataType[self.data_type.upper()]
        if self.data_type is not None:
            if not isinstance(self.data_type, DataType):
                raise ValueError(f"table {self.name!r}: data_type must be a DataType, got {self.data_type!r}")
            if self.data_type not in _DATA_TYPE_TO_DTYPE:
                raise ValueError(
                    f"table {self.name!r}: DataType.{self.data_type.name} tables are not supported; "
                    "use FP32, FP16 or BF16"
                )
            dt = _DATA_TYPE_TO_DTYPE[self.data_type]
            if self.dtype is not None and self.dtype != dt:
                raise ValueError(f"table {self.name!r}: data_type={self.data_type} but dtype={self.dtype}")
            self.dtype = dt
        elif self.dtype is None:
            self.dtype = torch.float32
        if self.dtype not in _DTYPES:
            raise ValueError(f"table {self.name!r}: dtype must be one of float32, float16, bfloat16, got {self.dtype}")
        self.data_type = _DTYPE_TO_DATA_TYPE[self.dtype]
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
                # __post_init__ fills in the default bounds
                weight.uniform_(cast(float, self.weight_init_min), cast(float, self.weight_init_max))


@dataclass
class EmbeddingBagConfig(BaseEmbeddingConfig):
    """A pooled table: each bag of ids becomes one vector (SUM or MEAN)."""

    pooling: PoolingType | str = PoolingType.SUM

    def __post_init__(self) -> None:
        super().__post_init__()
        self.pooling = _to_pooling(self.pooling)
        if self.pooling == PoolingType.NONE:
            raise ValueError(
                f"table {self.name!r}: EmbeddingBagConfig pools with SUM or MEAN; "
                "use EmbeddingConfig for unpooled lookups"
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
