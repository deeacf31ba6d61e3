"""The core every front end calls: the Trainer and Fabric strategies (``lightning/``) and
``DistributedModelParallel`` (``distributed/``) shard a model and hand its dense rest to DDP through these
functions, so a model trains the same under each of them.

Each front end first resolves what every table trains with (``table_optimizers.resolve_table_optimizers``: the
in-backward marks, then its own option: the strategies' ``embedding_optimizer``, the sharders' ``fused_params``)
and its plan; from there the steps are the same: :func:`shard`, then :func:`ignore_in_ddp` before DDP wraps the
model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from lightning_rec import _compat
from lightning_rec.fused_kinds import TableSpecs
from lightning_rec.optim import FusedOptimizer
from lightning_rec.pipeline.qcomm import QuantizedCommCodecs
from lightning_rec.pipeline.shard_modules import ddp_ignored_names, materialize_dense, shard_modules
from lightning_rec.plans.plan import ShardingPlan
from lightning_rec.table_optimizers import mark_fused_tables


class Sharded(NamedTuple):
    """What :func:`shard` made of a model."""

    module: nn.Module  # the model, or its sharded counterpart when the model itself was a collection
    fused: FusedOptimizer | None  # the fused tables' optimizer (None without fused tables)


def shard(
    module: nn.Module,
    plan: ShardingPlan | None,
    table_optimizers: Mapping[str, TableSpecs],
    *,
    process_group: dist.ProcessGroup | None,
    device: torch.device,
    embedding_grad: str,
    replica_group: dist.ProcessGroup | None = None,
    local_size: int | None = None,
    qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] | None = None,
    materialize_as: str | None = None,
) -> Sharded:
    """Shard every collection of ``module`` by ``plan`` (None: the automatic plan of ``shard_modules``) with each
    table's fused spec from ``table_optimizers``; collective.

    ``materialize_as`` (the name a warning gives): a dense part built on the meta device then gets storage on
    ``device`` and its modules' own ``reset_parameters()``; None leaves it for later. The fused tables are marked as
    updated in backward, so ``in_backward_optimizer_filter`` leaves them out of the optimizers built afterwards.
    """
    sharded = shard_modules(
        module,
        plan,
        process_group=process_group,
        replica_group=replica_group,
        device=device,
        embedding_grad=embedding_grad,
        local_size=local_size,
        table_optimizers=table_optimizers,
        qcomm_codecs_registry=qcomm_codecs_registry,
    )
    if materialize_as is not None:
        materialize_dense(sharded, device, materialize_as)
    return Sharded(sharded, mark_fused_tables(sharded))


def ignore_in_ddp(model: nn.Module, module: nn.Module | None = None, also: Sequence[str] = ()) -> bool:
    """Mark what DDP must leave alone on ``model``: the per-rank state of ``module`` (where to look, default
    ``model``: sharded collections, managed-collision remap state) and the names in ``also``. False, marking
    nothing, when nothing dense trains: there is nothing for DDP to do."""
    where = module if module is not None else model
    ignore = ddp_ignored_names(where)
    skip = set(ignore)
    if not any(p.requires_grad for n, p in where.named_parameters() if n not in skip):
        return False
    _compat.ddp_ignore(model, [*ignore, *also])
    return True
