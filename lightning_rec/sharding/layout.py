"""Pure shard-size and offset math: the one source for bucketing, local shapes and checkpoint metadata.

Ranks here are ranks of the model-parallel (shard) group, never global ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ShardMeta:
    """One rectangular piece of a table: rows ``[row_offset, row_offset + rows)``, columns likewise."""

    row_offset: int
    rows: int
    col_offset: int
    cols: int
    rank: int


def even_blocks(total: int, parts: int) -> np.ndarray:
    """:func:`even_split` as an int64 array (what the planner's vectorized cost model needs)."""
    block = -(-total // parts)
    return np.clip(total - np.arange(parts, dtype=np.int64) * block, 0, block)


def even_split(total: int, parts: int) -> list[int]:
    """Sizes of ``torch.chunk``-style blocks: ``ceil(total / parts)`` each, the tail short or empty.

    >>> even_split(10, 4), even_split(5, 4)
    ([3, 3, 3, 1], [2, 2, 1, 0])
    """
    return even_blocks(total, parts).tolist()


def offsets_of(sizes: list[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def host_ranks(host_index: int, local_size: int) -> list[int]:
    return list(range(host_index * local_size, (host_index + 1) * local_size))


@dataclass(frozen=True, eq=False)
class Tiling:
    """A table cut into rectangles, as arrays with one entry per shard (column block major).

    Column block ``c`` (``col_sizes[c]`` wide) is split into row blocks, one per rank of ``ranks[c]``.
    The planner's cost model reads the arrays; :meth:`shards` gives the ``ShardMeta`` list the sharded
    modules and checkpoints use, so both see the same tiling.
    """

    rank: np.ndarray
    rows: np.ndarray
    cols: np.ndarray
    row_offset: np.ndarray
    col_offset: np.ndarray
    col_blocks: int

    @staticmethod
    def blocks(row_sizes: Sequence[Sequence[int]] | np.ndarray, col_sizes: Sequence[int],
               ranks: Sequence[Sequence[int]] | np.ndarray) -> Tiling:
        """Column block ``c`` split into row blocks ``row_sizes[c]`` on ``ranks[c]`` (equal lengths per block)."""
        rows = [np.asarray(r, dtype=np.int64) for r in row_sizes]
        owners = [np.asarray(r, dtype=np.int64) for r in ranks]
        widths = np.asarray(col_sizes, dtype=np.int64)
        col_starts = np.concatenate(([0], np.cumsum(widths)[:-1]))
        return Tiling(
            rank=np.concatenate(owners),
            rows=np.concatenate(rows),
            cols=np.repeat(widths, [len(r) for r in rows]),
            row_offset=np.concatenate([np.cumsum(r) - r for r in rows]),
            col_offset=np.repeat(col_starts, [len(r) for r in rows]),
            col_blocks=len(widths),
        )

    def shards(self) -> list[ShardMeta]:
        return [ShardMeta(int(ro), int(r), int(co), int(c), int(k)) for ro, r, co, c, k in
                zip(self.row_offset, self.rows, self.col_offset, self.cols, self.rank)]


def block_shards(
    num_rows: int, dim: int, row_sizes_per_col: list[list[int]], col_sizes: list[int], ranks_per_col: list[list[int]]
) -> list[ShardMeta]:
    """Tile a ``[num_rows, dim]`` table: column block ``c`` is split into row blocks on ``ranks_per_col[c]``."""
    assert all(sum(r) == num_rows for r in row_sizes_per_col) and sum(col_sizes) == dim
    return Tiling.blocks(row_sizes_per_col, col_sizes, ranks_per_col).shards()
