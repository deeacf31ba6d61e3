"""The batch every dataloader of ``lightning_rec.data`` yields, and the collate that builds it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from lightning_rec.sparse import KeyedJaggedTensor


@dataclass(init=False)
class Batch:
    """One batch of click rows.

    Attributes:
        dense: float32 ``[B, num_dense]`` (also readable as ``dense_features``, TorchRec's name).
        sparse: KeyedJaggedTensor with one key per categorical feature (key-major, lengths ``[F * B]``; also
            ``sparse_features``).
        labels: ``[B]`` holding 0 / 1 (float32 from this package's loaders; TorchRec's random data uses ints).

    Built as ``Batch(dense, sparse, labels)`` or with TorchRec's names
    ``Batch(dense_features=, sparse_features=, labels=)``.
    """

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor

    def __init__(
        self,
        dense: torch.Tensor | None = None,
        sparse: KeyedJaggedTensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        dense_features: torch.Tensor | None = None,
        sparse_features: KeyedJaggedTensor | None = None,
    ) -> None:
        for ours, theirs, a, b in (
            ("dense", "dense_features", dense, dense_features),
            ("sparse", "sparse_features", sparse, sparse_features),
        ):
            if a is not None and b is not None:
                raise TypeError(f"Batch: give {ours}= or {theirs}=, not both")
            if a is None and b is None:
                raise TypeError(f"Batch: missing {ours}= (or TorchRec's {theirs}=)")
        if labels is None:
            raise TypeError("Batch: missing labels=")
        # the loop above checked that one of each pair is given
        self.dense = cast(torch.Tensor, dense if dense is not None else dense_features)
        self.sparse = cast(KeyedJaggedTensor, sparse if sparse is not None else sparse_features)
        self.labels = labels
        self.__post_init__()

    @property
    def dense_features(self) -> torch.Tensor:
        """TorchRec's name of :attr:`dense`."""
        return self.dense

    @property
    def sparse_features(self) -> KeyedJaggedTensor:
        """TorchRec's name of :attr:`sparse`."""
        return self.sparse

    def __post_init__(self) -> None:
        b = self.labels.size(0)
        if self.dense.dim() != 2 or self.dense.size(0) != b or self.sparse.stride() != b:
            raise ValueError(
                f"Batch: dense {tuple(self.dense.shape)}, sparse batch size {self.sparse.stride()} and "
                f"labels {tuple(self.labels.shape)} must all have the same batch size"
            )

    def to(self, device: torch.device | str, non_blocking: bool | None = None) -> Batch:
        """The batch on ``device``. ``non_blocking=None``: asynchronous when copying a pinned batch (a loader
        with ``pin_memory=True``) to CUDA, so the copy overlaps work already queued on the GPU. Lightning moves
        batches with ``batch.to(device)``: this default is what makes its copies non-blocking."""
        if non_blocking is None:
            non_blocking = torch.device(device).type == "cuda" and torch.cuda.is_available() and self.labels.is_pinned()
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            # KeyedJaggedTensor.to takes a str too; TorchScript limits its annotation to torch.device
            self.sparse.to(device, non_blocking=non_blocking),  # type: ignore[arg-type]
            self.labels.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> Batch:
        # called by DataLoader(pin_memory=True) in its pinning thread
        return Batch(self.dense.pin_memory(), self.sparse.pin_memory(), self.labels.pin_memory())

    def __len__(self) -> int:
        return self.labels.size(0)


def batch_from_arrays(
    dense: np.ndarray, lengths: np.ndarray, values: np.ndarray, labels: np.ndarray, keys: Sequence[str]
) -> Batch:
    """Wrap numpy arrays (dense ``[B, D]``, key-major ``lengths [F, B]`` and ``values``, ``labels [B]``)."""
    return Batch(
        dense=torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)),
        sparse=KeyedJaggedTensor(
            list(keys),
            torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)),
            lengths=torch.from_numpy(np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1)),
        ),
        labels=torch.from_numpy(np.ascontiguousarray(labels, dtype=np.float32)),
    )


def collate(
    samples: Sequence[tuple[Sequence[float], Mapping[str, Sequence[int]], float]], keys: Sequence[str]
) -> Batch:
    """Collate per-row samples ``(dense, {feature: ids}, label)`` of a map-style dataset into a Batch.

    Use it as ``DataLoader(ds, batch_size=..., collate_fn=functools.partial(collate, keys=names))``.
    A feature missing from a sample's dict is an empty bag.
    """
    keys = list(keys)
    if not samples:
        raise ValueError("collate: got no samples")
    dense = np.asarray([np.asarray(s[0], dtype=np.float32) for s in samples], dtype=np.float32)
    bags = [[np.asarray(s[1].get(k, ()), dtype=np.int64).reshape(-1) for s in samples] for k in keys]
    lengths = np.asarray([[b.size for b in row] for row in bags], dtype=np.int64).reshape(len(keys), len(samples))
    flat = [b for row in bags for b in row]
    values = np.concatenate(flat) if flat else np.zeros(0, dtype=np.int64)
    labels = np.asarray([float(s[2]) for s in samples], dtype=np.float32)
    return batch_from_arrays(dense, lengths, values, labels, keys)
