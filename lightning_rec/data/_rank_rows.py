"""Which rows each data-parallel rank (and each DataLoader worker) reads.

The rule (the same for every dataset here):

* Rows are dealt out by *global batch* of ``batch_size * world_size`` rows: rank ``r`` gets the
  ``r``-th run of ``batch_size`` consecutive rows of each global batch. No row is read twice, none is
  skipped.
* The rows left after the full global batches are split as evenly as possible (slices differ by at most
  one row, lower ranks get the extra rows). If fewer rows are left than there are ranks, they join the
  last full global batch instead, so a rank's last batch may hold ``batch_size + 1`` rows.
* So every rank yields the **same number of batches** and none is empty -- a sharded model needs this,
  since every rank runs every forward and backward. A split with fewer rows than ranks (but more than
  zero) is refused with an error instead of giving some rank an empty batch.
* ``drop_last=True`` drops the rows after the last full global batch on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

T = TypeVar("T")


def rank_batch_ranges(
    num_rows: int, batch_size: int, rank: int, world_size: int, drop_last: bool = False, what: str = "dataset"
) -> list[tuple[int, int]]:
    """Row ranges ``[start, stop)`` of this rank's batches, in order (see the module docstring)."""
    if batch_size <= 0:
        raise ValueError(f"{what}: batch_size must be positive, got {batch_size}")
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"{what}: rank {rank} is not in a world of {world_size} ranks")
    if num_rows < 0:
        raise ValueError(f"{what}: num_rows must be >= 0, got {num_rows}")
    gb = batch_size * world_size
    full, left = divmod(num_rows, gb)
    if drop_last or left == 0:
        return [(k * gb + rank * batch_size, k * gb + (rank + 1) * batch_size) for k in range(full)]
    if left < world_size:
        if full == 0:
            raise ValueError(
                f"{what}: {num_rows} rows cannot be split over {world_size} ranks without an empty batch; "
                f"give it at least {world_size} rows (or 0)"
            )
        full, left = full - 1, left + gb  # fold the few leftover rows into the last full global batch
    ranges = [(k * gb + rank * batch_size, k * gb + (rank + 1) * batch_size) for k in range(full)]
    base, extra = divmod(left, world_size)
    start = full * gb + rank * base + min(rank, extra)
    ranges.append((start, start + base + (rank < extra)))
    return ranges


def worker_share(items: Sequence[T]) -> Sequence[T]:
    """This DataLoader worker's items: round-robin, which is the order the DataLoader reads workers in."""
    info = torch.utils.data.get_worker_info()
    if info is None:
        return items
    return items[info.id :: info.num_workers]


def global_batch_spans(
    num_rows: int, batch_size: int, world_size: int, drop_last: bool = False
) -> list[tuple[int, int]]:
    """Row range of each global batch (the union over ranks of their k-th batch).

    Readers validate a whole global batch before yielding their slice of it, so a bad row makes every rank
    fail at the same step instead of leaving the others waiting in a collective.
    """
    if num_rows == 0 or (0 < num_rows < world_size and not drop_last):
        return []
    first = rank_batch_ranges(num_rows, batch_size, 0, world_size, drop_last)
    last = rank_batch_ranges(num_rows, batch_size, world_size - 1, world_size, drop_last)
    return [(a[0], b[1]) for a, b in zip(first, last)]
