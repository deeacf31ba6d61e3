"""Export a sharded model as one plain ``torch.save`` file of its unsharded state_dict, one table at a time.

The file is what ``torch.save(unsharded_model.state_dict(), path)`` would write: ``torch.load`` it and
``load_state_dict`` it into the unsharded ``EmbeddingBagCollection`` / LightningModule for inference.
It is written without ever holding the whole model on one rank: rank 0 first writes the file's
skeleton with ``torch.serialization.skip_data`` (every record sized, no bytes), then fills each tensor's
record in place as its shards arrive; the other ranks only send their own shards.
"""

from __future__ import annotations

import errno
import os
import zipfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn

from lightning_rec import _compat
from lightning_rec.checkpoint import atomic
from lightning_rec.checkpoint.errors import DiskFullError


def _record_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """``{storage key: (byte offset, size)}`` of the ``data/<key>`` records of a torch.save zip file."""
    out = {}
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for info in z.infolist():
            parent, _, key = info.filename.rpartition("/")
            if not parent.endswith("/data") or info.compress_type != zipfile.ZIP_STORED:
                continue
            f.seek(info.header_offset)
            header = f.read(30)
            name_len = int.from_bytes(header[26:28], "little")
            extra_len = int.from_bytes(header[28:30], "little")
            out[key] = (info.header_offset + 30 + name_len + extra_len, info.file_size)
    return out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _gather_to_zero(value: Any) -> torch.Tensor | None:
    """The full tensor of a ShardedTensor on global rank 0 (None elsewhere); shards travel point to point.

    Under 2D every replica group holds the whole table; the one that contains rank 0 sends.
    """
    group = value._process_group
    if 0 not in dist.get_process_group_ranks(group):
        return None
    rank = atomic.rank()
    dtype = value.metadata().tensor_properties.dtype
    wire = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    if rank != 0:
        for sh in value.local_shards():
            dist.send(_as_bytes(sh.tensor), dst=0)
        return None
    full = torch.empty(list(value.size()), dtype=dtype)
    local = {tuple(sh.metadata.shard_offsets): sh.tensor for sh in value.local_shards()}
    for m in value.metadata().shards_metadata:
        (r, c), (nr, nc) = m.shard_offsets, m.shard_sizes
        src = local.get((r, c))
        if src is not None:
            full[r : r + nr, c : c + nc] = src.detach().to("cpu")
        elif nc == full.shape[1] and wire.type == "cpu":
            dist.recv(_as_bytes(full[r : r + nr]), src=m.placement.rank())  # whole rows: straight into place
        else:
            buf = torch.empty(nr * nc * dtype.itemsize, dtype=torch.uint8, device=wire)
            dist.recv(buf, src=m.placement.rank())
            full[r : r + nr, c : c + nc] = buf.cpu().view(dtype).view(nr, nc)
    return full


def export_state_dict(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write ``model``'s unsharded state_dict (sharded or not) to ``path`` with ``torch.save``'s format.

    Collective: every rank calls it; rank 0 writes. No rank holds more than one full table beyond its own
    shards. The file appears at ``path`` only when complete.
    """
    path = atomic.broadcast_path(path)
    state = model.state_dict()
    rank = atomic.rank()
    tmp = atomic.partial_path(path)
    offsets: dict[str, tuple[int, int]] = {}
    error: BaseException | None = None
    handle = None
    if rank == 0:
        try:
            handle, offsets = _skeleton(state, path, tmp)
        except Exception as e:  # every rank must hear about it before sending shards
            error = _disk_full(e, tmp, state)
    atomic.agree(error, f"exporting {path}")
    index = 0  # storages are numbered in the order the pickler meets them: the state_dict's order
    for key, v in state.items():
        if _compat.is_sharded_tensor(v):
            full = _gather_to_zero(v)
        elif torch.is_tensor(v):
            full = v.detach().to("cpu") if rank == 0 else None
        else:
            continue
        if rank == 0 and error is None:
            # after a failure rank 0 still receives every shard, so no sender is left waiting
            try:
                start, size = offsets[str(index)]
                data = _as_bytes(full)
                if data.numel() != size:
                    raise RuntimeError(f"export of {key!r}: {data.numel()} bytes for a record of {size}")
                handle.seek(start)
                handle.write(memoryview(data.numpy()))
                del data
            except Exception as e:  # reported to every rank below
                error = _disk_full(e, tmp, state)
        del full
        index += 1
    if rank == 0:
        try:
            handle.close()
            if error is None:
                os.replace(tmp, path)
        except Exception as e:  # reported to every rank below
            error = error or _disk_full(e, tmp, state)
        if error is not None:
            atomic.remove(tmp)
    atomic.agree(error, f"exporting {path}")
    return path


def _skeleton(state: dict[str, Any], path: Path, tmp: Path) -> tuple[Any, dict[str, tuple[int, int]]]:
    """Rank 0: the file's skeleton at ``tmp`` (every record sized, no bytes), opened for filling in."""
    path.parent.mkdir(parents=True, exist_ok=True)
    skeleton: dict[str, Any] = {}
    for key, v in state.items():
        if _compat.is_sharded_tensor(v):
            skeleton[key] = torch.empty(list(v.size()), dtype=v.metadata().tensor_properties.dtype)
        elif torch.is_tensor(v):
            skeleton[key] = torch.empty(v.shape, dtype=v.dtype)
        else:
            skeleton[key] = v
    with torch.serialization.skip_data():
        torch.save(skeleton, tmp)
    del skeleton  # never touched, but let the allocator have it back before tables arrive
    return open(tmp, "r+b"), _record_offsets(tmp)  # closed by the caller, after every tensor is filled


def _disk_full(e: Exception, tmp: Path, state: dict[str, Any]) -> Exception:
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        need = sum((v.size().numel() * v.metadata().tensor_properties.dtype.itemsize)
                   if _compat.is_sharded_tensor(v) else v.nbytes for v in state.values()
                   if torch.is_tensor(v) or _compat.is_sharded_tensor(v))
        return DiskFullError(tmp, need, 0)
    return e


class ExportStateDict(L.Callback):
    """Write a consolidated, unsharded ``state_dict`` file for inference during and/or after training.

    Args:
        dirpath: directory of the files (default: the trainer's ``default_root_dir``).
        filename: file name; ``{epoch}`` and ``{step}`` are filled in.
        every_n_epochs: also export at the end of every n-th training epoch (0: never).
        on_train_end: export when training ends.

    The file loads with ``torch.load`` into the unsharded module: ``model.load_state_dict(torch.load(path))``.
    """

    def __init__(self, dirpath: str | None = None, filename: str = "model-step={step}.pt", every_n_epochs: int = 0,
                 on_train_end: bool = True) -> None:
        self.dirpath = dirpath
        self.filename = filename
        self.every_n_epochs = every_n_epochs
        self.export_on_train_end = on_train_end
        self.last_path: Path | None = None
        self._last_step = -1

    def _export(self, trainer: L.Trainer, module: L.LightningModule, epoch: int) -> None:
        if trainer.global_step == self._last_step:
            return  # the weights were exported at this step already
        name = self.filename.format(epoch=epoch, step=trainer.global_step)
        self.last_path = export_state_dict(module, Path(self.dirpath or trainer.default_root_dir) / name)
        self._last_step = trainer.global_step

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.every_n_epochs and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self._export(trainer, pl_module, trainer.current_epoch)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.export_on_train_end:
            self._export(trainer, pl_module, max(trainer.current_epoch - 1, 0))
