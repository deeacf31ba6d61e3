"""Pure shard-size and offset math: the one source for bucketing, local shapes and checkpoint metadata.

Ranks here are ranks of the model-parallel (shard) group, never global ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ShardMeta:
    """One rectangular piece of a table: rows ``[row_offset, row_offset + rows)``, columns likewise."""

    row_offset: int
    rows: int
    col_offset: int
    cols: int
    rank: int

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """This piece of ``full`` (a view)."""
        return full[self.row_offset : self.row_offset + self.rows, self.col_offset : self.col_offset + self.cols]


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


@dataclass(frozen=True, eq=False)
class Tiling:
    """A table cut into ``k`` column blocks, each split into the same ``n`` row blocks.

    Column block ``c`` (``col_sizes[c]`` wide) is split into row blocks ``row_sizes`` on the ranks
    ``owners[c]``. ``rank``, ``rows`` and ``cols`` hold one entry per shard (column block major): the
    planner's cost model reads them; :meth:`shards` gives the ``ShardMeta`` list the sharded modules and
    checkpoints use, so both see the same tiling.
    """

    row_sizes: np.ndarray  # [n]
    col_sizes: np.ndarray  # [k]
    owners: np.ndarray  # [k, n]

    @staticmethod
    def grid(
        row_sizes: Sequence[int] | np.ndarray,
        col_sizes: Sequence[int],
        owners: Sequence[int] | Sequence[Sequence[int]] | np.ndarray,
    ) -> Tiling:
        return Tiling(
            np.asarray(row_sizes, dtype=np.int64),
            np.asarray(col_sizes, dtype=np.int64),
            np.asarray(owners, dtype=np.int64).reshape(len(col_sizes), -1),
        )

    @property
    def col_blocks(self) -> int:
        return len(self.col_sizes)

    @property
    def rank(self) -> np.ndarray:
        return self.owners.reshape(-1)

    @property
    def rows(self) -> np.ndarray:
        return np.tile(self.row_sizes, len(self.col_sizes))

    @property
    def cols(self) -> np.ndarray:
        return np.repeat(self.col_sizes, len(self.row_sizes))

    def shards(self) -> list[ShardMeta]:
        row_offs, col_offs = offsets_of(self.row_sizes.tolist()), offsets_of(self.col_sizes.tolist())
        owners = self.owners.tolist()
        return [
            ShardMeta(
                row_offs[r], row_offs[r + 1] - row_offs[r], col_offs[c], col_offs[c + 1] - col_offs[c], owners[c][r]
            )
            for c in range(len(self.col_sizes))
            for r in range(len(self.row_sizes))
        ]


def block_shards(
    num_rows: int, dim: int, row_sizes_per_col: list[list[int]], col_sizes: list[int], ranks_per_col: list[list[int]]
) -> list[ShardMeta]:
    """Tile a ``[num_rows, dim]`` table: column block ``c`` is split into row blocks on ``ranks_per_col[c]``."""
    shards = []
    col_offs = offsets_of(col_sizes)
    for c, (cols, ranks, row_sizes) in enumerate(zip(col_sizes, ranks_per_col, row_sizes_per_col)):
        row_offs = offsets_of(row_sizes)
        assert row_offs[-1] == num_rows and col_offs[-1] == dim
        for r, rank in enumerate(ranks):
            shards.append(ShardMeta(row_offs[r], row_sizes[r], col_offs[c], cols, rank))
    return shards


def dtensor_placement(shards: Sequence[ShardMeta], num_rows: int, dim: int, group_size: int) -> tuple[str, int] | None:
    """How a table's tiling maps onto DTensor placements over a 1-D mesh of the shard group, if it does.

    ``("owner", rank)``: one shard holds the whole table (table-wise): ``Replicate()`` on a mesh of that rank.
    ``("shard", d)``: shard-group rank ``i`` holds ``torch.chunk``'s block ``i`` along dimension ``d`` (what
    ``Shard(d)`` means; even row-wise and column-wise splits). None: anything else (custom sizes, ranks out of
    order, blocks of one host, grids), described by local pieces with offsets.

    >>> dtensor_placement([ShardMeta(0, 3, 0, 4, 0), ShardMeta(3, 2, 0, 4, 1)], 5, 4, 2)
    ('shard', 0)
    """
    full = [s for s in shards if s.rows > 0 and s.cols > 0]
    if len(full) == 1 and (full[0].rows, full[0].cols) == (num_rows, dim):
        return ("owner", full[0].rank)
    for d, total in ((0, num_rows), (1, dim)):
        sizes = even_split(total, group_size)
        offs = offsets_of(sizes)
        want = {(offs[r], sizes[r], r) for r in range(group_size) if sizes[r] > 0}
        got = {
            ((s.row_offset, s.rows) if d == 0 else (s.col_offset, s.cols)) + (s.rank,)
            for s in full
            if ((s.col_offset, s.cols) if d == 0 else (s.row_offset, s.rows)) == (0, dim if d == 0 else num_rows)
        }
        if len(got) == len(full) and got == want and total > 0:
            return ("shard", d)
    return None
