"""2D layout: ``replicas x model_parallel_size`` ranks, as a DeviceMesh ("replicate", "shard"), in one of two
arrangements over the hosts.

- Model parallel within a host (the default): global rank ``g`` sits at ``(g // model_parallel_size,
  g % model_parallel_size)``. A shard group is a contiguous block of ranks (one host by default), a replica
  group takes one rank from each block: the embedding exchanges stay on a host, the replicas' sync crosses.
- Replicas within a host (``replicas_within_host``): ``g`` sits at ``(g % replicas, g // replicas)``. A replica
  group is a contiguous block of ``replicas`` ranks, a shard group takes every ``replicas``-th rank: the sync of
  the replicas stays on a host, the embedding exchanges cross. It pays when the replicas' sync moves more
  bytes than the exchanges (tables pooling many ids per sample); the planner says which
  (``planner.choose_arrangement``).

Within a shard group, a host is ``local_size`` consecutive ranks of the group (table_row_wise and grid_shard
split rows over one host's ranks); in both arrangements a host's ranks of a group are consecutive in it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_rec import _compat


@dataclass(frozen=True)
class MeshInfo:
    """The process groups of one rank. Plans speak in ranks of ``shard_group``.

    ``local_size`` is the number of ranks per host within the shard group (it divides
    ``model_parallel_size``); the planner's ``Topology.from_mesh`` reads it.
    """

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup
    replica_group: dist.ProcessGroup
    model_parallel_size: int
    data_parallel_size: int
    local_size: int = 0  # 0: the whole shard group is one host (set in __post_init__)
    replicas_within_host: bool = False  # the arrangement (module docstring)

    def __post_init__(self) -> None:
        object.__setattr__(self, "local_size", resolve_local_size(self.model_parallel_size, self.local_size or None))

    @property
    def world_size(self) -> int:
        return self.model_parallel_size * self.data_parallel_size


def default_local_size(group_size: int) -> int:
    """Ranks per host: LOCAL_WORLD_SIZE when it divides the group, else the whole group."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", group_size))
    except ValueError:
        local = group_size
    return local if local > 0 and group_size % local == 0 else group_size


def resolve_local_size(group_size: int, ranks_per_host: int | None) -> int:
    """Ranks per host within a group of ``group_size``: ``ranks_per_host`` when it divides the group,
    else the whole group; None: :func:`default_local_size`."""
    if ranks_per_host is None:
        return default_local_size(group_size)
    return ranks_per_host if ranks_per_host > 0 and group_size % ranks_per_host == 0 else group_size


def check_layout(world_size: int, model_parallel_size: int | None, data_parallel_size: int | None) -> tuple[int, int]:
    """Resolve ``(replicas, model_parallel_size)``; either may be None (derived from the other)."""
    if model_parallel_size is None and data_parallel_size is None:
        model_parallel_size = world_size
    if model_parallel_size is None:
        assert data_parallel_size is not None  # both None was handled above
        if data_parallel_size <= 0 or world_size % data_parallel_size:
            raise ValueError(f"data_parallel_size={data_parallel_size} must divide the world size {world_size}")
        model_parallel_size = world_size // data_parallel_size
    if data_parallel_size is None:
        if model_parallel_size <= 0 or world_size % model_parallel_size:
            raise ValueError(f"model_parallel_size={model_parallel_size} must divide the world size {world_size}")
        data_parallel_size = world_size // model_parallel_size
    if model_parallel_size * data_parallel_size != world_size:
        raise ValueError(
            f"Invalid 2D layout: data_parallel_size ({data_parallel_size}) x model_parallel_size "
            f"({model_parallel_size}) != world size ({world_size})"
        )
    return data_parallel_size, model_parallel_size


def group_local_size(ranks_per_host: int, replicas: int, model_parallel_size: int, replicas_within_host: bool) -> int:
    """Ranks of one shard group on one host, given the hosts' ``ranks_per_host``. Replicas within a host need
    ``replicas`` to divide ``ranks_per_host`` (each host holds whole replica groups)."""
    if not replicas_within_host:
        return resolve_local_size(model_parallel_size, ranks_per_host)
    if ranks_per_host <= 0 or ranks_per_host % replicas:
        raise ValueError(
            f"replicas_within_host: the {replicas} replicas of a shard must sit on one host, but a host has "
            f"{ranks_per_host} ranks ({replicas} must divide it)"
        )
    return resolve_local_size(model_parallel_size, ranks_per_host // replicas)


def init_2d_mesh(
    model_parallel_size: int | None = None,
    data_parallel_size: int | None = None,
    device_type: str = "cpu",
    local_size: int | None = None,
    replicas_within_host: bool = False,
) -> MeshInfo:
    """Build the mesh; collective (every rank of the world calls it).

    ``local_size``: ranks per host within the shard group (used when it divides it, else the whole
    group is one host); default LOCAL_WORLD_SIZE as in :func:`default_local_size` (for the default arrangement;
    with ``replicas_within_host``, LOCAL_WORLD_SIZE / replicas). ``replicas_within_host``: the arrangement
    (module docstring).
    """
    replicas, mp = check_layout(dist.get_world_size(), model_parallel_size, data_parallel_size)
    if replicas_within_host and local_size is None:
        local_size = group_local_size(default_local_size(dist.get_world_size()), replicas, mp, True)
    ranks = torch.arange(replicas * mp)
    # mesh[i][j] is the global rank of shard rank j in replica i
    layout = ranks.reshape(mp, replicas).t() if replicas_within_host else ranks.reshape(replicas, mp)
    mesh = DeviceMesh(device_type, layout, mesh_dim_names=("replicate", "shard"))
    shard, replicate = mesh.get_group("shard"), mesh.get_group("replicate")
    # the mesh's groups get torch's default timeout (30 min on gloo): wait what the world waits instead
    world_timeout = _compat.group_timeout()
    for group in (shard, replicate):
        if _compat.group_timeout(group) != world_timeout:
            _compat.set_group_timeout(group, world_timeout)
    return MeshInfo(mesh, shard, replicate, mp, replicas, resolve_local_size(mp, local_size), replicas_within_host)
