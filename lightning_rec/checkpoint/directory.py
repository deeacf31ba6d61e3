"""Checkpoint directories: DCP shards + a meta file, written all-or-nothing, read safely and verified."""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_rec import _compat
from lightning_rec.checkpoint import atomic, collective
from lightning_rec.checkpoint.errors import CheckpointError, as_disk_full
from lightning_rec.checkpoint.optim_state import optimizer_state, optimizer_targets
from lightning_rec.checkpoint.placement import chunk_tree
from lightning_rec.checkpoint.safe import load_meta
from lightning_rec.checkpoint.storage import CheckedReader, CheckedWriter

META_FILE = "meta.pt"
FORMAT = "lightning_rec.dcp/2"
# Formats this code reads: /1 wrote row-wise optimizer state broadcast over columns and no checksums.
_READABLE = ("lightning_rec.dcp/1", FORMAT)


def is_checkpoint_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` (or the previous version a dying save left) is a checkpoint directory."""
    p = atomic.resolve(path)
    return p.is_dir() and (p / META_FILE).is_file()


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizers: Iterable[Any] = (),
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``model`` (sharded or not) and ``optimizers`` as a checkpoint directory; ``extra`` goes to meta.

    Collective. The result loads with :func:`load` into any sharding of the same model, or into one process.
    """
    tensors: dict[str, Any] = {"state_dict": model.state_dict()}
    layouts = []
    for i, opt in enumerate(optimizers):
        state = optimizer_state(model, opt)
        tensors[f"optimizer_{i}"] = state["tensors"]
        layouts.append(state["meta"])
    return write(path, tensors, {**(extra or {}), "optimizer_layouts": layouts})


def _unwrap(e: BaseException, path: Path, what: str) -> CheckpointError:
    """One CheckpointError (or DiskFullError) from whatever DCP or the file system raised."""
    if isinstance(e, CheckpointError):
        return e
    if isinstance(e, CheckpointException):
        failures = {r: exc for r, (exc, _) in e.failures.items()}
        for r in sorted(failures):
            full = as_disk_full(failures[r], path, 0, r)
            if full is not None:
                return full
        for r in sorted(failures):
            if isinstance(failures[r], CheckpointError):
                return cast(CheckpointError, failures[r])
        first = min(failures)
        exc = failures[first]
        return CheckpointError(
            f"{what} {path} failed on rank(s) {sorted(failures)}; rank {first}: {type(exc).__name__}: {exc}"
        )
    full = as_disk_full(e, path, 0, collective.rank())
    if full is not None:
        return full
    return CheckpointError(f"{what} {path} failed on rank {collective.rank()}: {type(e).__name__}: {e}")


def _gather_checksums(local: dict[str, Any]) -> dict[str, Any]:
    if not collective.distributed() or dist.get_world_size() == 1:
        return local
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    out: dict[str, Any] = {}
    for g in gathered:
        for f, pieces in g.items():
            out.setdefault(f, {}).update(pieces)
    return out


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write(path: str | os.PathLike, tensors: Mapping[str, Any], meta: dict[str, Any]) -> Path:
    """Write ``tensors`` (nested dicts of tensors / DTensors) with DCP and ``meta`` with ``torch.save``.

    Collective and all-or-nothing: the directory appears at ``path`` only when every rank wrote its part;
    a failure on any rank raises on every rank (:class:`CheckpointError`, :class:`DiskFullError`), removes
    the partial directory and leaves a previous checkpoint at ``path`` as it was.
    """
    path = collective.broadcast_path(path)
    tmp = atomic.partial_path(path)
    rank = collective.rank()
    error: BaseException | None = None
    if rank == 0:
        try:
            if path.exists() and not path.is_dir():
                raise FileExistsError(f"checkpoint path {path} exists and is a file, not a checkpoint directory")
            atomic.remove(tmp)  # left by a save that was killed
            tmp.mkdir(parents=True)
        except Exception as e:  # every rank must hear about it
            error = e
    collective.agree(error, f"preparing checkpoint {path}")
    writer = CheckedWriter(tmp, rank)
    try:
        dcp.save(chunk_tree(dict(tensors)), storage_writer=writer)
    except BaseException as e:  # DCP raises CheckpointException, a BaseException
        if isinstance(e, KeyboardInterrupt):
            raise
        error = _unwrap(e, tmp, "writing checkpoint")
    try:
        collective.agree(error, f"writing checkpoint {path}")
        checksums = _gather_checksums(writer.checksums)
        error = None
        if rank == 0:
            data = b""
            try:
                # serialized first: its size is known, and a full disk fails the plain write with ENOSPC
                buf = io.BytesIO()
                torch.save({"format": FORMAT, **meta, "checksums": checksums}, buf)
                data = buf.getvalue()
                _write_file(tmp / META_FILE, data)
                atomic.swap_in(tmp, path)
            except Exception as e:
                error = as_disk_full(e, tmp / META_FILE, len(data), rank) or e
        collective.agree(error, f"completing checkpoint {path}")
    except BaseException:
        if rank == 0:
            atomic.remove(tmp)
        raise
    return path


def read_meta(path: str | os.PathLike, trusted: bool = False) -> dict[str, Any]:
    """The non-tensor part of a checkpoint directory, read without running code from it unless ``trusted``."""
    p = atomic.resolve(path)
    meta = load_meta(p / META_FILE, trusted=trusted)
    if not isinstance(meta, dict) or meta.get("format") not in _READABLE:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(
            f"{p} is not a lightning_rec checkpoint this version reads (format {found!r}; "
            f"readable: {', '.join(_READABLE)})"
        )
    return meta


def _check_model(saved: Mapping[str, Any], path: Path, model_state: Mapping[str, Any], strict: bool) -> None:
    prefix = "state_dict."
    have = {k[len(prefix) :]: v for k, v in saved.items() if k.startswith(prefix)}
    problems = []
    for key, value in model_state.items():
        if not (torch.is_tensor(value) or _compat.is_sharded(value)):
            continue
        if key not in have:
            if strict:
                problems.append(f"{key!r} is missing from the checkpoint")
            continue
        want = list(value.size()) if _compat.is_sharded(value) else list(value.shape)
        got = list(getattr(have[key], "size", []))
        if got != want:
            problems.append(f"{key!r} has shape {got} in the checkpoint but {want} in the model")
    if strict:
        problems += [f"{k!r} is in the checkpoint but not in the model" for k in have if k not in model_state]
    if problems:
        raise ValueError(f"checkpoint {path} does not match the model:\n  " + "\n  ".join(problems))


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizers: Iterable[Any] = (),
    strict: bool = True,
    trusted: bool = False,
) -> dict[str, Any]:
    """Load a checkpoint directory into ``model`` (any sharding, or none) and ``optimizers``; return its meta.

    Collective. Nothing in the files is executed unless ``trusted=True`` (needed only for checkpoints whose
    hyper-parameters or callback states hold arbitrary Python objects): a file that refers to other globals
    raises :class:`UnsafeCheckpointError`. Everything is checked against the checkpoint's metadata before
    any value changes, and every piece read is checked against the CRC-32 the save recorded
    (:class:`CheckpointError` names the file, tensor and rank). Optimizer state is matched by parameter name,
    and state the run's optimizers cannot take is an error, never dropped.
    """
    path = atomic.resolve(collective.broadcast_path(path))
    error: Exception | None = None
    applies: list[Any] = []
    try:
        if not is_checkpoint_dir(path):
            raise FileNotFoundError(f"{path} is not a checkpoint directory (no {META_FILE})")
        meta = read_meta(path, trusted=trusted)
        reader = CheckedReader(path, collective.rank(), meta.get("checksums"), trusted=trusted)
        model_state = model.state_dict()
        _check_model(reader.read_metadata().state_dict_metadata, path, model_state, strict)
        targets: dict[str, Any] = {
            "state_dict": {k: v for k, v in model_state.items() if torch.is_tensor(v) or _compat.is_sharded(v)}
        }
        optimizers = list(optimizers)
        saved_opts = meta.get("optimizer_layouts", [])
        if optimizers:
            if len(saved_opts) != len(optimizers):
                raise ValueError(
                    f"the checkpoint holds state for {len(saved_opts)} optimizer(s), this run has {len(optimizers)}"
                    + (" (it was saved with save_weights_only=True)" if not saved_opts else "")
                )
            for i, (opt, saved) in enumerate(zip(optimizers, saved_opts)):
                t, apply = optimizer_targets(model, opt, saved, i)
                if t:
                    targets[f"optimizer_{i}"] = t
                applies.append(apply)
    except Exception as e:  # every rank must hear about it before DCP's collectives
        error = e
    collective.agree(error, f"loading checkpoint {path}")
    _read(targets, reader, path, dcp.DefaultLoadPlanner(allow_partial_load=not strict), not collective.distributed())
    for apply in applies:
        apply()
    meta.pop("checksums", None)
    return meta


def _read(targets: dict[str, Any], reader: CheckedReader, path: Path, planner: Any, alone: bool) -> None:
    """DCP-load ``targets`` in place; ``alone``: this process reads by itself, with no collective."""
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # DCP warns whenever it loads without a process group; here that is the intent, not an accident
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            dcp.load(targets, storage_reader=reader, planner=planner, no_dist=alone)
    except BaseException as e:  # DCP raises CheckpointException, a BaseException
        if isinstance(e, KeyboardInterrupt):
            raise
        raise _unwrap(e, path, "loading checkpoint") from e


def read_checkpoint(path: str | os.PathLike, trusted: bool = False, device: Any = "cpu") -> dict[str, Any]:
    """A checkpoint directory as the dict of a one-process checkpoint file: its meta with ``"state_dict"``
    holding every saved tensor of the model whole (sharded tables assembled) on ``device``.

    Not collective: this process reads every piece alone, with or without a process group (inference in one
    process). Nothing in the files runs unless ``trusted``; every piece is checked against its CRC-32.
    """
    path = atomic.resolve(path)
    if not is_checkpoint_dir(path):
        raise FileNotFoundError(f"{path} is not a checkpoint directory (no {META_FILE})")
    meta = read_meta(path, trusted=trusted)
    reader = CheckedReader(path, collective.rank(), meta.pop("checksums", None), trusted=trusted)
    prefix = "state_dict."
    # tensors only, as load() reads: DCP unpickles other stored values with full pickle, which would run code
    state = {
        k[len(prefix) :]: torch.empty(tuple(m.size), dtype=m.properties.dtype, device=device)
        for k, m in reader.read_metadata().state_dict_metadata.items()
        if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)
    }
    _read({"state_dict": state}, reader, path, dcp.DefaultLoadPlanner(), alone=True)
    meta.pop("format", None)
    return {**meta, "state_dict": state}
