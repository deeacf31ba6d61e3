"""This rank's pieces of a collection's tables, placed at sharding time: which shards it holds, and for each the
storage it starts from (a plain parameter, or what a fused kernel's storage is filled from)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from lightning_rec import kernels
from lightning_rec.configs import BaseEmbeddingConfig
from lightning_rec.embedding_modules import Table
from lightning_rec.pipeline.materialize import broadcast_from_first, filler, materialize
from lightning_rec.plans.shard_geometry import ShardMeta

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
