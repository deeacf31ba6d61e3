"""This rank's pieces of a collection's tables: placed at sharding time (which shards it holds, and for each the
storage it starts from: a plain parameter, or what a fused kernel's storage is filled from), and seen by the
lookups through views whose backward reduces the gradient over ranks.

The view functions find the rows this rank looks up in each table and hand them to ``collectives.embedding_grad``
(which returns the tables untouched where there is nothing to reduce or scale).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from lightning_rec import kernels
from lightning_rec.configs import BaseEmbeddingConfig
from lightning_rec.embedding_modules import Table
from lightning_rec.pipeline import collectives as comm
from lightning_rec.pipeline.input_dist import Received
from lightning_rec.pipeline.materialize import broadcast_from_first, filler, materialize
from lightning_rec.plans.shard_geometry import ShardMeta
from lightning_rec.sparse import KeyedJaggedTensor

#: a fused kernel table's start: its shape, dtype and initial weights (a tensor or a function filling one)
KernelSource = tuple[tuple[int, int], torch.dtype, torch.Tensor | Callable[[torch.Tensor], object]]


class LocalTables(NamedTuple):
    """What :func:`place_tables` made of one collection on this rank."""

    shards: list[tuple[int, ShardMeta]]  # (table index, shard) held here, table order
    container: kernels.TableContainer  # the plain tables (empty when fused)
    sources: dict[str, KernelSource]  # fused: each kernel table's start, by table name
    replicas: list[tuple[str, dist.ProcessGroup]]  # fused: tables to make equal over these groups once built


def place_tables(
    tables: Sequence[BaseEmbeddingConfig],
    weights: Sequence[torch.Tensor],
    shards: dict[str, list[ShardMeta] | None],
    me: int,
    fused: bool,
    dp_group: dist.ProcessGroup | None,
    replica_group: dist.ProcessGroup | None,
    device: torch.device,
) -> LocalTables:
    """The pieces of ``tables`` (full weights ``weights``) that shard rank ``me`` holds.

    Plain tables are materialized on ``device`` (meta-built tables get only their piece, filled by their
    ``init_fn``) and copies are made equal at once (replicas start equal, as DDP makes dense replicas equal).
    Fused tables only record where their kernel's storage starts from, so no shard-sized copy is made on the
    way; their copies are made equal after the kernel exists.
    """
    held: list[tuple[int, ShardMeta]] = []
    group: dist.ProcessGroup | None
    container = kernels.TableContainer()
    sources: dict[str, KernelSource] = {}
    replicas: list[tuple[str, dist.ProcessGroup]] = []
    for i, (t, full) in enumerate(zip(tables, weights)):
        full = full.detach()
        table_shards = shards[t.name]
        s: ShardMeta | None
        if table_shards is None:
            s, group = None, dp_group
        else:
            mine = [s for s in table_shards if s.rank == me]
            if not mine:
                continue
            (s,) = mine
            group = replica_group
        if fused:
            if s is not None and s.rows == 0:
                continue  # a zero-row shard receives no ids; the fused kernel holds only shards with rows
            shape = tuple(full.shape) if s is None else (s.rows, s.cols)
            sources[t.name] = ((shape[0], shape[1]), full.dtype, filler(t, full, s))
            if group is not None:
                replicas.append((t.name, group))
        else:
            w = materialize(t, full, s, device)
            if group is not None:
                broadcast_from_first(w, group)
            container.add(t.name, Table(w))
        if s is not None:
            held.append((i, s))
    return LocalTables(held, container, sources, replicas)


def dp_lookup_weights(
    weights: list[torch.Tensor],
    kjt: KeyedJaggedTensor,
    feature_table: Sequence[int],
    dp_tables: Sequence[int],
    group: dist.ProcessGroup | None,
    scale: float,
) -> list[torch.Tensor]:
    """The data-parallel tables ``weights`` (tables ``dp_tables``) as the lookup of ``kjt`` sees them: their
    backward sums the rows some rank touched over ``group``. ``feature_table``: each feature's table."""
    opk = kjt.offset_per_key()
    ids = [
        torch.cat([kjt.values()[opk[f] : opk[f + 1]] for f, t in enumerate(feature_table) if t == ti])
        for ti in dp_tables
    ]
    return comm.embedding_grad(weights, ids, group, scale)


def shard_lookup_weights(
    weights: list[torch.Tensor],
    recv: Received,
    my_route_table: Sequence[int],
    replica_group: dist.ProcessGroup | None,
    scale: float,
    device: torch.device,
) -> list[torch.Tensor]:
    """This rank's shards ``weights`` as the lookup of ``recv`` sees them; under 2D replicas their backward sums
    over ``replica_group``. ``my_route_table``: the local shard each received route reads."""
    empty = torch.zeros(0, dtype=torch.long, device=device)
    ids = [empty] * len(weights)
    if replica_group is not None and weights:
        route_ids = torch.split(recv.values, recv.ids_per_route())
        ids = [
            torch.cat([route_ids[j] for j, t in enumerate(my_route_table) if t == k] or [empty])
            for k in range(len(weights))
        ]
    return comm.embedding_grad(weights, ids, replica_group, scale)
