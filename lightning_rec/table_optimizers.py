"""Which optimizer updates each embedding table under the strategy: in-backward marks, and tables none updates.

TorchRec users mark tables with ``apply_optimizer_in_backward(RowWiseAdagrad, model.ebc.parameters(), {...})``
(ours or torch's): ``DistributedModelParallel`` turns that mark into the fused kernel's optimizer, and so must
the Lightning strategy, or the tables silently never change.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_rec.distributed.optimizers import in_backward_spec
from lightning_rec.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from lightning_rec.fused_kinds import FusedOptimizerSpec
from lightning_rec.pipeline.shard_modules import sharded_collections
from lightning_rec.plans.planner import Planner, PlanReport


def marked_embedding_optimizer(module: nn.Module, given: FusedOptimizerSpec | None) -> FusedOptimizerSpec | None:
    """The fused spec the collections of ``module`` train with: ``given``, or the one their in-backward marks name.

    Raises naming the collections when marks disagree with each other or with ``given``, or when some
    collections are marked and others not (one fused optimizer serves every collection, or none).
    """
    found = {
        path or "<root>": in_backward_spec(m)
        for path, m in module.named_modules()
        if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))
    }
    marked = {p: s for p, s in found.items() if s is not None}
    if not marked:
        return given
    if len(set(marked.values())) > 1:
        raise ValueError(
            f"rec_sharded: the collections' in-backward optimizers differ ({marked}); one fused "
            "optimizer serves every collection: mark them all alike"
        )
    sequence = sorted(p or "<root>" for p, m in module.named_modules() if isinstance(m, EmbeddingCollection))
    if sequence:
        raise ValueError(
            f"rec_sharded: collections {sorted(marked)} carry an in-backward optimizer "
            f"(apply_optimizer_in_backward), which becomes a fused kernel for every collection, but "
            f"the fused kernels pool and cannot serve the EmbeddingCollections {sequence}; train the "
            "tables with torch optimizers instead (remove the marks)"
        )
    unmarked = sorted(p for p, s in found.items() if s is None)
    if unmarked:
        raise ValueError(
            f"rec_sharded: collections {sorted(marked)} carry an in-backward optimizer "
            f"(apply_optimizer_in_backward) but {unmarked} do not; one fused optimizer serves every "
            "collection: mark them all, or none and give RecShardedStrategy(embedding_optimizer=...)"
        )
    spec = next(iter(marked.values()))
    if given is not None and given != spec:
        raise ValueError(
            f"rec_sharded: embedding_optimizer={given} differs from the tables' in-backward optimizer "
            f"{spec} (apply_optimizer_in_backward); give one of them"
        )
    return spec


def warn_unoptimized_tables(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> list[str]:
    """Warn once (on global rank 0) naming every sharded table that trains but no optimizer updates.

    Collective over the world: each rank holds only its own shards. Returns the names warned about.
    """
    held = {id(p) for o in optimizers for g in o.param_groups for p in g["params"]}
    mine = sorted(
        {
            f"{path}.{n}" if path else n
            for path, c in sharded_collections(module)
            for n, p in c.named_parameters()
            if p.requires_grad and id(p) not in held
        }
    )
    names = mine
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[list[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        names = sorted({n for g in gathered for n in g or []})
    if names and (not dist.is_initialized() or dist.get_rank() == 0):
        warnings.warn(
            f"rec_sharded: no optimizer updates the embedding tables {names}: they keep their initial values. "
            "Pass their parameters to an optimizer in configure_optimizers, give "
            "RecShardedStrategy(embedding_optimizer=...), or mark them with apply_optimizer_in_backward",
            stacklevel=2,
        )
    return names


# torch optimizer class -> the planner's optimizer kind (its state size); a fused optimizer's kind is its spec's
# (lightning_rec.fused_kinds.FUSED_KINDS)
_OPTIMIZER_KINDS = {
    "SGD": "sgd",
    "Adagrad": "adagrad",
    "Adam": "adam",
    "AdamW": "adam",
    "SparseAdam": "adam",
    "LAMB": "lamb",
}


def _local_kind(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> str | None:
    tables = {id(p) for _, c in sharded_collections(module) for p in c.parameters()}
    parts = [p for o in optimizers for p in (o.optimizers if hasattr(o, "optimizers") else [o]) if p is not None]
    for part in parts:
        kernels = getattr(part, "kernels", None)  # a FusedOptimizer: its kernels' spec says what they keep
        if kernels:
            return kernels[0].spec.kind
    for part in parts:
        # the optimizer holding the tables, not the first one: a dense Adam beside an Adagrad of the tables
        # would report Adam's state for every table
        if any(id(p) in tables for g in part.param_groups for p in g["params"]):
            name = type(part).__name__
            if name == "SGD" and any(g.get("momentum", 0) for g in part.param_groups):
                return "momentum"
            return _OPTIMIZER_KINDS.get(name)
    return None


def tables_optimizer_kind(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> str | None:
    """The planner's optimizer kind (``Planner(optimizer=...)``) of the sharded tables of ``module``: the fused
    optimizer's kind, else that of the torch optimizer holding the tables' parameters; None if none is known.

    Collective over the world where a process group exists (a rank may hold no table, hence no optimizer of one).
    """
    kind = _local_kind(module, optimizers)
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, kind)
        kind = next((k for k in gathered if k is not None), None)
    return kind


def automatic_plan_report(
    planner: Planner, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]
) -> PlanReport:
    """The report of the plan ``planner`` chose for ``module`` (now sharded), for the tables' real optimizer.

    The strategy plans before ``configure_optimizers`` runs, so the planner may have assumed another optimizer's
    state: then the placements are re-estimated with the tables' optimizer (keeping each runner-up), so this
    report and ``ShardingSummary``'s name the same optimizer and memory. Collective (``tables_optimizer_kind``).
    """
    chosen = planner.explain()
    kind = tables_optimizer_kind(module, optimizers)
    if kind is None or kind == planner.optimizer:
        return chosen
    planned, planner.optimizer = planner.optimizer, kind
    report = planner.estimate(module)
    for new, old in zip(report.tables, chosen.tables):
        new.fixed, new.runner_up, new.rejected_because = old.fixed, old.runner_up, old.rejected_because
    report.notes = [
        *chosen.notes,
        f"placed assuming optimizer={planned} (the optimizers did not exist yet); the "
        f"estimates here are for the tables' optimizer, {kind}",
    ]
    return report
