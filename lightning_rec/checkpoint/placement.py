"""Where each sharded parameter sits in its table, and the chunking of ShardedTensors for writing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_rec import _compat
from lightning_rec.sharding.sharded import sharded_collections

# Pieces are written in row blocks of at most this size, so reading one back (DCP loads a stored piece whole
# before copying it into place) costs at most this much memory beyond the model's own state.
CHUNK_BYTES = 32 << 20


@dataclass
class Placement:
    """One sharded parameter: its table's global shape, every shard ``(offsets, sizes, global rank)``, ours."""

    table: str
    global_shape: list[int]
    shards: list[tuple[list[int], list[int], int]]
    local_offsets: list[int]
    local_sizes: list[int]
    group: Any
    dtype: torch.dtype

    def sharded(self, local: torch.Tensor, dtype: torch.dtype | None = None) -> Any:
        return _compat.make_sharded_tensor(
            [(local, self.local_offsets)], self.shards, self.global_shape, dtype or local.dtype,
            local.device.type, self.group,
        )

    def column_offsets(self) -> list[int]:
        """The distinct column offsets of the table's shards: the column pieces of row-wise state."""
        return sorted({off[1] for off, size, _ in self.shards if all(s > 0 for s in size)})

    def rows_sharded(self, local: torch.Tensor, columns: int, column: int) -> Any:
        """``local`` ([local rows, 1]) as column ``column`` of a [table rows, ``columns``] ShardedTensor."""
        pieces = [([off[0], self.column_offsets().index(off[1])], [size[0], 1], r) for off, size, r in self.shards
                  if all(s > 0 for s in size)]
        return _compat.make_sharded_tensor([(local, [self.local_offsets[0], column])], pieces,
                                           [self.global_shape[0], columns], local.dtype, local.device.type,
                                           self.group)

    def rows_target(self, buf: torch.Tensor) -> Any:
        """A load target for the rows ``[local_offsets[0], + len(buf))`` of a [table rows, k] tensor.

        Only the local rows are read; the rest of the table is described as held by another rank of the group
        (a load target's metadata must tile the tensor, and nothing is read for pieces held elsewhere).
        """
        rows, row0 = self.global_shape[0], self.local_offsets[0]
        n, k = buf.shape
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else [dist.get_rank()]
        others = [r for r in ranks if r != dist.get_rank()]
        if n == rows or not others:
            return None  # the caller reads the whole tensor instead
        pieces = [([0, 0], [row0, k], others[0]), ([row0, 0], [n, k], dist.get_rank()),
                  ([row0 + n, 0], [rows - row0 - n, k], others[0])]
        return _compat.make_sharded_tensor([(buf, [row0, 0])], pieces, [rows, k], buf.dtype, buf.device.type,
                                           self.group)


def placements(model: nn.Module) -> dict[str, Placement]:
    """``{parameter name: placement}`` for the sharded tables this rank holds a piece of."""
    out: dict[str, Placement] = {}
    for path, m in sharded_collections(model):
        tables, all_shards, ranks, dtypes = m.tables, m.shards, m.shard_group_ranks, m.table_dtypes
        for ti, s in m.local_shards:
            t = tables[ti]
            shards = [([x.row_offset, x.col_offset], [x.rows, x.cols], ranks[x.rank]) for x in all_shards[t.name]]
            name = f"{path}.{m.table_attr}.{t.name}.weight" if path else f"{m.table_attr}.{t.name}.weight"
            out[name] = Placement(t.name, [t.num_embeddings, t.embedding_dim], shards, [s.row_offset, s.col_offset],
                                  [s.rows, s.cols], m.shard_group, dtypes[ti])
    return out


def sharding_layout(model: nn.Module) -> dict[str, dict[str, Any]]:
    """``{collection path: {table: [[row_offset, rows, col_offset, cols, shard rank], ...] or "data_parallel"}}``."""
    return {
        path: {name: ("data_parallel" if shards is None else
                      [[s.row_offset, s.rows, s.col_offset, s.cols, s.rank] for s in shards])
               for name, shards in m.shards.items()}
        for path, m in sharded_collections(model)
    }


def _row_blocks(offsets: list[int], sizes: list[int], row_bytes: int) -> list[tuple[int, int]]:
    step = max(1, CHUNK_BYTES // max(row_bytes, 1))
    return [(r, min(step, sizes[0] - r)) for r in range(0, sizes[0], step)]


def chunked(value: Any) -> Any:
    """A 2-D ShardedTensor re-described with every shard split into row blocks of at most ``CHUNK_BYTES``.

    The local pieces are views (no copy); every rank splits every shard by the same rule, so the metadata agrees.
    """
    if not _compat.is_sharded_tensor(value) or value.dim() != 2:
        return value
    md = value.metadata()
    itemsize = md.tensor_properties.dtype.itemsize
    if all(m.shard_sizes[0] * m.shard_sizes[1] * itemsize <= CHUNK_BYTES for m in md.shards_metadata):
        return value
    pieces, local = [], []
    mine = {tuple(sh.metadata.shard_offsets): sh.tensor for sh in value.local_shards()}
    device = "cpu"
    for m in md.shards_metadata:
        (r, c), (nr, nc) = m.shard_offsets, m.shard_sizes
        device = m.placement.device().type
        for r0, n in _row_blocks([r, c], [nr, nc], nc * itemsize):
            pieces.append(([r + r0, c], [n, nc], m.placement.rank()))
            if (r, c) in mine:
                local.append((mine[(r, c)][r0:r0 + n], [r + r0, c]))
    return _compat.make_sharded_tensor(local, pieces, list(value.size()), md.tensor_properties.dtype, device,
                                       value._process_group)


def chunk_tree(tree: Any) -> Any:
    """``chunked`` applied to every ShardedTensor of nested dicts."""
    if isinstance(tree, dict):
        return {k: chunk_tree(v) for k, v in tree.items()}
    return chunked(tree)
