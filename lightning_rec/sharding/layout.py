"""Pure shard-size and offset math: the one source for bucketing, local shapes and checkpoint metadata.

Ranks here are ranks of the model-parallel (shard) group, never global ranks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardMeta:
    """One rectangular piece of a table: rows ``[row_offset, row_offset + rows)``, columns likewise."""

    row_offset: int
    rows: int
    col_offset: int
    cols: int
    rank: int


def even_split(total: int, parts: int) -> list[int]:
    """Sizes of ``torch.chunk``-style blocks: ``ceil(total / parts)`` each, the tail short or empty.

    >>> even_split(10, 4), even_split(5, 4)
    ([3, 3, 3, 1], [2, 2, 1, 0])
    """
    block = -(-total // parts)
    return [max(0, min(block, total - i * block)) for i in range(parts)]


def offsets_of(sizes: list[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def host_ranks(host_index: int, local_size: int) -> list[int]:
    return list(range(host_index * local_size, (host_index + 1) * local_size))


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
