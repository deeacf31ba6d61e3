"""DCP storage with checksums: a writer that records a CRC-32 of every stored piece, a reader that checks it.

Pieces are the byte ranges DCP writes per tensor chunk (``_StorageInfo``: file, offset, length). The writer
reads back what it wrote (from the page cache, in blocks) and records ``{file: {offset: (length, crc)}}``;
the reader checks a piece's length against the file and its CRC before DCP deserializes it, so flipped bytes
or a truncated file are named (file, tensor, rank) instead of loading silently or failing deep in torch.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import StorageMeta

from lightning_rec.checkpoint.errors import CheckpointError, as_disk_full
from lightning_rec.checkpoint.safe import load_dcp_metadata

_BLOCK = 8 << 20


def crc32_range(file: IO[bytes], offset: int, length: int) -> int:
    """CRC-32 of ``length`` bytes of ``file`` from ``offset``, read in blocks (constant memory)."""
    file.seek(offset)
    crc, left = 0, length
    while left:
        block = file.read(min(_BLOCK, left))
        if not block:
            break
        crc = zlib.crc32(block, crc)
        left -= len(block)
    return crc


class CheckedWriter(FileSystemWriter):
    """FileSystemWriter that records the CRC-32 of the pieces it wrote and reports a full disk plainly."""

    rank: int

    def __init__(self, path: str | os.PathLike, rank: int) -> None:
        super().__init__(path)
        self.rank = rank
        self.checksums: dict[str, dict[int, tuple[int, int]]] = {}

    def write_data(self, plan: Any, planner: Any) -> Any:
        needed = sum(_item_bytes(item) for item in plan.items)
        try:
            fut = super().write_data(plan, planner)
            results = fut.wait()
        except Exception as e:
            full = as_disk_full(e, self.path, needed, self.rank)
            if full is not None:
                raise full from e
            raise
        by_file: dict[str, list[Any]] = {}
        for r in results:
            by_file.setdefault(r.storage_data.relative_path, []).append(r.storage_data)
        for rel, infos in by_file.items():
            with open(Path(self.path) / rel, "rb") as f:
                self.checksums[rel] = {i.offset: (i.length, crc32_range(f, i.offset, i.length)) for i in infos}
        return fut


def _item_bytes(item: Any) -> int:
    td = getattr(item, "tensor_data", None)
    if td is None:
        return 0
    return int(torch.Size(td.size).numel()) * td.properties.dtype.itemsize


class CheckedReader(FileSystemReader):
    """FileSystemReader with the allowlisted metadata unpickler and per-piece checks (length, CRC-32).

    ``checksums`` is ``{file: {offset: (length, crc)}}`` from the checkpoint's meta (None: an older checkpoint
    without checksums; only lengths are checked).
    """

    def __init__(
        self, path: str | os.PathLike, rank: int, checksums: dict[str, Any] | None = None, trusted: bool = False
    ) -> None:
        super().__init__(path)
        self.reader_rank, self.checksums, self.trusted = rank, checksums, trusted
        self._names: dict[tuple[str, int], str] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        metadata = load_dcp_metadata(self._get_metadata_path(rank), self.trusted)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._names = {(info.relative_path, info.offset): index.fqn for index, info in metadata.storage_data.items()}

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        where = Path(self.path) / sinfo.relative_path
        tensor = self._names.get((sinfo.relative_path, sinfo.offset), "?")
        size = os.fstat(file.fileno()).st_size
        if sinfo.offset + sinfo.length > size:
            raise CheckpointError(
                f"checkpoint file {where} is truncated: tensor {tensor!r} needs bytes {sinfo.offset}.."
                f"{sinfo.offset + sinfo.length}, the file has {size} (reading on rank {self.reader_rank})"
            )
        if self.checksums is not None:
            want = self.checksums.get(sinfo.relative_path, {}).get(sinfo.offset)
            if want is None:
                raise CheckpointError(
                    f"checkpoint file {where}: no checksum recorded for tensor {tensor!r} "
                    f"(rank {self.reader_rank}); the directory mixes files of two saves"
                )
            got = crc32_range(file, sinfo.offset, sinfo.length)
            if (sinfo.length, got) != tuple(want):
                raise CheckpointError(
                    f"checkpoint file {where} is damaged: tensor {tensor!r} (bytes {sinfo.offset}.."
                    f"{sinfo.offset + sinfo.length}) has CRC-32 {got:#010x}, the save recorded {want[1]:#010x} "
                    f"(reading on rank {self.reader_rank})"
                )
        return super()._slice_file(file, sinfo)
