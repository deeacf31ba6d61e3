"""ClickDataModule: synthetic or real Criteo clicks as Lightning train / val / test / predict loaders."""

from __future__ import annotations

import os
from typing import cast

import lightning as L

from lightning_rec.configs import EmbeddingBagConfig
from lightning_rec.data._stream import ClickStream
from lightning_rec.data.criteo import CriteoNpy, CriteoTSV, count_lines, resolve_paths
from lightning_rec.data.loader import ClickLoader
from lightning_rec.data.parquet import CriteoParquet
from lightning_rec.data.synthetic import FEATURE_NAMES, NUM_DENSE, SyntheticClicks, scaled_cardinalities

SOURCES = ("synthetic", "criteo_tsv", "criteo_npy", "criteo_parquet")
_READERS: dict[str, type[CriteoTSV | CriteoNpy | CriteoParquet]] = {
    "criteo_tsv": CriteoTSV,
    "criteo_npy": CriteoNpy,
    "criteo_parquet": CriteoParquet,
}


class ClickDataModule(L.LightningDataModule):
    """Click-through data for DLRM-style models: every loader yields :class:`~lightning_rec.data.Batch`.

    ``source="synthetic"`` streams :class:`SyntheticClicks` (splits are different rows of one hidden task; the
    train split draws fresh rows each epoch); ``"criteo_tsv"`` / ``"criteo_npy"`` / ``"criteo_parquet"`` read
    ``path`` with :class:`CriteoTSV` / :class:`CriteoNpy` / :class:`CriteoParquet`, taking
    consecutive windows of the rows: train ``[0, train_rows)``, then ``val_rows``, then ``test_rows``
    (``train_rows=None``: every row the validation and test windows leave). ``predict`` reads the test rows.

    Table sizes are ``CRITEO_CARDINALITIES`` scaled by ``size`` (or ``cardinalities``); ``num_dense``,
    ``feature_names`` and ``cardinalities`` are set in ``__init__`` so LightningCLI can link them into the
    model, and ``table_configs(dim)`` gives one table per feature.

    Sharding: each loader reads the rows of ``trainer.global_rank`` out of ``trainer.world_size`` (every
    rank of the world, also under 2D layouts, reads different rows). Every rank gets the same number of
    batches and none is empty: the rows after the last full global batch (``batch_size x world_size``
    rows) are split evenly, and fewer leftover rows than ranks join the last full global batch, so a last
    batch can hold ``batch_size + 1`` rows. ``drop_last=True`` drops those leftover rows in training only;
    validation, test and predict always see every row. DataLoader workers take a rank's batches round-robin.

    Loaders are :class:`ClickLoader` objects: ``shuffle=True`` (the default) reads the Criteo training rows as
    blocks of ``shuffle_block`` rows in an order drawn from ``(seed, epoch)``; their ``state_dict`` is saved
    in Lightning checkpoints, so a checkpoint taken mid-epoch resumes at the next batch; under a process
    group every rank agrees on each batch, so a bad line stops every rank at the same step.
    ``pin_memory`` pins batches for non-blocking copies to the GPU (worth it with ``num_workers > 0``).

    ``raw_ids=True`` yields raw categorical ids instead of ids folded into each table (the Criteo hex values
    as 64-bit integers; for ``synthetic``, ids from an unbounded space where new ids keep appearing), for a
    model with managed-collision tables (``DLRM(raw_ids=True)``, which LightningCLI links to this flag);
    ``cardinalities`` then size the tables.
    """

    def __init__(
        self,
        source: str = "synthetic",
        path: str | None = None,
        batch_size: int = 256,
        train_rows: int | None = 65536,
        val_rows: int = 16384,
        test_rows: int = 16384,
        size: float = 1e-3,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
        multi_hot: dict[str, int] | None = None,
        cardinalities: list[int] | None = None,
        drop_last: bool = False,
        min_cardinality: int = 16,
        shuffle: bool = True,
        shuffle_block: int = 65536,
        raw_ids: bool = False,
    ) -> None:
        super().__init__()
        if source not in SOURCES:
            raise ValueError(f"ClickDataModule: source must be one of {list(SOURCES)}, got {source!r}")
        if source == "synthetic":
            if train_rows is None:
                raise ValueError("ClickDataModule: source='synthetic' needs a number of train_rows")
        else:
            if not path:
                raise ValueError(f"ClickDataModule: source={source!r} needs `path` (the Criteo data)")
            if source == "criteo_npy" and not os.path.exists(path):
                raise FileNotFoundError(f"ClickDataModule: no Criteo .npz file or directory at {path!r}")
            if source in ("criteo_tsv", "criteo_parquet"):
                resolve_paths(path)  # fail now, not at the first epoch
            if multi_hot:
                raise ValueError(
                    "ClickDataModule: multi_hot applies to synthetic data only; Criteo features are one id"
                )
        for name, v in (("train_rows", train_rows), ("val_rows", val_rows), ("test_rows", test_rows)):
            if v is not None and v < 0:
                raise ValueError(f"ClickDataModule: {name} must be >= 0, got {v}")
        self.save_hyperparameters()
        self.source, self.path, self.batch_size = source, path, batch_size
        self.rows = {"train": train_rows, "val": val_rows, "test": test_rows}
        self.seed, self.num_workers, self.pin_memory = seed, num_workers, pin_memory
        self.multi_hot, self.drop_last, self.size = multi_hot, drop_last, size
        self.shuffle, self.shuffle_block = shuffle, shuffle_block
        self.raw_ids: bool = bool(raw_ids)
        self.num_dense: int = NUM_DENSE
        self.feature_names: list[str] = list(FEATURE_NAMES)
        self.cardinalities: list[int] = (
            [int(c) for c in cardinalities]
            if cardinalities is not None
            else scaled_cardinalities(size, min_cardinality)
        )
        if len(self.cardinalities) != len(self.feature_names) or min(self.cardinalities) < 1:
            raise ValueError(
                f"ClickDataModule: cardinalities must be {len(self.feature_names)} positive ints, "
                f"got {self.cardinalities}"
            )
        self._total_rows: int | None = None

    def table_configs(self, embedding_dim: int, pooling: str = "sum") -> list[EmbeddingBagConfig]:
        """One table per feature, named ``t_<feature>``, sized by ``cardinalities``."""
        return [
            EmbeddingBagConfig(
                name=f"t_{f}", num_embeddings=n, embedding_dim=embedding_dim, feature_names=[f], pooling=pooling
            )
            for f, n in zip(self.feature_names, self.cardinalities)
        ]

    def _rank(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def _window(self, split: str) -> tuple[int, int]:
        """(start, num_rows) of a split inside the Criteo rows."""
        assert self.path is not None  # __init__ requires it for the Criteo sources
        if self._total_rows is None:
            if self.source == "criteo_tsv":
                self._total_rows = sum(count_lines(p) for p in resolve_paths(self.path))
            else:
                self._total_rows = _READERS[self.source](self.path, 1, self.cardinalities, num_rows=0).num_rows_total
        # only train_rows may be None (all the Criteo rows left)
        val, test = cast(int, self.rows["val"]), cast(int, self.rows["test"])
        train = self.rows["train"] if self.rows["train"] is not None else self._total_rows - val - test
        need = train + val + test
        if train < 0 or need > self._total_rows:
            raise ValueError(
                f"ClickDataModule: {self.path!r} has {self._total_rows} rows, fewer than train_rows "
                f"+ val_rows + test_rows = {self.rows['train']} + {val} + {test}"
            )
        return {"train": (0, train), "val": (train, val), "test": (train + val, test)}[split]

    def dataset(self, split: str) -> ClickStream:
        """This rank's dataset of ``split`` (``train``, ``val``, ``test`` or ``predict``)."""
        rank, world = self._rank()
        drop_last = self.drop_last and split == "train"
        rows = "test" if split == "predict" else split
        if self.source == "synthetic":
            # __init__ refuses train_rows=None for synthetic data
            return SyntheticClicks(
                cast(int, self.rows[rows]),
                self.batch_size,
                seed=self.seed,
                rank=rank,
                world_size=world,
                multi_hot=self.multi_hot,
                drop_last=drop_last,
                split=rows,
                cardinalities=self.cardinalities,
                raw_ids=self.raw_ids,
            )
        start, n = self._window(rows)
        assert self.path is not None  # __init__ requires it for the Criteo sources
        return _READERS[self.source](
            self.path,
            self.batch_size,
            self.cardinalities,
            rank=rank,
            world_size=world,
            drop_last=drop_last,
            start=start,
            num_rows=n,
            seed=self.seed,
            shuffle=self.shuffle and split == "train",
            shuffle_block=self.shuffle_block,
            raw_ids=self.raw_ids,
        )

    def _loader(self, split: str) -> ClickLoader:
        trainer = self.trainer
        hint = (lambda: trainer.current_epoch) if split == "train" and trainer is not None else None
        return ClickLoader(
            self.dataset(split),
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            what=f"ClickDataModule {split} loader",
            epoch_hint=hint,
        )

    def train_dataloader(self) -> ClickLoader:
        return self._loader("train")

    def val_dataloader(self) -> ClickLoader:
        return self._loader("val")

    def test_dataloader(self) -> ClickLoader:
        return self._loader("test")

    def predict_dataloader(self) -> ClickLoader:
        return self._loader("predict")
