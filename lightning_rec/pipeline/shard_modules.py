"""Sharded embedding collections: one input dist -> lookup -> output dist pipeline for every sharding type.

Every model-parallel sharding type (table-wise, row-wise, column-wise, table-row-wise, grid) is a tiling
of the table into rectangular shards (``layout.ShardMeta``), each owned by one rank of the shard group.
The pipeline only ever sees shards, so the types differ in their layout, not in their code:

* **input dist** -- for every (feature, shard) pair (a *route*), each rank keeps the ids that fall in
  the shard's row block, makes them local to the block and sends them, with their bag lengths, to the
  shard's owner (a fixed-size header all-to-all of batch size and id counts, then one all-to-all of
  lengths, ids and weights). A train pipeline may start it one batch ahead (``prefetch_input_dist``).
* **lookup** -- the owner pools each received bag over its local rows and columns with SUM.
* **output dist** -- pooled partial rows go back to the rank that owns the sample (all-to-all, the
  reverse of the input dist) and are summed into place: row blocks add up (the reduce-scatter of
  row-wise sharding, done as all-to-all + local sum so gloo can run it), column blocks sit side by side.
  MEAN pooling then divides by the full bag length, once, on the sample's rank (rule 1).

Forward comm: all-to-all of a header (batch size, input verdict, id counts), all-to-all of lengths, ids
and weights in one buffer, all-to-all of pooled rows. Backward comm: the reverse all-to-all of the pooled
gradient; ids get none.
Gradient scale (rule 2): each shard receives the sum of every rank's gradient; ``embedding_grad="mean"``
multiplies it by ``1 / data-parallel ranks`` in ``comm.embedding_grad``, the one place a scale is applied.

Data-parallel tables skip the dists: every rank looks up its own replica and, in backward, the rows
some rank touched are summed across ranks (only those rows move) and scaled the same way.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from lightning_rec import _compat, kernels
from lightning_rec.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from lightning_rec.fused_kinds import as_spec
from lightning_rec.optim import FusedOptimizer
from lightning_rec.pipeline import collectives as comm
from lightning_rec.pipeline import input_dist as dists
from lightning_rec.pipeline import output_dist as place
from lightning_rec.pipeline.agreement import check_agreement, describe_table
from lightning_rec.pipeline.input_dist import Received
from lightning_rec.pipeline.materialize import target_device
from lightning_rec.pipeline.sharded_collection import ShardedCollection
from lightning_rec.pipeline.state_dict import full_state_dict
from lightning_rec.plans.plan import ShardingPlan, default_local_size, resolve_module_plan
from lightning_rec.plans.planner import automatic_plan
from lightning_rec.plans.shard_geometry import offsets_of
from lightning_rec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor, offsets_from_lengths

__all__ = [
    "ShardedCollection",
    "ShardedEmbeddingBagCollection",
    "ShardedEmbeddingCollection",
    "full_state_dict",
    "fused_optimizer",
    "shard_modules",
    "sharded_collections",
]


class ShardedEmbeddingBagCollection(ShardedCollection):
    """An ``EmbeddingBagCollection`` whose tables are spread over a process group by a plan.

    Same input (each rank its own local KJT; batch sizes may differ) and same output (a local KeyedTensor
    in config order) as the unsharded module. See the module docstring for the comm life cycle.
    """

    _attr = "embedding_bags"

    def __init__(self, module: EmbeddingBagCollection, shards, shard_group, **kw) -> None:
        super().__init__(module, shards, shard_group, **kw)
        self._is_weighted = module.is_weighted()

    def embedding_bag_configs(self):
        return list(self._layout.tables)

    def is_weighted(self) -> bool:
        return self._is_weighted

    def _uses_weights(self) -> bool:
        return self._is_weighted

    def _check_weights(self, kjt: KeyedJaggedTensor) -> None:
        if self._is_weighted and kjt.weights_or_none() is None:
            raise ValueError("this EmbeddingBagCollection is weighted (is_weighted=True) but the input has no weights")

    def _dp_lookup(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """``[batch, widths of the data-parallel features]``: every rank looks up its own replica."""
        b, dtype = kjt.stride(), self._out_dtype()
        dp_features = list(self._routing.dp_features)
        # every feature data-parallel (the usual data_parallel plan): the input is already the sub-batch
        sub = kjt if dp_features == list(range(len(kjt.keys()))) else kjt.permute(dp_features)
        psw = self._wire_weights(sub.weights_or_none()) if self._is_weighted else None
        if self._dp_fused is not None:
            group = self._dp_group if dist.get_world_size(self._dp_group) > 1 else None
            return self._fused_lookup(self._dp_fused, sub.lengths(), sub.values(), psw, sub.length_per_key(), b,
                                      group).to(dtype)
        return self._dp_table_lookup(self._dp_weights(kjt), sub.values(), sub.offsets(), b, psw, self._dp_sparse_grad,
                                     storage=self._dp_params()).to(dtype)

    def lookup(self, recv: Received, batches: list[int]) -> torch.Tensor:
        """Stage 2: SUM-pool every received bag over this rank's shards: ``[sum(batches), route columns]``."""
        b_global, dtype, routing = sum(batches), self._out_dtype(), self._routing
        if self._fused is not None:
            return self._fused_lookup(self._fused, recv.lengths, recv.values, recv.weights, recv.ids_per_route(),
                                      b_global, self._replica_group).to(dtype)
        if not routing.my_routes:
            return torch.zeros(b_global, 0, dtype=dtype, device=self._device)
        return self._shard_lookup(
            self._shard_weights(recv), recv.values, offsets_from_lengths(recv.lengths), b_global, recv.weights,
            self.sparse_grad, storage=self._shard_params(),
        ).to(dtype)

    def output_dist(self, pooled: torch.Tensor, batches: list[int], b: int) -> torch.Tensor:
        """Stage 3: each sample's pooled partial rows back to its rank, flat: rank ``r``'s ``[b, columns]``
        block after rank ``r - 1``'s."""
        return dists.pooled_output_dist(pooled, self._routing, batches, b, self._group)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        layout, routing = self._layout, self._routing
        begun = self._begin(features)
        kjt = begun.kjt
        b = kjt.stride()
        dtype = self._out_dtype()
        parts: list[place.Part] = []
        dp_pooled = None
        if routing.dp_tables:
            # (results go to a local first: a graph break inside a call whose caller holds a fresh bound method
            # on its stack makes torch.compile recompile the resumed code at every step)
            dp_pooled = self._dp_lookup(kjt)
            parts.append((dp_pooled, 0, dp_pooled.shape[1], routing.colmap_runs[0], routing.colmap_add[0]))
        recv = begun.wait()  # the ids travelled while the data-parallel tables looked up
        out = None
        if recv is not None:
            batches = list(recv.batches)
            pooled = self.lookup(recv, batches)
            if routing.direct_groups is not None:
                # every rank's rows are one group that copies: the views exchange gives exchange_and_place's bits
                # with less work per call (8 column-wise tables x 64, forward and backward: 3.7 against 4.0 ms)
                out = place.exchange_into_place(pooled, routing.direct_groups, batches, b, routing.feat_off[-1],
                                                self._group)
            elif routing.group_size > 1:  # copied or added into their columns straight out of the exchange
                out = place.exchange_and_place(pooled, dp_pooled, routing, batches, b, self._group)
            else:
                flat = self.output_dist(pooled, batches, b)
                starts = offsets_of([b * w for w in routing.cols_from])
                parts += [(flat, s, w, g, a) for s, w, g, a in zip(starts, routing.cols_from,
                                                                    routing.colmap_runs[1:], routing.colmap_add[1:])]
        if out is None:
            out = place.place_columns(parts, routing.colmap_kind, b, routing.feat_off[-1], dtype, self._device)
        if recv is not None and not routing.my_routes and recv.weights is not None and recv.weights.requires_grad:
            # weights received for no shard still came by a differentiable all-to-all that every rank must run
            # backward: keep it in this rank's graph, or the ranks holding shards wait for it forever
            out = comm.tie_backward(out, recv.weights)
        out = layout.apply_mean(out, kjt.lengths(), b)
        if self._output_dtype is not None and out.dtype != self._output_dtype:
            out = out.to(self._output_dtype)
        return KeyedTensor(layout.feature_names, layout.dims, out)


class ShardedEmbeddingCollection(ShardedCollection):
    """An ``EmbeddingCollection`` spread over a process group; returns ``{feature: JaggedTensor}`` per rank."""

    _attr = "embeddings"

    def embedding_configs(self):
        return list(self._layout.tables)

    def lookup(self, recv: Received) -> list[torch.Tensor]:
        """Stage 2: the rows of every received id, per route of this rank (source-major within a route)."""
        routing = self._routing
        return kernels.torch_sequence(self._shard_weights(recv), list(routing.my_route_table), recv.values,
                                      recv.ids_per_route(), self.sparse_grad)

    def output_dist(self, embs: list[torch.Tensor], recv: Received) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Stage 3: every id's embedding columns back to the id's rank, as per-feature (index, values) pieces."""
        return dists.sequence_output_dist(embs, recv, self._routing, self._layout.dims, self._out_dtype(),
                                          self._group, self._device)

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        layout, routing = self._layout, self._routing
        begun = self._begin(features)
        kjt = begun.kjt
        b = kjt.stride()
        lpk = kjt.length_per_key()
        dtypes = [self._table_dtypes[ti] for ti in layout.feature_table]
        results: dict[int, torch.Tensor] = {}
        if routing.dp_tables:
            sub = kjt.permute(list(routing.dp_features))
            embs = kernels.torch_sequence(self._dp_weights(kjt), self._dp_feature_tables(), sub.values(),
                                          sub.length_per_key(), self._dp_sparse_grad)
            results.update(zip(routing.dp_features, embs))
        pieces: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in layout.feature_names]
        recv = begun.wait()
        if recv is not None:
            embs_mp = self.lookup(recv)  # a local first, as in the pooled forward
            pieces = self.output_dist(embs_mp, recv)
        out = {}
        for f, name in enumerate(layout.feature_names):
            if f in results:
                emb = results[f]
            else:
                d, n = layout.dims[f], lpk[f]
                idx = (torch.cat([i for i, _ in pieces[f]]) if pieces[f]
                       else torch.zeros(0, dtype=torch.long, device=self._device))
                src = (torch.cat([c for _, c in pieces[f]]) if pieces[f]
                       else torch.zeros(0, dtype=self._out_dtype(), device=self._device))
                emb = torch.zeros(n * d, dtype=src.dtype, device=self._device).index_add(0, idx, src).view(n, d)
            lengths = kjt.lengths()[f * b : (f + 1) * b]
            out[name] = JaggedTensor(emb.to(self._output_dtype or dtypes[f]), lengths=lengths)
        return out


_ShardedCollection = ShardedCollection  # older name


def sharded_collections(model: nn.Module) -> Iterator[tuple[str, ShardedCollection]]:
    """``(module path, sharded collection)`` for every sharded collection in ``model``, in module order."""
    for path, m in model.named_modules():
        if isinstance(m, ShardedCollection):
            yield path, m


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
    return list(m.embedding_bag_configs() if isinstance(m, EmbeddingBagCollection) else m.embedding_configs())


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
    embedding_optimizer=None,
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
    ``fused_optimizer(model)``. Without it, tables are ordinary parameters for any torch optimizer.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "shard_modules needs torch.distributed: call torch.distributed.init_process_group first "
            "(one process with world_size=1 is fine)"
        )
    comm.grad_scale(embedding_grad, 1)
    # a group torch creates waits its default 30 min; the world's timeout is what the user chose
    group = process_group if process_group is not None else dist.new_group(timeout=_compat.group_timeout())
    gsize = dist.get_world_size(group)
    replicas = 1 if replica_group is None else dist.get_world_size(replica_group)
    agree_group = group if replicas == 1 else dist.group.WORLD  # every rank that exchanges with this one
    local = local_size if local_size is not None else default_local_size(gsize)
    targets = [(p, m) for p, m in model.named_modules() if type(m) in _SHARDED]
    resolved, error, kernels_of = [], None, {}
    try:
        resolved = _resolve(model, plan, targets, gsize, local, gsize * replicas, embedding_optimizer, kernels_of)
    except (ValueError, TypeError, KeyError) as e:
        error = e
    described = {(path, t.name): f"{type(m).__name__} " + describe_table(t, shards[t.name])
                 for path, m, shards in resolved for t in _configs(m)}
    options = f"embedding_grad={embedding_grad} embedding_optimizer={as_spec(embedding_optimizer)!r} " \
              f"shard_group_size={gsize} replicas={replicas} collections={[p for p, _ in targets]}"
    here = target_device(targets[0][1], device) if targets else _compat.indexed_device(device or "cpu")
    peers = check_agreement(described, options, error, agree_group, here,
                            collective_device=here if here.type == "cuda" else None)
    for path, m, shards in resolved:
        sharded = _SHARDED[type(m)](m, shards, group, embedding_grad=embedding_grad, device=device,
                                    replica_group=replica_group, embedding_optimizer=embedding_optimizer,
                                    peer_devices=peers, compute_kernels=kernels_of[path])
        if path == "":
            return sharded
        parent_path, _, name = path.rpartition(".")
        model.get_submodule(parent_path)._modules[name] = sharded
    return model


def _resolve(model, plan, targets, gsize: int, local: int, world: int, embedding_optimizer,
             kernels_of: dict[str, dict[str, str | None]]) -> list[tuple]:
    """``(path, module, {table: shards or None})`` for every collection to shard; raises on a bad plan.

    Fills ``kernels_of[path]`` with each table's planned ``compute_kernel``."""
    if plan is not None:
        # collections sharded by an earlier call (e.g. fit, then validate) keep their placement
        paths = {p for p, m in model.named_modules() if type(m) in _SHARDED or isinstance(m, ShardedCollection)}
        unknown = [p for p in plan.plan if p not in paths]
        if unknown:
            raise ValueError(f"the plan names modules {unknown} that are not embedding collections of the model; "
                             f"collections found: {sorted(paths)}")
    resolved, auto = [], None
    for path, m in targets:
        tables = _configs(m)
        module_plan = plan.get_plan_for_module(path) if plan is not None else None
        if module_plan is None:  # one plan for all unplanned collections: they share every rank's memory and time
            if auto is None:
                auto = automatic_plan(model, gsize, local, world, embedding_optimizer).plan(model)
            module_plan = auto.get_plan_for_module(path)
        resolved.append((path, m, resolve_module_plan(tables, module_plan, gsize, local, path)))
        kernels_of[path] = {n: getattr(ps, "compute_kernel", None) for n, ps in module_plan.items()}
    return resolved


def fused_optimizer(model: nn.Module):
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
