"""Export a trained (sharded) model for inference: its unsharded state_dict, or a ``torch.export`` program.

:func:`export_state_dict` writes one plain ``torch.save`` file of the unsharded state_dict, one table at a time.
The file is what ``torch.save(unsharded_model.state_dict(), path)`` would write: ``torch.load`` it and
``load_state_dict`` it into the unsharded ``EmbeddingBagCollection`` / LightningModule for inference.
It is written without ever holding the whole model on one rank: rank 0 first writes the file's
skeleton with ``torch.serialization.skip_data`` (every record sized, no bytes), then fills each tensor's
record in place as its shards arrive; the other ranks only send their own shards.

:func:`export_program` writes a ``torch.export`` program of the *unsharded* model (``torch.export.save``):
plain tensors in (``dense [B, num_dense]``, ``values [N]``, ``lengths [F * B]`` key-major, as
``KeyedJaggedTensor.lengths()``), tensors out, a dynamic batch and any bag lengths, only aten ops in the
graph (the torch lookup, never fbgemm), so ``torch.export.load`` serves it in a process that has neither
lightning_rec nor fbgemm. :func:`inference_model` is the unsharded CPU copy it traces. Quantized collections
(``export_program(quantize=...)``, or a model quantized already) trace their torch lookup: the stored rows,
dequantized by aten ops. Those live in ``program.py`` and are re-exported here.
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
from lightning_rec.checkpoint import atomic, collective
from lightning_rec.checkpoint.errors import DiskFullError

# the torch.export half of this module's public names
from lightning_rec.program import SIGNATURE_FILE, TensorInputs, export_program, fx_trace, inference_model


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
    """The full tensor of a sharded DTensor on global rank 0 (None elsewhere); shards travel point to point.

    Under 2D every replica group holds the whole table; the one that contains rank 0 sends.
    """
    record = _compat.shard_record(value)
    assert record is not None  # callers pass sharded values only
    if 0 not in record.group_ranks:
        return None
    rank = collective.rank()
    dtype = record.dtype
    wire = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    pieces = _compat.local_pieces(value)
    if rank != 0:
        for _, t in pieces:
            dist.send(_as_bytes(t), dst=0)
        return None
    full = torch.empty(list(value.size()), dtype=dtype)
    local = {tuple(off): t for off, t in pieces}
    for (r, c), (nr, nc), owner in record.shards:
        src = local.get((r, c))
        if src is not None:
            full[r : r + nr, c : c + nc] = src.detach().to("cpu")
        elif nc == full.shape[1] and wire.type == "cpu":
            dist.recv(_as_bytes(full[r : r + nr]), src=owner)  # whole rows: straight into place
        else:
            buf = torch.empty(nr * nc * dtype.itemsize, dtype=torch.uint8, device=wire)
            dist.recv(buf, src=owner)
            full[r : r + nr, c : c + nc] = buf.cpu().view(dtype).view(nr, nc)
    return full


def export_state_dict(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write ``model``'s unsharded state_dict (sharded or not) to ``path`` with ``torch.save``'s format.

    Collective: every rank calls it; rank 0 writes. No rank holds more than one full table beyond its own
    shards. The file appears at ``path`` only when complete.
    """
    path = collective.broadcast_path(path)
    state = model.state_dict()
    rank = collective.rank()
    tmp = atomic.partial_path(path)
    offsets: dict[str, tuple[int, int]] = {}
    error: BaseException | None = None
    handle: Any = None  # rank 0: the open file _skeleton returns
    if rank == 0:
        try:
            handle, offsets = _skeleton(state, path, tmp)
        except Exception as e:  # every rank must hear about it before sending shards
            error = _disk_full(e, tmp, state)
    collective.agree(error, f"exporting {path}")
    index = 0  # storages are numbered in the order the pickler meets them: the state_dict's order
    for key, v in state.items():
        if _compat.is_sharded(v):
            full = _gather_to_zero(v)
        elif torch.is_tensor(v):
            full = v.detach().to("cpu") if rank == 0 else None
        else:
            continue
        if rank == 0 and error is None:
            # after a failure rank 0 still receives every shard, so no sender is left waiting
            try:
                start, size = offsets[str(index)]
                assert full is not None  # rank 0 holds every full tensor
                data = _as_bytes(full)
                if data.numel() != size:
                    raise RuntimeError(f"export of {key!r}: {data.numel()} bytes for a record of {size}")
                handle.seek(start)
                # numpy declares the buffer protocol to type checkers from Python 3.12 on
                handle.write(memoryview(data.numpy()))  # type: ignore[arg-type]
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
    collective.agree(error, f"exporting {path}")
    return path


def _skeleton(state: dict[str, Any], path: Path, tmp: Path) -> tuple[Any, dict[str, tuple[int, int]]]:
    """Rank 0: the file's skeleton at ``tmp`` (every record sized, no bytes), opened for filling in."""
    path.parent.mkdir(parents=True, exist_ok=True)
    skeleton: dict[str, Any] = {}
    for key, v in state.items():
        if _compat.is_sharded(v):
            skeleton[key] = torch.empty(list(v.size()), dtype=_compat.sharded_dtype(v))
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
        need = sum(
            (v.size().numel() * _compat.sharded_dtype(v).itemsize) if _compat.is_sharded(v) else v.nbytes
            for v in state.values()
            if torch.is_tensor(v) or _compat.is_sharded(v)
        )
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

    def __init__(
        self,
        dirpath: str | None = None,
        filename: str = "model-step={step}.pt",
        every_n_epochs: int = 0,
        on_train_end: bool = True,
    ) -> None:
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


__all__ = [
    "SIGNATURE_FILE",
    "ExportStateDict",
    "TensorInputs",
    "export_program",
    "export_state_dict",
    "fx_trace",
    "inference_model",
]
