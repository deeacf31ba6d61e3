"""The collectives of checkpoints and exports: ranks, one path for all, and errors raised on every rank.

A failure on any rank is raised on every rank at the next agreement point (:func:`agree`), within seconds
rather than after the collective timeout.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_rec.checkpoint.errors import CheckpointError


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if distributed() else 0


def barrier() -> None:
    if distributed():
        dist.barrier()


def broadcast_path(path: str | os.PathLike) -> Path:
    """Rank 0's ``path`` on every rank (ranks may compute different names, e.g. from a timestamp)."""
    if distributed():
        obj = [str(path)]
        dist.broadcast_object_list(obj, src=0)
        path = obj[0]
    return Path(path)


def agree(error: BaseException | None, what: str) -> None:
    """Collective: raise on every rank if ``error`` is set on any rank (the first failing rank's error).

    Every rank must reach this call whatever happened locally, so failures are caught, not raised, before it.
    """
    # a CheckpointError travels as itself (a full disk is a DiskFullError on every rank), others as text
    mine = (
        None
        if error is None
        else (f"{type(error).__name__}: {error}", error if isinstance(error, CheckpointError) else None)
    )
    if distributed() and dist.get_world_size() > 1:
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, mine)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    else:
        failed = [] if mine is None else [(rank(), mine)]
    if not failed:
        return
    if error is not None:
        raise error  # this rank's own error, as it was
    r, (message, same) = failed[0]
    if same is not None:
        raise same
    raise CheckpointError(f"{what} failed on rank {r} (so every rank stops): {message}")
