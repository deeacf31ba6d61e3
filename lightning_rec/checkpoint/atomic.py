"""All-or-nothing directory / file writes, shared by checkpoints and exports.

A write goes to ``.<name>.partial`` next to the target and is renamed into place only after every rank
reported success (:func:`lightning_rec.checkpoint.collective.agree`), so a failure (or a kill) part-way
leaves the previous version as it was.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def partial_path(path: Path) -> Path:
    """Where a write of ``path`` goes until it is complete."""
    return path.with_name(f".{path.name}.partial")


def previous_path(path: Path) -> Path:
    """Where the previous version of ``path`` waits while the new one is swapped in."""
    return path.with_name(f".{path.name}.previous")


def resolve(path: str | os.PathLike) -> Path:
    """The directory to read: ``path``, or the previous one if a save died while swapping them in."""
    path = Path(path)
    if not path.exists() and previous_path(path).is_dir():
        return previous_path(path)
    return path


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


def swap_in(tmp: Path, path: Path) -> None:
    """Rename the complete ``tmp`` to ``path``; the old ``path`` survives as ``.previous`` until then."""
    old = previous_path(path)
    if path.exists():
        remove(old)
        os.replace(path, old)
    try:
        os.replace(tmp, path)
    except BaseException:
        if old.exists() and not path.exists():
            os.replace(old, path)
        raise
    remove(old)
