"""The base of every reader: an epoch's row order (block-shuffled), this rank's batches of it, a resume position.

An epoch is a *stream* of the source's rows: in file order, or (``shuffle=True``) as blocks of
``shuffle_block`` consecutive rows in an order drawn from ``(seed, epoch)``, so reads stay sequential. The
stream is dealt out to ranks by global batches (``lightning_rec.data._rank_rows``). A position in the stream
(rows consumed, always the end of a global batch) and the epoch are the whole state: resuming re-splits the
remaining rows over the ranks present, at the same or another world size, so no row is skipped or repeated.
The stream does not depend on the world size, batch size or number of workers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from lightning_rec.data._rank_rows import global_batch_spans, rank_batch_ranges, worker_share
from lightning_rec.data.batch import Batch, batch_from_arrays

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # dense [n, D], lengths [F, n], values, labels [n]


def concat_rows(parts: Sequence[Arrays]) -> Arrays:
    """Rows of several reads, in order (lengths and values are key-major, so values interleave per key)."""
    if len(parts) == 1:
        return parts[0]
    dense = np.concatenate([p[0] for p in parts])
    lengths = np.concatenate([p[1] for p in parts], axis=1)
    per_key = [np.split(p[2], np.cumsum(p[1].sum(1))[:-1]) for p in parts]
    values = np.concatenate([v for f in range(lengths.shape[0]) for v in (pk[f] for pk in per_key)])
    return dense, lengths, values, np.concatenate([p[3] for p in parts])


class ClickStream(torch.utils.data.IterableDataset):
    """Rows ``[0, num_rows)`` of a source as this rank's batches; subclasses implement ``read_rows``.

    Yields :class:`Batch` objects (use ``DataLoader(ds, batch_size=None)`` or :class:`ClickLoader`). ``epoch``
    and the resume position are set by :class:`ClickLoader` (``set_position``); ``len()`` is the number of
    batches of a whole epoch on this rank, the same on every rank.
    """

    num_dense: int
    feature_names: list[str]

    def _init_stream(
        self,
        num_rows: int,
        batch_size: int,
        rank: int,
        world_size: int,
        drop_last: bool,
        shuffle: bool,
        shuffle_block: int,
        seed: int,
        what: str,
    ) -> None:
        if shuffle_block < 1:
            raise ValueError(f"{what}: shuffle_block must be >= 1, got {shuffle_block}")
        self.num_rows, self.batch_size, self.rank, self.world_size = int(num_rows), int(batch_size), rank, world_size
        self.drop_last, self.shuffle, self.shuffle_block, self.seed = drop_last, shuffle, int(shuffle_block), int(seed)
        self._what = what
        self._len = len(rank_batch_ranges(self.num_rows, self.batch_size, rank, world_size, drop_last, what))
        self.epoch, self.position = 0, 0

    def read_rows(self, start: int, stop: int) -> Arrays:
        """Source rows ``[start, stop)`` as arrays (the subclass's reader)."""
        raise NotImplementedError

    def __len__(self) -> int:
        return self._len

    def set_position(self, epoch: int, position: int = 0) -> None:
        """Read ``epoch`` from stream row ``position`` on (the end of a global batch, or ``num_rows``)."""
        if not 0 <= position <= self.num_rows:
            raise ValueError(f"{self._what}: resume position {position} is outside the {self.num_rows} rows")
        self.epoch, self.position = int(epoch), int(position)

    def _remaining(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This rank's batches and the global batches (stream row ranges) left in the epoch."""
        left = self.num_rows - self.position
        if left <= 0 or (self.drop_last and left < self.batch_size * self.world_size):
            return [], []
        mine = rank_batch_ranges(left, self.batch_size, self.rank, self.world_size, self.drop_last, self._what)
        spans = global_batch_spans(left, self.batch_size, self.world_size, self.drop_last)
        p = self.position
        return [(a + p, b + p) for a, b in mine], [(a + p, b + p) for a, b in spans]

    def batches_left(self) -> int:
        """This rank's batches left in the epoch from the current position."""
        return len(self._remaining()[0])

    def position_after(self, batches: int) -> int:
        """The stream position once ``batches`` of the remaining batches are consumed (same on every rank)."""
        spans = self._remaining()[1]
        if batches == 0:
            return self.position
        return spans[batches - 1][1] if batches <= len(spans) else self.num_rows

    def epoch_done(self, position: int) -> bool:
        """Whether no batch is left after ``position``."""
        saved = self.position
        self.position = position
        try:
            return not self._remaining()[0]
        finally:
            self.position = saved

    def _block_order(self) -> np.ndarray | None:
        if not self.shuffle or self.num_rows <= self.shuffle_block:
            return None
        blocks = -(-self.num_rows // self.shuffle_block)
        return np.random.default_rng([self.seed, self.epoch, 0x5B1]).permutation(blocks)

    def source_ranges(self, start: int, stop: int, order: np.ndarray | None = None) -> list[tuple[int, int]]:
        """Source row ranges holding stream rows ``[start, stop)`` of this epoch."""
        if order is None:
            return [(start, stop)] if stop > start else []
        bs = self.shuffle_block
        sizes = np.minimum(bs, self.num_rows - order * bs)
        ends = np.cumsum(sizes)
        out, k = [], int(np.searchsorted(ends, start, side="right"))
        while start < stop:
            block_start = int(ends[k] - sizes[k])
            take = min(stop, int(ends[k])) - start
            src = int(order[k]) * bs + (start - block_start)
            out.append((src, src + take))
            start, k = start + take, k + 1
        return out

    def __iter__(self) -> Iterator[Batch]:
        order = self._block_order()
        for a, b in worker_share(self._remaining()[0]):
            parts = [self.read_rows(s, e) for s, e in self.source_ranges(a, b, order)]
            yield batch_from_arrays(*concat_rows(parts), keys=self.feature_names)

    def row_ids(self, start: int, stop: int) -> np.ndarray:
        """Source row indices of stream rows ``[start, stop)`` in this epoch (for checks and tests)."""
        order = self._block_order()
        parts = [np.arange(s, e) for s, e in self.source_ranges(start, stop, order)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def remaining_row_ids(self) -> list[np.ndarray]:
        """Source row indices of each of this rank's remaining batches (what ``iter`` would read, ignoring workers)."""
        return [self.row_ids(a, b) for a, b in self._remaining()[0]]

    def describe(self) -> dict[str, Any]:
        return {
            "num_rows": self.num_rows,
            "shuffle": self.shuffle,
            "shuffle_block": self.shuffle_block,
            "seed": self.seed,
        }
