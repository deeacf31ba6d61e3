"""``shard_modules``: every embedding collection of a model replaced by its sharded counterpart, and the
functions that find them again (``sharded_collections``, ``fused_optimizer``, ``use_sparse_grads_where_possible``,
DDP's ignore list).

The sharded collections themselves are ``pooled.py`` and ``sequence.py`` over ``sharded_collection.py``;
their forward is ``input_dist -> compute -> output_dist`` (docs/ARCHITECTURE.md, "One lookup, walked
through").
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from lightning_rec import _compat
from lightning_rec.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from lightning_rec.fused_kinds import FusedOptimizerSpec, PerTableOptimizers, TableSpecs, as_table_optimizers, spec_of
from lightning_rec.optim import FusedOptimizer
from lightning_rec.pipeline import collectives as comm
from lightning_rec.pipeline.agreement import check_agreement, describe_table, settings
from lightning_rec.pipeline.dp_grad_mode import leaf_optimizers, sparse_grad_blocker
from lightning_rec.pipeline.local_tables import target_device
from lightning_rec.pipeline.output_dist import QuantizedCommCodecs, pooled_codecs, refuse_sequence_codecs
from lightning_rec.pipeline.pooled import ShardedEmbeddingBagCollection
from lightning_rec.pipeline.sequence import ShardedEmbeddingCollection
from lightning_rec.pipeline.sharded_collection import ShardedCollection
from lightning_rec.pipeline.state_dict import full_state_dict
from lightning_rec.plans.plan import ShardingPlan, default_local_size, resolve_module_plan
from lightning_rec.plans.planner import automatic_plan
from lightning_rec.transport import inflight

__all__ = [
    "ShardedCollection",
    "ShardedEmbeddingBagCollection",
    "ShardedEmbeddingCollection",
    "full_state_dict",
    "fused_optimizer",
    "materialize_dense",
    "shard_modules",
    "sharded_collections",
    "use_sparse_grads_where_possible",
]


def sharded_collections(model: nn.Module) -> Iterator[tuple[str, ShardedCollection]]:
    """``(module path, sharded collection)`` for every sharded collection in ``model``, in module order."""
    for path, m in model.named_modules():
        if isinstance(m, ShardedCollection):
            yield path, m


def materialize_dense(model: nn.Module, device: torch.device, who: str) -> None:
    """Give the dense part's meta-device parameters and buffers storage on ``device``, then let each such module
    fill them with its own ``reset_parameters()`` (torch's convention for deferred initialisation).

    Sharded collections and per-rank state are skipped: shard_modules built those. A meta buffer whose module
    has no ``reset_parameters()`` holds zeros, and one warning (from ``who``) names every such buffer.
    Parameters are new objects: build optimizers afterwards.
    """
    skip = {id(x) for m in model.modules() if getattr(m, "per_rank_state", False) for x in m.modules()}
    guessed: list[str] = []
    with torch.no_grad():
        for path, m in model.named_modules():
            if id(m) in skip:
                continue
            fresh, zeroed = False, []
            for name, p in list(_compat.own_parameters(m).items()):
                if p is not None and p.device.type == "meta":
                    _compat.own_parameters(m)[name] = nn.Parameter(
                        torch.empty_like(p, device=device), requires_grad=p.requires_grad
                    )
                    fresh = True
            for name, b in list(_compat.own_buffers(m).items()):
                if b is not None and b.device.type == "meta":
                    _compat.own_buffers(m)[name] = torch.zeros_like(b, device=device)
                    fresh = True
                    zeroed.append(f"{path}.{name}" if path else name)
            reset = getattr(m, "reset_parameters", None)
            if fresh and callable(reset):
                reset()
            else:
                guessed += zeroed
    if guessed:
        # a meta buffer holds no values: zeros are a guess unless the module rebuilds it or a checkpoint does
        warnings.warn(
            f"{who}: the buffers {guessed} were on the meta device and their modules have no reset_parameters(); "
            "they now hold zeros. Build them on a real device, give their module a reset_parameters() that fills "
            "them, or load them from a checkpoint.",
            stacklevel=3,
        )


def ddp_ignored_names(module: nn.Module) -> list[str]:
    """Parameters and buffers DDP must leave alone: those of modules whose state is per rank
    (``per_rank_state``: sharded collections, whose replicated tables reduce their own touched rows, and
    managed-collision remap state). The Trainer and Fabric strategies and ``DistributedModelParallel`` use it."""
    names = []
    for path, m in module.named_modules():
        if getattr(m, "per_rank_state", False):
            prefix = f"{path}." if path else ""
            names += [prefix + n for n, _ in m.named_parameters()] + [prefix + n for n, _ in m.named_buffers()]
    return list(dict.fromkeys(names))


def dense_state(module: nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers of ``module`` DDP keeps equal across ranks (the rest of :func:`ddp_ignored_names`)."""
    skip = set(ddp_ignored_names(module))
    return [t for n, t in [*module.named_parameters(), *module.named_buffers()] if n not in skip]


def _configs(m: nn.Module) -> list:
    if isinstance(m, EmbeddingBagCollection):
        return list(m.embedding_bag_configs())
    return list(cast(EmbeddingCollection, m).embedding_configs())


_SHARDED = {EmbeddingBagCollection: ShardedEmbeddingBagCollection, EmbeddingCollection: ShardedEmbeddingCollection}


def shard_modules(
    model: nn.Module,
    plan: ShardingPlan | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    replica_group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    embedding_grad: str = "sum",
    local_size: int | None = None,
    embedding_optimizer: FusedOptimizerSpec | PerTableOptimizers | Mapping[str, Any] | None = None,
    qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] | None = None,
    table_optimizers: Mapping[str, TableSpecs] | None = None,
) -> nn.Module:
    """Replace every EmbeddingBagCollection / EmbeddingCollection in ``model`` by its sharded counterpart.

    Collective: every rank of the world calls it with the same model structure and plan; before any other
    exchange the ranks compare a digest of their tables and resolved shard layouts, and a mismatch raises
    on every rank, naming the tables and ranks that differ. ``process_group`` is the model-parallel (shard)
    group the plan's ranks refer to (default: a new group over the whole world). Under 2D parallelism (see
    ``mesh.init_2d_mesh``) pass the shard group and the ``replica_group``: every replica group then holds
    one full sharded copy of the tables, shard gradients are summed across replicas, and data-parallel
    tables across the whole world, all under the one ``embedding_grad`` rule. ``device`` (default: where
    the tables are) holds this rank's shards and every tensor the pipeline makes; the module follows a
    later ``.to(device)``. Returns ``model`` (or the sharded collection when ``model`` itself is one).

    Memory: build large collections on the meta device; each rank then allocates only its shard, filled by
    the table config's ``init_fn`` (given ``row_offset`` / ``col_offset`` when it takes them). A large table
    built in full on a rank that keeps only part of it is cut with one copy and warns.

    Lookup kernels: each table's ``ParameterSharding.compute_kernel`` (``"fbgemm"``, ``"torch"``; otherwise
    the collection's ``kernel`` setting) picks the kernel of its shards; see ``ShardedCollection.lookup_kernels``.

    ``embedding_optimizer`` (a ``FusedOptimizerSpec`` or a dict such as ``{"kind": "rowwise_adagrad",
    "lr": 0.05}``) makes every sharded table update inside backward with fbgemm's kernel; step it with
    ``fused_optimizer(model)``. Without it, tables are ordinary parameters for any torch optimizer. A
    :class:`~lightning_rec.fused_kinds.PerTableOptimizers` gives tables different specs (tables sharing a spec
    share a kernel); ``table_optimizers`` (``{collection path: {table: spec or None}}``, what
    ``front_end.resolve_table_optimizers`` makes of in-backward marks) overrides it for the collections
    it names.

    ``qcomm_codecs_registry`` (TorchRec's, from ``get_qcomm_codecs_registry(QCommsConfig(...))``) makes the
    pooled collections' output dist send fp16 or bf16 rows and gradients (bounds: ``pipeline/output_dist.py``).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "shard_modules needs torch.distributed: call torch.distributed.init_process_group first "
            "(one process with world_size=1 is fine)"
        )
    # a rank that raises (a peer died) and exits must not abort on a gloo worker still letting go of the
    # failed collective's tensors (docs/ARCHITECTURE.md, "Leaving cleanly"): with or without Lightning
    inflight.install_exit_hook()
    comm.grad_scale(embedding_grad, 1)
    # a group torch creates waits its default 30 min; the world's timeout is what the user chose
    # every rank is a member of a group over the whole world (never torch's non-member marker)
    group = (
        process_group
        if process_group is not None
        else cast(dist.ProcessGroup, dist.new_group(timeout=_compat.group_timeout()))
    )
    gsize = dist.get_world_size(group)
    replicas = 1 if replica_group is None else dist.get_world_size(replica_group)
    # every rank that exchanges with this one
    agree_group = group if replicas == 1 else cast(dist.ProcessGroup, dist.group.WORLD)
    local = local_size if local_size is not None else default_local_size(gsize)
    targets = [(p, m) for p, m in model.named_modules() if type(m) in _SHARDED]
    resolved: list[tuple] = []
    specs_of: dict[str, TableSpecs] = {}
    error: Exception | None = None
    kernels_of: dict[str, dict[str, str | None]] = {}
    codecs: QuantizedCommCodecs | None = None
    env: dict[str, str] = {}
    try:  # a bad argument on some rank raises on every rank, in the agreement below
        env = settings()  # read before the collections build their dists, which use them
        codecs = pooled_codecs(qcomm_codecs_registry)
        sequence = [p or "<root>" for p, m in targets if type(m) is EmbeddingCollection]
        if sequence:
            refuse_sequence_codecs(qcomm_codecs_registry, f"the EmbeddingCollections {sequence}")
        option = as_table_optimizers(embedding_optimizer)
        specs_of = {
            p: dict(table_optimizers[p])
            if table_optimizers is not None and p in table_optimizers
            else {t.name: spec_of(option, t.name) for t in _configs(m)}
            for p, m in targets
        }
        resolved = _resolve(model, plan, targets, gsize, local, gsize * replicas, specs_of, kernels_of)
    except (ValueError, TypeError, KeyError) as e:
        error = e
    described = {
        (path, t.name): f"{type(m).__name__} " + describe_table(t, shards[t.name])
        for path, m, shards in resolved
        for t in _configs(m)
    }
    options = (
        f"embedding_grad={embedding_grad} embedding_optimizers={sorted(_fused_groups(specs_of).items())} "
        f"shard_group_size={gsize} replicas={replicas} collections={[p for p, _ in targets]} "
        f"qcomm=({codecs or 'none'})"
    )
    here = target_device(targets[0][1], device) if targets else _compat.indexed_device(device or "cpu")
    peers = check_agreement(
        described, options, error, agree_group, here, collective_device=here if here.type == "cuda" else None, env=env
    )
    for path, m, shards in resolved:
        sharded = _SHARDED[type(m)](
            m,
            shards,
            group,
            embedding_grad=embedding_grad,
            device=device,
            replica_group=replica_group,
            embedding_optimizer=specs_of[path],
            peer_devices=peers,
            compute_kernels=kernels_of[path],
            **({"qcomm_codecs": codecs} if type(m) is EmbeddingBagCollection else {}),
        )
        if path == "":
            return sharded
        parent_path, _, name = path.rpartition(".")
        _compat.child_modules(model.get_submodule(parent_path))[name] = sharded
    return model


def _fused_groups(specs_of: Mapping[str, TableSpecs]) -> dict[str, str]:
    """``{collection.table: spec}`` of the fused tables, as text every rank must agree on."""
    return {f"{p}.{t}": repr(s) for p, specs in specs_of.items() for t, s in specs.items() if s is not None}


def _resolve(
    model: nn.Module,
    plan: ShardingPlan | None,
    targets: list[tuple[str, nn.Module]],
    gsize: int,
    local: int,
    world: int,
    table_optimizers: Mapping[str, TableSpecs],
    kernels_of: dict[str, dict[str, str | None]],
) -> list[tuple]:
    """``(path, module, {table: shards or None})`` for every collection to shard; raises on a bad plan.

    Fills ``kernels_of[path]`` with each table's planned ``compute_kernel``."""
    if plan is not None:
        # collections sharded by an earlier call (e.g. fit, then validate) keep their placement
        paths = {p for p, m in model.named_modules() if type(m) in _SHARDED or isinstance(m, ShardedCollection)}
        unknown = [p for p in plan.plan if p not in paths]
        if unknown:
            raise ValueError(
                f"the plan names modules {unknown} that are not embedding collections of the model; "
                f"collections found: {sorted(paths)}"
            )
    resolved, auto = [], None
    for path, m in targets:
        tables = _configs(m)
        module_plan = plan.get_plan_for_module(path) if plan is not None else None
        if module_plan is None:  # one plan for all unplanned collections: they share every rank's memory and time
            if auto is None:
                auto = automatic_plan(model, gsize, local, world, table_optimizers=table_optimizers).plan(model)
            module_plan = auto.get_plan_for_module(path)
        assert module_plan is not None  # the automatic plan covers every collection
        resolved.append((path, m, resolve_module_plan(tables, module_plan, gsize, local, path)))
        kernels_of[path] = {n: getattr(ps, "compute_kernel", None) for n, ps in module_plan.items()}
    return resolved


def fused_optimizer(model: nn.Module) -> FusedOptimizer | None:
    """The ``FusedOptimizer`` driving every fused kernel in ``model`` (None if it has none).

    Its ``step()`` pushes learning rates into the kernels and closes the step; call it once per step, like
    any optimizer (the update itself already happened in backward).
    """
    owned = [(k, f"{path}." if path else "") for path, m in sharded_collections(model) for k in m.fused_kernels()]
    if not owned:
        return None
    found = [k for k, _ in owned]
    # one optimizer owns a kernel (a newer one would take it over), so hand out the same one each time
    cached = getattr(model, "_lightning_rec_fused_optimizer", None)
    if cached is not None and cached.kernels == found:
        return cached
    opt = FusedOptimizer(found, prefixes=[prefix for _, prefix in owned])  # collections may share table names
    object.__setattr__(model, "_lightning_rec_fused_optimizer", opt)
    return opt


def use_sparse_grads_where_possible(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    gradient_clipping: bool = False,
    grad_scaler: object | None = None,
) -> dict[str, str | None]:
    """Switch the data-parallel tables of every sharded collection in ``model`` to sparse gradients where exact.

    Call it once after ``shard_modules`` and after building the optimizers (``RecShardedStrategy`` does it
    itself when fitting). A collection switches only if its ``sparse_grad`` was left at ``None`` and every
    optimizer param group holding one of its data-parallel tables allows it (the rules: ``dp_grad_mode``); a
    table in no optimizer keeps it dense. ``gradient_clipping=True`` or a ``grad_scaler`` keep every table
    dense. Returns ``{collection path: None if now sparse, else why it stays dense}``.
    """
    opts = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
    groups = {id(p): (opt, g) for opt in leaf_optimizers(opts) for g in opt.param_groups for p in g["params"]}
    decided: dict[str, str | None] = {}
    for path, m in sharded_collections(model):
        reason = m.data_parallel_sparse_grad_allowed()
        if reason is None and gradient_clipping:
            reason = "gradient clipping needs dense gradients"
        if reason is None and grad_scaler is not None:
            reason = "a GradScaler scales the loss"
        if reason is None:
            for name, w in m.data_parallel_weights().items():
                found = groups.get(id(w))
                reason = f"table {name!r} is in no optimizer" if found is None else sparse_grad_blocker(*found)
                if reason is not None:
                    break
        if m.data_parallel_sparse_grad_allowed() is None:
            m.set_data_parallel_sparse_grad(reason is None)
        decided[path] = reason
    return decided
