"""Gradient clipping by norm whose answer does not depend on the sharding plan.

``torch.nn.utils.clip_grad_norm_`` on a sharded model sees only this rank's pieces of the model-parallel
tables, so every rank would compute its own norm and scale by its own factor: training would then differ from
one process (and replicas of the dense part would drift apart). Here the norm covers every table once:
this rank's shards are reduced over the shard group (each shard is held once per group; under 2D every
replica group holds the same shards with the same, already summed, gradients), while replicated parameters
(dense layers and data-parallel tables, whose gradients are synced before clipping) count locally.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from lightning_rec.pipeline.shard_modules import sharded_collections


def _norm_power(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """``sum |g|^p`` (``max |g|`` for the inf norm) over ``grads``, in float64 so the sum does not round."""
    out = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        v = (g.coalesce().values() if g.is_sparse else g).detach().to(torch.float64)
        if v.numel() == 0:
            continue
        out = torch.maximum(out, v.abs().max()) if math.isinf(norm_type) else out + v.abs().pow(norm_type).sum()
    return out


def clip_grad_norm_(
    model: nn.Module, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Scale the gradients of ``parameters`` so their total norm (over every rank's shards) is at most ``max_norm``.

    ``model`` is the sharded model the parameters belong to; returns the total norm. Collective: every rank
    of the model's shard groups must call it, with the same collections (as every rank has).
    """
    params = [p for p in parameters if p.grad is not None]  # below, p.grad is never None
    device = cast(torch.Tensor, params[0].grad).device if params else torch.device("cpu")
    owned = {id(p) for p in params}
    shard_ids: set[int] = set()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for _, coll in sharded_collections(model):
        weights = coll.shard_weights()
        shard_ids.update(id(w) for w in weights)
        part = _norm_power([w.grad for w in weights if id(w) in owned and w.grad is not None], norm_type, device)
        if dist.get_world_size(coll.shard_group) > 1:
            op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
            dist.all_reduce(part, op=op, group=coll.shard_group)
        total = torch.maximum(total, part) if math.isinf(norm_type) else total + part
    local = _norm_power([cast(torch.Tensor, p.grad) for p in params if id(p) not in shard_ids], norm_type, device)
    total = torch.maximum(total, local) if math.isinf(norm_type) else total + local
    norm = total if math.isinf(norm_type) else total.pow(1.0 / norm_type)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        grad = cast(torch.Tensor, p.grad)
        grad.mul_(coef.to(grad.dtype))
    return norm.float()
