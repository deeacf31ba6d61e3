"""The errors a checkpoint save or load raises: each names the file (and tensor and rank where known)."""

from __future__ import annotations

import errno
import os


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

    def __init__(self, path: str | os.PathLike, bytes_needed: int, rank: int) -> None:
        self.path, self.bytes_needed, self.rank = str(path), bytes_needed, rank
        self.errno = errno.ENOSPC  # as the OSError it replaces
        CheckpointError.__init__(
            self,
            f"no space left on the device of {path} (rank {rank}): the save needs about {bytes_needed:,} bytes "
            "there; the partial checkpoint was removed and the previous one is unchanged",
        )

    def __reduce__(self) -> tuple:  # exceptions travel between ranks pickled
        return type(self), (self.path, self.bytes_needed, self.rank)
