"""DTensors over a table's shards: built without a collective (:func:`make_dtensor`, on torch's private
``LocalShardsWrapper`` where no DTensor placement describes the tiling), read back piece by piece, and the
private symbols torch.distributed.checkpoint's metadata pickles name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


@dataclass(frozen=True)
class ShardRecord:
    """What lightning_rec notes on the DTensors it makes: the table's dtype, every non-empty shard
    ``(offsets, sizes, global rank)`` and the global ranks of the group the table is sharded over (a table-wise
    DTensor's mesh is its owner alone). Plain values, so state_dicts still pickle and deep-copy."""

    dtype: torch.dtype
    shards: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]
    group_ranks: tuple[int, ...]


_RECORD = "_lightning_rec_shards"


class _Pieces(LocalShardsWrapper):
    """torch's LocalShardsWrapper reporting its pieces' dtype and device, also when it holds none (torch's reports
    the default dtype, and a DTensor over it takes its dtype from there: a float16 table would read as float32)."""

    @staticmethod
    def __new__(
        cls,
        local_shards: list[torch.Tensor],
        local_offsets: list[tuple[int, ...]],
        dtype: torch.dtype | None = None,
        device: Any = None,
    ) -> _Pieces:
        base = LocalShardsWrapper(local_shards, local_offsets)
        if local_shards:
            dtype, device = local_shards[0].dtype, local_shards[0].device
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            base.size(),
            dtype=dtype or torch.get_default_dtype(),
            device=device if device is not None else base.device,
        )
        r._local_shards, r._storage_meta = base._local_shards, base._storage_meta
        return r

    @classmethod  # torch's stubs type __torch_dispatch__ as a plain method of Tensor
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        if func.namespace == "_c10d_functional":
            # torch's wrapper would gather its pieces as if they were Shard(0)'s blocks: wrong sizes, a mismatched
            # collective that aborts the process. Every rank holds one of these, so every rank raises.
            raise RuntimeError(
                "this DTensor holds a table tiled in a way no DTensor placement describes (custom sizes, ranks out "
                "of order, blocks of one host, grids): DTensor collectives (full_tensor, redistribute) do not apply "
                "to it; gather tables with lightning_rec.full_state_dict. torch.distributed.checkpoint reads and "
                "writes it."
            )
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if isinstance(out, LocalShardsWrapper) and not isinstance(out, _Pieces):  # keep dtype and device (views)
            offsets = cast("list[tuple[int, ...]]", out.local_offsets())  # torch.Size tuples
            return _Pieces(out.local_shards(), offsets, args[0].dtype, args[0].device)
        return out

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._local_shards[0].device if self._local_shards else torch.Tensor.device.__get__(self)


def make_dtensor(
    local: list[tuple[Any, list[int]]],
    shards: list[tuple],
    global_size: list[int],
    dtype: Any,
    device: Any,
    process_group: Any,
    placement: tuple[str, int] | None = None,
    mesh: Any = None,
) -> Any:
    """A DTensor over ``local`` pieces ``(tensor, offsets)``; ``shards`` = ``(offsets, sizes, global rank, ...)``
    of every shard of the table.

    ``placement`` says how the layout maps onto DTensor placements: ``("shard", d)`` is ``Shard(d)`` over a 1-D
    mesh of ``process_group`` (the shards are ``torch.chunk``'s blocks along ``d``, in the group's rank order);
    ``("owner", global rank)`` is ``Replicate()`` on a one-rank mesh (a rank outside it holds an empty local
    tensor); ``None`` (any other tiling: uneven or custom offsets, blocks of a host, grids) wraps the local pieces
    with their offsets in torch's ``LocalShardsWrapper`` (the mechanism TorchRec uses; torch.distributed.checkpoint
    reads each piece's offsets from it), on the group's mesh (or ``mesh``). Local pieces share storage with the
    given tensors.
    Runs no collective (meshes are built over existing groups, or without a backend for one rank), so
    ``state_dict()`` may be called on one rank alone. Zero-size shards are left out of the record.
    """
    pieces = [(t, [int(o) for o in off]) for t, off in local if t is not None and t.numel() > 0]
    device = torch.device(device)
    device_type = pieces[0][0].device.type if pieces else device.type
    size = torch.Size(global_size)
    stride = _contiguous_stride(size)
    if placement is not None and placement[0] == "owner":
        # a one-rank mesh needs no process group; building one would be a collective over the world
        mesh = DeviceMesh(device_type, [placement[1]], _init_backend=False)
        value = pieces[0][0] if pieces else torch.empty(0, dtype=dtype, device=device)
        out = DTensor.from_local(value, mesh, [Replicate()], run_check=False, shape=size, stride=stride)
    elif placement is not None:
        mesh = DeviceMesh.from_group(process_group, device_type)
        # a rank without a piece holds torch.chunk's empty tail block
        empty = [0 if d == placement[1] else n for d, n in enumerate(size)]
        value = pieces[0][0] if pieces else torch.empty(empty, dtype=dtype, device=device)
        out = DTensor.from_local(value, mesh, [Shard(placement[1])], run_check=False, shape=size, stride=stride)
    else:
        mesh = mesh if mesh is not None else DeviceMesh.from_group(process_group, device_type)
        wrapper = _Pieces([t for t, _ in pieces], [tuple(off) for _, off in pieces], dtype, device)
        out = DTensor.from_local(wrapper, mesh, [Shard(0)], run_check=False, shape=size, stride=stride)
    record = tuple(
        (tuple(int(o) for o in e[0]), tuple(int(s) for s in e[1]), int(e[2]))
        for e in shards
        if all(s > 0 for s in e[1])
    )
    ranks = (
        torch.distributed.get_process_group_ranks(process_group)
        if process_group is not None
        else mesh.mesh.flatten().tolist()
    )
    setattr(out, _RECORD, ShardRecord(dtype, record, tuple(ranks)))
    return out


def _contiguous_stride(size: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(size):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def is_sharded(x: object) -> bool:
    """Whether ``x`` is a sharded value of a state_dict (a DTensor)."""
    return isinstance(x, DTensor)


def shard_record(x: Any) -> ShardRecord | None:
    """The :class:`ShardRecord` of a DTensor :func:`make_dtensor` made (None for other DTensors)."""
    return getattr(x, _RECORD, None)


def local_pieces(x: Any) -> list[tuple[list[int], torch.Tensor]]:
    """``(offsets, tensor)`` of every non-empty local piece of the DTensor ``x`` (views of its storage)."""
    if x.device_mesh.get_coordinate() is None:
        return []
    local = x._local_tensor  # to_local() is an autograd op; the pieces must stay the live storage
    record = shard_record(x)
    if isinstance(local, LocalShardsWrapper):
        pairs = [([int(o) for o in off], t) for off, t in zip(local.local_offsets(), local.local_shards())]
    elif record is not None:  # ours: the record names this rank's shard (torch's helper needs a real device)
        me = torch.distributed.get_rank()
        pairs = [
            (list(off), local) for off, size, rank in record.shards if rank == me and list(size) == list(local.shape)
        ]
    else:
        _, offsets = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
        pairs = [([int(o) for o in offsets], local)]
    return [(off, t) for off, t in pairs if t.numel() > 0]


def sharded_dtype(x: Any) -> torch.dtype:
    """The element type of a DTensor's values (torch's LocalShardsWrapper alone reports the default dtype)."""
    record = shard_record(x)
    if record is not None:
        return record.dtype
    pieces = local_pieces(x)
    return pieces[0][1].dtype if pieces else x.dtype


#: torch.serialization's private layout decoder, which DCP's metadata pickles name
serialization_get_layout = torch.serialization._get_layout


#: DCP's private record of where a stored piece lives, which its metadata pickles name
DcpStorageInfo = _StorageInfo
