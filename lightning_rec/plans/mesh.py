"""2D layout: ``replicas x model_parallel_size`` ranks, as a DeviceMesh ("replicate", "shard").

Global rank ``g`` sits at ``(g // model_parallel_size, g % model_parallel_size)``: a shard group is a
contiguous block of ranks (one host by default), a replica group takes one rank from each block.
Within a shard group, a host is ``local_size`` consecutive ranks (table_row_wise and grid_shard
split rows over one host's ranks).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

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


def init_2d_mesh(
    model_parallel_size: int | None = None,
    data_parallel_size: int | None = None,
    device_type: str = "cpu",
    local_size: int | None = None,
) -> MeshInfo:
    """Build the mesh; collective (every rank of the world calls it).

    ``local_size``: ranks per host within the shard group (used when it divides it, else the whole
    group is one host); default LOCAL_WORLD_SIZE as in :func:`default_local_size`.
    """
    replicas, mp = check_layout(dist.get_world_size(), model_parallel_size, data_parallel_size)
    mesh = init_device_mesh(device_type, (replicas, mp), mesh_dim_names=("replicate", "shard"))
    shard, replicate = mesh.get_group("shard"), mesh.get_group("replicate")
    # the mesh's groups get torch's default timeout (30 min on gloo): wait what the world waits instead
    world_timeout = _compat.group_timeout()
    for group in (shard, replicate):
        if _compat.group_timeout(group) != world_timeout:
            _compat.set_group_timeout(group, world_timeout)
    return MeshInfo(mesh, shard, replicate, mp, replicas, resolve_local_size(mp, local_size))
