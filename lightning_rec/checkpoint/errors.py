"""The errors a checkpoint save or load raises: each names the file (and tensor and rank where known)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path


class CheckpointError(Exception):
    """A checkpoint could not be written or read: a damaged, missing or truncated file, or a failed save.

    torch.distributed.checkpoint raises ``CheckpointException``, a ``BaseException`` that ``except Exception``
    misses; lightning_rec wraps it (and its own checks) in this class, with the file, tensor and rank.
    """


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file refers to a Python global that loading would have to import and call.

    lightning_rec never runs code from a checkpoint unless told it is trusted (``trusted=True``,
    ``RecShardedStrategy(trusted_checkpoints=True)``, ``RecModule.load_from_checkpoint(..., trusted_checkpoints=True)``,
    ``--trust_checkpoint``).
    """

    def __init__(self, path: str | os.PathLike, refused: str) -> None:
        self.path, self.refused = str(path), refused
        super().__init__(
            f"refused to load {path}: it refers to the Python global {refused!r}, which is not among the types a "
            "lightning_rec checkpoint holds, and loading it would run code. If you trust the file (you wrote it and "
            "its hyper-parameters or callback states hold such objects), load it with trusted=True "
            "(checkpoint.load / read_meta), RecShardedStrategy(trusted_checkpoints=True), "
            "load_from_checkpoint(..., trusted_checkpoints=True) or --trust_checkpoint"
        )

    def __reduce__(self) -> tuple:  # exceptions travel between ranks pickled
        return type(self), (self.path, self.refused)


class DiskFullError(CheckpointError, OSError):
    """A save ran out of space. The partial directory is removed and the previous checkpoint is untouched."""

    def __init__(self, path: str | os.PathLike, bytes_needed: int, rank: int, bytes_free: int | None = None) -> None:
        self.path, self.bytes_needed, self.rank = str(path), bytes_needed, rank
        self.bytes_free = free_bytes(path) if bytes_free is None else bytes_free
        self.errno = errno.ENOSPC  # as the OSError it replaces
        free = "unknown" if self.bytes_free < 0 else f"{self.bytes_free:,}"
        CheckpointError.__init__(
            self,
            f"no space left on the device of {path} (rank {rank}): the save needs about {bytes_needed:,} bytes "
            f"there and {free} bytes are free; the partial checkpoint was removed and the previous one is unchanged",
        )

    def __reduce__(self) -> tuple:  # exceptions travel between ranks pickled
        return type(self), (self.path, self.bytes_needed, self.rank, self.bytes_free)


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes on the file system of ``path`` (or of its nearest existing parent); -1 if unknown."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return -1


# what running out of space looks like when it does not come as ENOSPC: torch.save's zip writer reports a
# short write as a position mismatch ("unexpected pos"), or as "file write failed"
_SHORT_WRITE = ("unexpected pos", "file write failed", "No space left on device", "Disk quota exceeded")


def as_disk_full(e: BaseException, path: str | os.PathLike, bytes_needed: int, rank: int) -> DiskFullError | None:
    """The DiskFullError ``e`` stands for, if it (or what caused it) is a failure to get space, else None.

    An out-of-space OSError anywhere in the chain counts; a short write of torch's zip writer counts when the
    file system of ``path`` is indeed (nearly) out of space, since the same message could have other causes.
    """
    seen: set[int] = set()
    stack: list[BaseException | None] = [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, DiskFullError):
            return x
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return DiskFullError(path, bytes_needed, rank)
        if isinstance(x, RuntimeError) and any(m in str(x) for m in _SHORT_WRITE):
            free = free_bytes(path)
            if 0 <= free < max(bytes_needed, _NEARLY_FULL):
                return DiskFullError(path, bytes_needed, rank, free)
        stack += [x.__cause__, x.__context__]
        stack += [f[0] if isinstance(f, tuple) else f for f in getattr(x, "failures", {}).values()]  # DCP's
    return None


_NEARLY_FULL = 1 << 20
