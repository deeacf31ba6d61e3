"""Where each sharded parameter sits in its table, and the chunking of DTensors for writing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from lightning_rec import _compat
from lightning_rec.pipeline.shard_modules import sharded_collections
from lightning_rec.pipeline.state_dict import table_dtensor
from lightning_rec.plans.shard_geometry import ShardMeta

# Pieces are written in row blocks of at most this size, so reading one back (DCP loads a stored piece whole
# before copying it into place) costs at most this much memory beyond the model's own state.
CHUNK_BYTES = 32 << 20


@dataclass
class Placement:
    """One sharded parameter: its table's global shape, every shard (shard-group ranks), this rank's piece."""

    table: str
    global_shape: list[int]
    shards: list[ShardMeta]
    local_offsets: list[int]
    local_sizes: list[int]
    group: Any
    dtype: torch.dtype

    def sharded(self, local: torch.Tensor, dtype: torch.dtype | None = None) -> Any:
        """``local`` (this rank's piece of a tensor shaped like the table) as a DTensor laid out like the table."""
        return table_dtensor(
            [(local, self.local_offsets)],
            self.shards,
            self.global_shape,
            dtype or local.dtype,
            local.device,
            self.group,
        )

    def column_offsets(self) -> list[int]:
        """The distinct column offsets of the table's shards: the column pieces of row-wise state."""
        return sorted({s.col_offset for s in self.shards if s.rows > 0 and s.cols > 0})

    def rows_sharded(self, local: torch.Tensor, columns: int, column: int) -> Any:
        """``local`` ([local rows, 1]) as column ``column`` of a [table rows, ``columns``] DTensor."""
        cols = self.column_offsets()
        pieces = [
            ShardMeta(s.row_offset, s.rows, cols.index(s.col_offset), 1, s.rank)
            for s in self.shards
            if s.rows > 0 and s.cols > 0
        ]
        return table_dtensor(
            [(local, [self.local_offsets[0], column])],
            pieces,
            [self.global_shape[0], columns],
            local.dtype,
            local.device,
            self.group,
        )

    def rows_target(self, buf: torch.Tensor) -> Any:
        """A load target for the rows ``[local_offsets[0], + len(buf))`` of a [table rows, k] tensor.

        Only the local rows are read: a DTensor's load target names this rank's pieces alone.
        """
        if buf.shape[0] == self.global_shape[0]:
            return None  # the caller reads the whole tensor instead
        return _compat.make_dtensor(
            [(buf, [self.local_offsets[0], 0])],
            [],
            [self.global_shape[0], buf.shape[1]],
            buf.dtype,
            buf.device,
            self.group,
        )


def placements(model: nn.Module) -> dict[str, Placement]:
    """``{parameter name: placement}`` for the sharded tables this rank holds a piece of."""
    out: dict[str, Placement] = {}
    for path, m in sharded_collections(model):
        tables, all_shards, dtypes = m.tables, m.shards, m.table_dtypes
        for ti, s in m.local_shards:
            t = tables[ti]
            name = f"{path}.{m.table_attr}.{t.name}.weight" if path else f"{m.table_attr}.{t.name}.weight"
            shards = cast("list[ShardMeta]", all_shards[t.name])  # a table with a local shard is sharded
            out[name] = Placement(
                t.name,
                [t.num_embeddings, t.embedding_dim],
                list(shards),
                [s.row_offset, s.col_offset],
                [s.rows, s.cols],
                m.shard_group,
                dtypes[ti],
            )
    return out


def sharding_layout(model: nn.Module) -> dict[str, dict[str, Any]]:
    """``{collection path: {table: [[row_offset, rows, col_offset, cols, shard rank], ...] or "data_parallel"}}``."""
    return {
        path: {
            name: (
                "data_parallel"
                if shards is None
                else [[s.row_offset, s.rows, s.col_offset, s.cols, s.rank] for s in shards]
            )
            for name, shards in m.shards.items()
        }
        for path, m in sharded_collections(model)
    }


def chunked(value: Any) -> Any:
    """A 2-D DTensor re-described with every local piece split into row blocks of at most ``CHUNK_BYTES``.

    The new pieces are views (no copy). Each rank describes only its own pieces, so no rank needs to agree with
    another on the split; replicas of a piece split it the same way (DCP writes one copy).
    """
    if not _compat.is_sharded(value) or value.dim() != 2:
        return value
    pieces = _compat.local_pieces(value)
    if all(t.numel() * t.element_size() <= CHUNK_BYTES for _, t in pieces):
        return value
    local = []
    for (r, c), t in pieces:
        step = max(1, CHUNK_BYTES // max(t.shape[1] * t.element_size(), 1))
        local += [(t[r0 : r0 + step], [r + r0, c]) for r0 in range(0, t.shape[0], step)]
    record = _compat.shard_record(value)
    if record is None:  # not one of ours: written as it is
        return value
    return _compat.make_dtensor(
        local, [], list(value.size()), record.dtype, pieces[0][1].device, None, mesh=value.device_mesh
    )


def chunk_tree(tree: Any) -> Any:
    """``chunked`` applied to every DTensor of nested dicts."""
    if isinstance(tree, dict):
        return {k: chunk_tree(v) for k, v in tree.items()}
    return chunked(tree)
