"""2D layout: ``replicas x model_parallel_size`` ranks, as a DeviceMesh ("replicate", "shard").

Global rank ``g`` sits at ``(g // model_parallel_size, g % model_parallel_size)``: a shard group is a
contiguous block of ranks (one host by default), a replica group takes one rank from each block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class MeshInfo:
    """The process groups of one rank. Plans speak in ranks of ``shard_group``."""

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup
    replica_group: dist.ProcessGroup
    model_parallel_size: int
    data_parallel_size: int


def check_layout(world_size: int, model_parallel_size: int | None, data_parallel_size: int | None) -> tuple[int, int]:
    """Resolve ``(replicas, model_parallel_size)``; either may be None (derived from the other)."""
    if model_parallel_size is None and data_parallel_size is None:
        model_parallel_size = world_size
    if model_parallel_size is None:
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
    model_parallel_size: int | None = None, data_parallel_size: int | None = None, device_type: str = "cpu"
) -> MeshInfo:
    """Build the mesh; collective (every rank of the world calls it)."""
    replicas, mp = check_layout(dist.get_world_size(), model_parallel_size, data_parallel_size)
    mesh = init_device_mesh(device_type, (replicas, mp), mesh_dim_names=("replicate", "shard"))
    return MeshInfo(mesh, mesh.get_group("shard"), mesh.get_group("replicate"), mp, replicas)
