"""The tables as a sharded collection's lookups see them: views whose backward reduces the gradient over ranks.

Each function finds the rows this rank looks up in each table and hands them to ``collectives.embedding_grad``
(which returns the tables untouched where there is nothing to reduce or scale).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_rec.pipeline import collectives as comm
from lightning_rec.pipeline.input_dist import Received
from lightning_rec.sparse import KeyedJaggedTensor

__all__ = ["dp_lookup_weights", "shard_lookup_weights"]


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
