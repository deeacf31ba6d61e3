"""State dicts of sharded collections: DTensors under the unsharded keys, loading, full_state_dict.

A sharded table's ``state_dict`` entry is a ``torch.distributed.tensor.DTensor`` over the whole table whose
local piece shares storage with the live weight (so ``load_state_dict`` and DCP loads write through);
data-parallel tables stay plain tensors. Placements per tiling: :func:`table_dtensor`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from lightning_rec import _compat
from lightning_rec.pipeline import collectives as comm
from lightning_rec.plans import shard_geometry
from lightning_rec.plans.shard_geometry import ShardMeta


@runtime_checkable
class _HasTables(Protocol):
    # what full_state_dict needs of a sharded collection (this module sits below sharded_collection.py)
    @property
    def tables(self) -> list: ...
    @property
    def table_attr(self) -> str: ...
    @property
    def shard_group(self) -> Any: ...
    @property
    def device(self) -> torch.device: ...


class _ShardedTables(_HasTables, Protocol):
    # what the state_dict hooks need of a sharded collection
    @property
    def table_dtypes(self) -> list[torch.dtype]: ...
    @property
    def local_shards(self) -> list[tuple[int, ShardMeta]]: ...
    @property
    def shards(self) -> dict[str, list[ShardMeta] | None]: ...


def table_key(module: _ShardedTables, name: str, prefix: str = "") -> str:
    return f"{prefix}{module.table_attr}.{name}.weight"


def table_dtensor(
    pieces: list[tuple[torch.Tensor | None, list[int]]],
    shards: list[ShardMeta],
    shape: list[int],
    dtype: torch.dtype,
    device: torch.device,
    group: Any,
) -> Any:
    """A DTensor over a table tiled by ``shards`` (shard-group ranks) from this rank's ``pieces`` (tensor, offsets).

    Placements follow :func:`shard_geometry.dtensor_placement`: ``Shard(0)`` / ``Shard(1)`` over the shard group
    where the tiling is ``torch.chunk``'s, ``Replicate()`` on the owner's one-rank mesh for a whole table, local pieces
    with offsets otherwise. The pieces share storage with the given tensors.
    """
    ranks = dist.get_process_group_ranks(group)
    where = shard_geometry.dtensor_placement(shards, shape[0], shape[1], len(ranks))
    if where is not None and where[0] == "owner":
        where = ("owner", ranks[where[1]])
    described = [([s.row_offset, s.col_offset], [s.rows, s.cols], ranks[s.rank]) for s in shards]
    return _compat.make_dtensor(pieces, described, shape, dtype, device, group, where)


def sharded_state_dict_hook(module: _ShardedTables, state_dict: dict, prefix: str, local_metadata: Any) -> dict:
    """Replace each sharded table's local piece by a DTensor over the whole table (same key as unsharded)."""
    dtypes, local, device = module.table_dtypes, module.local_shards, module.device
    for i, t in enumerate(module.tables):
        shards = module.shards[t.name]
        if shards is None:
            continue
        key = table_key(module, t.name, prefix)
        piece = state_dict.pop(key, None)
        pieces = [(piece, [s.row_offset, s.col_offset]) for j, s in local if j == i and piece is not None]
        state_dict[key] = table_dtensor(
            pieces,
            shards,
            [t.num_embeddings, t.embedding_dim],
            dtypes[i],
            device if piece is None else piece.device,
            module.shard_group,
        )
    return state_dict


def load_hook(module: _ShardedTables, state_dict: dict, prefix: str) -> None:
    """Cut this rank's pieces out of full tensors or DTensors sharded the same way, in place in ``state_dict``."""
    for i, t in enumerate(module.tables):
        key = table_key(module, t.name, prefix)
        shards = module.shards[t.name]
        if shards is None or key not in state_dict:
            if shards is None and key in state_dict and _compat.is_sharded(state_dict[key]):
                raise ValueError(
                    f"table {t.name!r} is data-parallel here but the state_dict holds it sharded; "
                    "gather it first with lightning_rec.sharding.full_state_dict"
                )
            continue
        value = state_dict.pop(key)
        mine = [s for j, s in module.local_shards if j == i]
        shape = [t.num_embeddings, t.embedding_dim]
        if _compat.is_sharded(value):
            if list(value.size()) != shape:
                raise ValueError(f"table {t.name!r}: state_dict holds shape {list(value.size())}, the model {shape}")
            if not mine:
                continue
            (s,) = mine
            found = [
                t
                for off, t in _compat.local_pieces(value)
                if off == [s.row_offset, s.col_offset] and list(t.shape) == [s.rows, s.cols]
            ]
            if not found:
                if s.rows == 0:
                    continue
                raise ValueError(
                    f"table {t.name!r}: the state_dict was sharded differently from this model; load it through "
                    "torch.distributed.checkpoint or pass full tensors (full_state_dict)"
                )
            state_dict[key] = found[0]
        else:
            if list(value.shape) != shape:
                raise ValueError(
                    f"table {t.name!r}: state_dict holds shape {list(value.shape)}, the model expects {shape}"
                )
            if mine:
                (s,) = mine
                state_dict[key] = s.of(value)


def _tables(model: nn.Module) -> dict[str, tuple[torch.device, Any]]:
    """``{state_dict key: (device, shard group)}`` of every table of every sharded collection in ``model``."""
    out = {}
    for path, m in model.named_modules():
        if isinstance(m, _HasTables):
            prefix = f"{path}." if path else ""
            for t in m.tables:
                out[f"{prefix}{m.table_attr}.{t.name}.weight"] = (m.device, m.shard_group)
    return out


def full_state_dict(model: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded state_dict of ``model``: plain full tensors under the unsharded keys.

    Collective: every rank calls it. Full tables are gathered on the device of their collection and returned
    there; CPU tables under an NCCL group (Lightning moves the module to the CPU when fit ends) are gathered
    through the current CUDA device, since NCCL sees only CUDA tensors. With
    ``rank0_only`` the result is returned on rank 0 and ``{}`` elsewhere (less memory on the other ranks).
    """
    model = _compat.unwrap_module(model)  # Fabric's and DDP's wrappers keep the model's keys, not its paths
    state = model.state_dict()
    tables = _tables(model)
    out = {}
    for key, value in state.items():
        if not _compat.is_sharded(value):
            out[key] = value
            continue
        if key not in tables:
            raise ValueError(f"state_dict entry {key!r} is a DTensor but no sharded collection of the model owns it")
        device, group = tables[key]
        dtype = _compat.sharded_dtype(value)
        # gloo has no bfloat16 arithmetic; fp32 holds every bf16 value exactly
        wire = torch.float32 if dtype == torch.bfloat16 else dtype
        pieces = _compat.local_pieces(value)
        here = pieces[0][1].device if pieces else device
        # Lightning moves the module to the CPU when fit ends, while its process group stays NCCL
        there = comm.collective_device(group) if here.type == "cpu" else here
        full = torch.zeros(list(value.size()), dtype=wire, device=there)
        for (r, c), t in pieces:
            full[r : r + t.shape[0], c : c + t.shape[1]] = t.detach().to(there, wire)
        if rank0_only:
            dist.reduce(full, dst=dist.get_process_group_ranks(group)[0], group=group)
        else:
            dist.all_reduce(full, group=group)
        out[key] = full.to(here, dtype)
    if rank0_only and dist.get_rank() != 0:
        return {}
    return out
