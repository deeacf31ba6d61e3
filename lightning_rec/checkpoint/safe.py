"""Reading checkpoint files without running code from them.

Two files of a checkpoint directory are pickles: the meta file (``torch.save``) and DCP's ``.metadata``.
A pickle may name any importable callable, which unpickling calls: a planted ``os.system`` runs on load.
Both are read with unpicklers that resolve only the globals a lightning_rec checkpoint holds and refuse
anything else with :class:`UnsafeCheckpointError` (naming the file and the global) before calling it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import pathlib
import pickle
import re
from collections.abc import Iterator
from typing import Any, BinaryIO

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata

from lightning_rec._compat import DcpStorageInfo, serialization_get_layout
from lightning_rec.checkpoint.errors import CheckpointError, UnsafeCheckpointError
from lightning_rec.configs import DataType, EmbeddingBagConfig, EmbeddingConfig, PoolingType, ShardingType

# Types the meta file may hold beyond torch's weights_only set (tensors, dtypes, plain containers): paths and
# namespaces, which hyper-parameters commonly are, and lightning_rec's table configs (a model's hyper-parameters
# may list its tables). Lightning writes hyper-parameters as a plain dict.
META_GLOBALS: list[Any] = [
    argparse.Namespace,
    pathlib.PosixPath,
    pathlib.PurePosixPath,
    pathlib.WindowsPath,
    pathlib.PureWindowsPath,
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
    ShardingType,
]

# DCP's metadata: its own dataclasses and enums, and the torch values inside them. The private names are the
# ones DCP's own pickles refer to (``_StorageInfo``, ``_MEM_FORMAT_ENCODING``, ``_get_layout``); a torch that
# renames them fails these loads with UnsafeCheckpointError naming the global, never silently.
_DCP_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): serialization_get_layout,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): DcpStorageInfo,
    ("collections", "OrderedDict"): collections.OrderedDict,
    **{
        ("pathlib", c.__name__): c
        for c in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath, pathlib.Path)
    },
    **{
        ("torch.distributed.checkpoint.metadata", n): getattr(dcp_metadata, n)
        for n in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
        if hasattr(dcp_metadata, n)
    },
}


class _DcpUnpickler(pickle.Unpickler):
    def __init__(self, file: BinaryIO, path: str) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        found = _DCP_GLOBALS.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(self._path, f"{module}.{name}")


def load_dcp_metadata(path: str | os.PathLike, trusted: bool = False) -> Any:
    """DCP's ``.metadata`` at ``path``, unpickled with the allowlist unless ``trusted``."""
    try:
        with open(path, "rb") as f:
            return pickle.load(f) if trusted else _DcpUnpickler(f, str(path)).load()
    except CheckpointError:
        raise
    except FileNotFoundError as e:
        raise CheckpointError(f"{path} is missing: not a complete checkpoint directory") from e
    except Exception as e:
        raise CheckpointError(f"cannot read the checkpoint metadata {path}: {type(e).__name__}: {e}") from e


@contextlib.contextmanager
def refusing_unsafe(path: str | os.PathLike) -> Iterator[None]:
    """Inside: ``torch.load(..., weights_only=True)`` also takes META_GLOBALS, and a refusal of another global
    becomes :class:`UnsafeCheckpointError` naming ``path`` and the global."""
    try:
        with torch.serialization.safe_globals(META_GLOBALS):
            yield
    except pickle.UnpicklingError as e:
        allowed = {f"{g.__module__}.{g.__qualname__}" for g in META_GLOBALS}
        try:
            unsafe = [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(path) if g not in allowed]
        except Exception:
            unsafe = []
        if not unsafe:
            m = re.search(r"GLOBAL ([\w.]+)", str(e))
            unsafe = [m.group(1)] if m else []
        if unsafe:
            raise UnsafeCheckpointError(path, unsafe[0]) from None
        raise CheckpointError(f"cannot read {path}: {e}") from None


def load_meta(path: str | os.PathLike, trusted: bool = False) -> dict[str, Any]:
    """The meta file (``torch.save`` format) at ``path``: ``weights_only`` with META_GLOBALS unless ``trusted``."""
    try:
        if trusted:
            return torch.load(path, map_location="cpu", weights_only=False)
        with refusing_unsafe(path):
            return torch.load(path, map_location="cpu", weights_only=True)
    except RuntimeError as e:
        raise CheckpointError(f"cannot read the checkpoint meta file {path} (damaged or truncated?): {e}") from e
