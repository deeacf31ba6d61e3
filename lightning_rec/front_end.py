"""The core every front end calls: the Trainer and Fabric strategies (``lightning/``) and
``DistributedModelParallel`` (``distributed/``) decide which optimizer updates each embedding table, shard a model
and hand its dense rest to DDP through these functions, so a model trains the same under each of them.

Each front end first resolves what every table trains with (:func:`resolve_table_optimizers`: the in-backward
marks, then its own option: the strategies' ``embedding_optimizer``, the sharders' ``fused_params``). TorchRec
users mark tables with ``apply_optimizer_in_backward(RowWiseAdagrad, model.ebc.parameters(), {...})`` (ours or
torch's), often twice (row-wise Adagrad on the big tables, SGD on the rest); every front end turns those marks into
fused kernels, or the tables would silently never change. With its plan, the steps are then the same:
:func:`shard` (the fused tables marked as updated in backward; it returns the plan the tables are sharded by,
ranks filled in), then :func:`ignore_in_ddp` before DDP wraps the model. ``DistributedModelParallel`` merges its
sharders' quantized-comms registries into one (:func:`sharders_qcomm_registry`, under the rule ``shard_modules``
applies to a single registry) and, wrapping DDP later, initialises and moves the dense part then
(:func:`init_dense`, :func:`move_dense`). Once the optimizers exist, :func:`warn_unoptimized_tables` names the
tables none updates, and the planner is told the tables' real optimizer (:func:`tables_optimizer_kind`,
:func:`automatic_plan_report`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from lightning_rec import _compat
from lightning_rec.distributed.optimizers import in_backward_specs
from lightning_rec.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from lightning_rec.fused_kinds import (
    EmbeddingOptimizer,
    FusedOptimizerSpec,
    PerTableOptimizers,
    TableSpecs,
    as_table_optimizers,
    named_tables,
    spec_of,
)
from lightning_rec.optim import FusedOptimizer
from lightning_rec.pipeline.output_dist import CommOp, QuantizedCommCodecs, pooled_codecs, refuse_sequence_codecs
from lightning_rec.pipeline.shard_modules import (
    ddp_ignored_names,
    fused_optimizer,
    materialize_dense,
    shard_modules,
    sharded_collections,
)
from lightning_rec.plans.kinds import placement_of
from lightning_rec.plans.mesh import default_local_size
from lightning_rec.plans.plan import ShardingPlan, with_resolved_ranks
from lightning_rec.plans.planner import Planner, PlanReport


def _collections(module: nn.Module) -> list[tuple[str, nn.Module, list[str]]]:
    """``(path, collection, table names)`` of every unsharded collection of ``module``."""
    found: list[tuple[str, nn.Module, list[str]]] = []
    for path, m in module.named_modules():
        # exact types, as shard_modules picks the collections it shards
        if type(m) is EmbeddingBagCollection:
            found.append((path, m, [t.name for t in m.embedding_bag_configs()]))
        elif type(m) is EmbeddingCollection:
            found.append((path, m, [t.name for t in m.embedding_configs()]))
    return found


def resolve_table_optimizers(
    module: nn.Module,
    given: EmbeddingOptimizer | None,
    by_type: Mapping[type, FusedOptimizerSpec | None] | None = None,
    given_name: str = "embedding_optimizer",
) -> dict[str, TableSpecs]:
    """``{collection path: {table: fused spec or None}}``: what every table of ``module`` trains with.

    One rule for the strategies and ``DistributedModelParallel``: a table's in-backward mark
    (``apply_optimizer_in_backward``) wins; otherwise the sharder's ``fused_params`` for its module type
    (``by_type``), otherwise ``given`` (one spec, or :class:`PerTableOptimizers`). A mark that disagrees
    with the other source raises, naming the table (a ``PerTableOptimizers`` default only fills in).
    Tables sharing a spec share a kernel, so any mix of kinds and hyper-parameters works, pooled and sequence
    collections alike; within one collection every table is fused or none is (raises naming the others).
    """
    given = as_table_optimizers(given)
    found = _collections(module)
    known = {name for _, _, names in found for name in names}
    unknown = sorted(n for n in named_tables(given) if n not in known)
    if unknown:
        raise ValueError(
            f"{given_name} names tables {unknown} that no embedding collection of the model has; "
            f"its tables: {sorted(known)}"
        )
    out: dict[str, TableSpecs] = {}
    for path, m, names in found:
        where = path or "<root>"
        marks = in_backward_specs(m)
        other = (by_type or {}).get(type(m)) if by_type is not None else None
        specs: TableSpecs = {}
        for name in names:
            fallback = other if by_type is not None else spec_of(given, name)
            # a PerTableOptimizers default only fills in: a mark may differ from it
            explicit = not (isinstance(given, PerTableOptimizers) and name not in given.tables)
            mark = marks[name]
            if mark is not None and fallback is not None and mark != fallback and explicit:
                source = "the sharder's fused_params" if by_type is not None else given_name
                raise ValueError(
                    f"collection {where!r}, table {name!r}: its in-backward optimizer {mark} "
                    f"(apply_optimizer_in_backward) differs from {source} {fallback}; give one of them"
                )
            specs[name] = mark if mark is not None else fallback
        fused = sorted(n for n, s in specs.items() if s is not None)
        plain = sorted(n for n, s in specs.items() if s is None)
        if fused and plain:
            raise ValueError(
                f"collection {where!r}: tables {fused} have a fused optimizer but {plain} do not; a collection's "
                "tables are all fused or none: mark the others too (apply_optimizer_in_backward, any optimizer), "
                f"give them one in {given_name}, or put them in a collection of their own"
            )
        out[path] = specs
    return out


def mark_fused_tables(module: nn.Module) -> FusedOptimizer | None:
    """The fused optimizer of ``module``'s sharded tables, set as their in-backward optimizer (as DMP does), so
    that ``in_backward_optimizer_filter`` leaves them out of the optimizers a user builds afterwards."""
    fused = fused_optimizer(module)
    for p in [] if fused is None else [p for g in fused.param_groups for p in g["params"]]:
        p._in_backward_optimizers = [fused]  # type: ignore[attr-defined]  # TorchRec's attribute name
    return fused


class Sharded(NamedTuple):
    """What :func:`shard` made of a model."""

    module: nn.Module  # the model, or its sharded counterpart when the model itself was a collection
    fused: FusedOptimizer | None  # the fused tables' optimizer (None without fused tables)
    plan: ShardingPlan  # every sharded collection's placements, ranks and TorchRec's sharding_spec filled in


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
    ``device`` and its modules' own ``reset_parameters()``; None leaves it for later (:func:`init_dense`). The fused
    tables are marked as updated in backward, so ``in_backward_optimizer_filter`` leaves them out of the optimizers
    built afterwards. The returned plan is the one the tables are sharded by: each placement of ``plan``, or for a
    collection it leaves out the automatic plan's, with its ranks and ``sharding_spec`` on ``device`` filled in.
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
    return Sharded(sharded, mark_fused_tables(sharded), _resolved_plan(sharded, plan, device.type, local_size))


def _resolved_plan(
    model: nn.Module, plan: ShardingPlan | None, device_type: str, local_size: int | None
) -> ShardingPlan:
    out = {}
    for path, m in sharded_collections(model):
        gsize = dist.get_world_size(m.shard_group)
        # the local size shard_modules resolved the placements with
        local = local_size if local_size is not None else default_local_size(gsize)
        given = plan.get_plan_for_module(path) if plan is not None else None
        out[path] = {
            t.name: with_resolved_ranks(
                t,
                # a collection the plan leaves out: its placement read back from its shards (the automatic plan's)
                given[t.name] if given else placement_of(m.shards[t.name], gsize, local),
                gsize,
                local,
                device_type,
            )
            for t in m.tables
        }
    return ShardingPlan(out)


def check_qcomm_registry(
    registry: Mapping[str, QuantizedCommCodecs] | None,
) -> dict[str, QuantizedCommCodecs] | None:
    """A copy of a sharder's ``qcomm_codecs_registry`` (None where empty), checked as ``shard_modules`` checks it:
    unknown collectives, values that are not ``QuantizedCommCodecs`` and pooled collectives with different codecs
    raise."""
    pooled_codecs(registry)
    return dict(registry) if registry else None


def sharders_qcomm_registry(
    pooled: Mapping[str, QuantizedCommCodecs] | None, sequence: Mapping[str, QuantizedCommCodecs] | None
) -> dict[str, QuantizedCommCodecs] | None:
    """The one registry :func:`shard` takes, from TorchRec's per-sharder ones: ``pooled`` (the
    EmbeddingBagCollection sharder's) gives the pooled collectives' codecs; ``sequence`` (the EmbeddingCollection
    sharder's) may not quantize the sequence all-to-all (``output_dist.refuse_sequence_codecs``, the rule
    ``shard_modules`` applies to its registry). As in TorchRec, each sharder's entries for the other kind's
    collectives are unused."""
    refuse_sequence_codecs(
        sequence, "the EmbeddingCollections", "the EmbeddingCollection sharder's qcomm_codecs_registry"
    )
    kept = {op: c for op, c in (pooled or {}).items() if op != CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL.value}
    return kept or None


def init_dense(model: nn.Module, device: torch.device, who: str) -> None:
    """What :func:`shard`'s ``materialize_as`` does, for a front end that initialises later: the dense part's
    meta-device parameters and buffers get storage on ``device`` and their modules' own ``reset_parameters()``
    (``who`` names the front end in the warning about buffers left as zeros)."""
    materialize_dense(model, device, who)


def move_dense(model: nn.Module, device: torch.device) -> None:
    """Move the dense part of sharded ``model`` (what DDP keeps in sync: not :func:`ignore_in_ddp`'s per-rank
    state), buffers included, to ``device``; parameters keep their identity."""
    # an index buffer left on the CPU breaks a CUDA forward (index_select wants both on one device)
    skip = set(ddp_ignored_names(model))
    for path, m in model.named_modules():
        prefix = f"{path}." if path else ""
        for name, p in _compat.own_parameters(m).items():
            if p is not None and prefix + name not in skip and p.device != device:
                p.data = p.data.to(device)
        for name, b in list(_compat.own_buffers(m).items()):
            if b is not None and prefix + name not in skip and b.device != device:
                _compat.own_buffers(m)[name] = b.to(device)


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


def fused_table_kinds(module: nn.Module) -> dict[str, str]:
    """``{table name: fused kind}`` of every fused table of ``module``'s sharded collections, over all ranks (each
    holds the kernels of its own pieces): what the planner charges each table's optimizer state with. Collective
    over the world where a process group exists."""
    kinds = {n: k.spec.kind for _, c in sharded_collections(module) for k in c.fused_kernels() for n in k.table_names}
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[dict[str, str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, kinds)
        kinds = {n: k for g in gathered for n, k in (g or {}).items()}
    return kinds


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
    if kind is None or kind == planner.optimizer or planner.table_optimizers:  # per-table kinds: already known
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
