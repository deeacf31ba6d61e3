"""TorchRec's random recommendation data (``torchrec.datasets.random``) and Criteo's default column names."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from torch.utils.data import IterableDataset

from lightning_rec.data.batch import Batch
from lightning_rec.data.synthetic import CRITEO_CARDINALITIES, NUM_DENSE
from lightning_rec.sparse import KeyedJaggedTensor

#: Criteo's dense (integer) and categorical column names, as TorchRec names them
DEFAULT_INT_NAMES: list[str] = [f"int_{i}" for i in range(NUM_DENSE)]
DEFAULT_CAT_NAMES: list[str] = [f"cat_{i}" for i in range(len(CRITEO_CARDINALITIES))]


def _per_key(name: str, one: int | None, many: list[int] | None, default: int, keys: list[str]) -> list[int]:
    out = list(many) if many is not None else [one if one else default] * len(keys)
    if len(out) != len(keys):
        raise ValueError(f"RandomRecDataset: {name} has {len(out)} entries for {len(keys)} keys")
    return out


class RandomRecDataset(IterableDataset):
    """Random batches of :class:`Batch` (TorchRec's ``RandomRecDataset``, same arguments and defaults).

    Each of ``num_generated_batches`` batches is drawn once (from ``manual_seed`` when given) and then cycled;
    a negative ``num_generated_batches`` draws every batch afresh. Per sample and key, the bag holds between
    ``min_ids_per_feature`` (default: ``ids_per_feature`` when given, else 0) and ``ids_per_feature`` (default
    2) ids below ``hash_size`` (default 100); dense features are standard normal, labels 0 / 1 integers.
    ``num_batches=None`` iterates forever.
    """

    def __init__(
        self,
        keys: list[str],
        batch_size: int,
        hash_size: int | None = None,
        hash_sizes: list[int] | None = None,
        ids_per_feature: int | None = None,
        ids_per_features: list[int] | None = None,
        num_dense: int = 50,
        manual_seed: int | None = None,
        num_batches: int | None = None,
        num_generated_batches: int = 10,
        min_ids_per_feature: int | None = None,
        min_ids_per_features: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.keys = list(keys)
        if batch_size <= 0:
            raise ValueError(f"RandomRecDataset: batch_size must be positive, got {batch_size}")
        self.batch_size = batch_size
        self.hash_sizes = _per_key("hash_sizes", hash_size, hash_sizes, 100, self.keys)
        self.max_ids = _per_key("ids_per_features", ids_per_feature, ids_per_features, 2, self.keys)
        low = min_ids_per_feature if min_ids_per_feature is not None else ids_per_feature
        self.min_ids = _per_key("min_ids_per_features", low, min_ids_per_features, 0, self.keys)
        for k, lo, hi, h in zip(self.keys, self.min_ids, self.max_ids, self.hash_sizes):
            if not 0 <= lo <= hi or h <= 0:
                raise ValueError(
                    f"RandomRecDataset: key {k!r} needs 0 <= min ids ({lo}) <= ids ({hi}) and a "
                    f"positive hash size ({h})"
                )
        self.num_dense = num_dense
        self.num_batches = num_batches
        self._generator = None
        if manual_seed is not None:
            self._generator = torch.Generator().manual_seed(manual_seed)
        self._cached = [self._draw() for _ in range(max(num_generated_batches, 0))]
        self._fresh = num_generated_batches < 0

    def _draw(self) -> Batch:
        g, b = self._generator, self.batch_size
        lengths, values = [], []
        for lo, hi, h in zip(self.min_ids, self.max_ids, self.hash_sizes):
            n = torch.randint(lo, hi + 1, (b,), dtype=torch.int32, generator=g)
            lengths.append(n)
            values.append(torch.randint(0, h, (int(n.sum()),), generator=g))
        sparse = KeyedJaggedTensor(self.keys, torch.cat(values), lengths=torch.cat(lengths))
        dense = torch.randn(b, self.num_dense, generator=g)
        labels = torch.randint(0, 2, (b,), generator=g)
        return Batch(dense_features=dense, sparse_features=sparse, labels=labels)

    def _batches(self) -> Iterator[Batch]:
        if self._fresh:
            while True:
                yield self._draw()
        if not self._cached:
            return
        yield from itertools.cycle(self._cached)

    def __iter__(self) -> Iterator[Batch]:
        return itertools.islice(self._batches(), self.num_batches)

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("RandomRecDataset(num_batches=None) is endless and has no length")
        return self.num_batches
