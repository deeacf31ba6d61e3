"""State dicts of sharded collections: ShardedTensors under the unsharded keys, loading, full_state_dict.

A sharded table's ``state_dict`` entry is a ShardedTensor over the whole table whose local shard shares
storage with the live weight (so ``load_state_dict`` writes through); data-parallel tables stay plain
tensors. Placements name the device with its index (``rank:1/cuda:1``), as torch requires.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from lightning_rec import _compat

if TYPE_CHECKING:
    from lightning_rec.sharding.sharded import ShardedCollection


def table_key(module: ShardedCollection, name: str, prefix: str = "") -> str:
    return f"{prefix}{module.table_attr}.{name}.weight"


def placements(module: ShardedCollection, local_device: torch.device) -> list[torch.device]:
    """The device of every shard-group rank, as written into ShardedTensor metadata.

    This rank's is the device its shards live on now; a peer's is the one it reported at sharding time
    when that has the same type (so a CUDA job names each rank's own GPU), else this rank's.
    """
    me = dist.get_rank(module.shard_group)
    out = []
    for r, d in enumerate(module.peer_devices):
        out.append(local_device if r == me or d.type != local_device.type else d)
    return out


def sharded_state_dict_hook(module: ShardedCollection, state_dict: dict, prefix: str, local_metadata: Any) -> dict:
    """Replace each sharded table's local piece by a ShardedTensor over the whole table (same key as unsharded)."""
    ranks, dtypes, local = module.shard_group_ranks, module.table_dtypes, module.local_shards
    device = module.device
    for i, t in enumerate(module.tables):
        shards = module.shards[t.name]
        if shards is None:
            continue
        key = table_key(module, t.name, prefix)
        piece = state_dict.pop(key, None)
        pieces = [(piece, [s.row_offset, s.col_offset]) for j, s in local if j == i and piece is not None]
        here = device if piece is None else piece.device
        devices = placements(module, here)
        state_dict[key] = _compat.make_sharded_tensor(
            pieces,
            [([s.row_offset, s.col_offset], [s.rows, s.cols], ranks[s.rank], devices[s.rank]) for s in shards],
            [t.num_embeddings, t.embedding_dim],
            dtypes[i],
            here,
            module.shard_group,
        )
    return state_dict


def load_hook(module: ShardedCollection, state_dict: dict, prefix: str) -> None:
    """Cut this rank's pieces out of full tensors or matching ShardedTensors, in place in ``state_dict``."""
    for i, t in enumerate(module.tables):
        key = table_key(module, t.name, prefix)
        shards = module.shards[t.name]
        if shards is None or key not in state_dict:
            if shards is None and key in state_dict and _compat.is_sharded_tensor(state_dict[key]):
                raise ValueError(
                    f"table {t.name!r} is data-parallel here but the state_dict holds it sharded; "
                    "gather it first with lightning_rec.sharding.full_state_dict"
                )
            continue
        value = state_dict.pop(key)
        mine = [s for j, s in module.local_shards if j == i]
        shape = [t.num_embeddings, t.embedding_dim]
        if _compat.is_sharded_tensor(value):
            if list(value.size()) != shape:
                raise ValueError(f"table {t.name!r}: state_dict holds shape {list(value.size())}, the model {shape}")
            if not mine:
                continue
            (s,) = mine
            found = [sh.tensor for sh in value.local_shards()
                     if list(sh.metadata.shard_offsets) == [s.row_offset, s.col_offset]
                     and list(sh.metadata.shard_sizes) == [s.rows, s.cols]]
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
                state_dict[key] = value[s.row_offset : s.row_offset + s.rows, s.col_offset : s.col_offset + s.cols]


@runtime_checkable
class _HasTables(Protocol):
    # what full_state_dict needs of a sharded collection (this module sits below sharded.py)
    @property
    def tables(self) -> list: ...
    @property
    def table_attr(self) -> str: ...
    @property
    def peer_devices(self) -> list[torch.device]: ...
    @property
    def device(self) -> torch.device: ...


def _table_devices(model: nn.Module) -> dict[str, torch.device]:
    out = {}
    for path, m in model.named_modules():
        if isinstance(m, _HasTables):
            prefix = f"{path}." if path else ""
            for t in m.tables:
                out[f"{prefix}{m.table_attr}.{t.name}.weight"] = m.device
    return out


def full_state_dict(model: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded state_dict of ``model``: plain full tensors under the unsharded keys.

    Collective: every rank calls it. Full tables are gathered on the device of their collection (the
    collective then runs where the group's backend can: NCCL groups see only CUDA tensors). With
    ``rank0_only`` the result is returned on rank 0 and ``{}`` elsewhere (less memory on the other ranks).
    """
    state = model.state_dict()
    devices = _table_devices(model)
    out = {}
    for key, value in state.items():
        if not _compat.is_sharded_tensor(value):
            out[key] = value
            continue
        group = value._process_group
        dtype = value.metadata().tensor_properties.dtype
        # gloo has no bfloat16 arithmetic; fp32 holds every bf16 value exactly
        wire = torch.float32 if dtype == torch.bfloat16 else dtype
        pieces = value.local_shards()
        device = pieces[0].tensor.device if pieces else devices.get(key, torch.device("cpu"))
        full = torch.zeros(list(value.size()), dtype=wire, device=device)
        for sh in pieces:
            (r, c), (nr, nc) = sh.metadata.shard_offsets, sh.metadata.shard_sizes
            full[r : r + nr, c : c + nc] = sh.tensor.detach().to(wire)
        if rank0_only:
            dist.reduce(full, dst=dist.get_process_group_ranks(group)[0], group=group)
        else:
            dist.all_reduce(full, group=group)
        out[key] = full.to(dtype)
    if rank0_only and dist.get_rank() != 0:
        return {}
    return out
