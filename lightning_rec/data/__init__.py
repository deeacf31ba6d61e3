"""Click-log data for recommendation models: synthetic Criteo-shaped clicks, Criteo readers (TSV, Parquet,
npy), a stateful loader and a DataModule.

Every loader yields :class:`Batch` ``(dense, sparse: KeyedJaggedTensor, labels)`` and shards rows over
data-parallel ranks with the same number of batches per rank, no overlap and no loss (see
:class:`ClickDataModule` for the rule on the last partial batch). :class:`ClickLoader` keeps the epoch and
the position in it (``state_dict``), so Lightning checkpoints resume mid-epoch at the next batch, and makes
the ranks agree on every batch, so a bad line or a short rank stops every rank at the same step.
"""

from lightning_rec.data._rank_rows import rank_batch_ranges
from lightning_rec.data._stream import ClickStream
from lightning_rec.data.batch import Batch, batch_from_arrays, collate
from lightning_rec.data.criteo import CriteoNpy, CriteoTSV
from lightning_rec.data.datamodule import ClickDataModule
from lightning_rec.data.loader import AgreedLoader, ClickLoader
from lightning_rec.data.parquet import CriteoParquet
from lightning_rec.data.random_rec import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES, RandomRecDataset
from lightning_rec.data.synthetic import (
    CRITEO_CARDINALITIES,
    DEFAULT_MULTI_HOT,
    FEATURE_NAMES,
    NUM_DENSE,
    SyntheticClicks,
    binary_auc,
    scaled_cardinalities,
)

__all__ = [
    "CRITEO_CARDINALITIES",
    "DEFAULT_CAT_NAMES",
    "DEFAULT_INT_NAMES",
    "DEFAULT_MULTI_HOT",
    "FEATURE_NAMES",
    "NUM_DENSE",
    "AgreedLoader",
    "Batch",
    "ClickDataModule",
    "ClickLoader",
    "ClickStream",
    "CriteoNpy",
    "CriteoParquet",
    "CriteoTSV",
    "RandomRecDataset",
    "SyntheticClicks",
    "batch_from_arrays",
    "binary_auc",
    "collate",
    "rank_batch_ranges",
    "scaled_cardinalities",
]
