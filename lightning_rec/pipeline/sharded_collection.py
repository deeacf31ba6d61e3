"""The shared machinery of sharded collections: local shards, devices, routing, input checks, stage 1.

A :class:`ShardedCollection` holds this rank's pieces of its tables (placed by ``local_tables.py``; full
replicas of data-parallel tables), the frozen routing table, the input dist built once from it, and the
process groups. Its forward is the typed stage contract of ``stages.py``: ``input_dist`` (here) returns a
:class:`~lightning_rec.pipeline.stages.LookupContext`, ``compute`` the lookups and ``output_dist`` the result
(``pooled.py``, ``sequence.py``).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from lightning_rec import _compat, kernels
from lightning_rec.configs import BaseEmbeddingConfig
from lightning_rec.embedding_modules import FeatureLayout
from lightning_rec.fused_kinds import FusedOptimizerSpec
from lightning_rec.pipeline import collectives as comm
from lightning_rec.pipeline.dp_grad_mode import DataParallelGradMode
from lightning_rec.pipeline.fused_lookup import FusedGroup, build_kernels, check_fused, grouped_lookup, table_specs
from lightning_rec.pipeline.input_dist import InputDist, InputRejected, Received
from lightning_rec.pipeline.local_tables import (
    broadcast_from_first,
    dp_lookup_weights,
    place_tables,
    requested_kernel,
    shard_lookup_weights,
    table_conversion,
    target_device,
    warn_large_tables,
)
from lightning_rec.pipeline.routing import RoutingTable, build_routing
from lightning_rec.pipeline.stages import (
    RAW_ID_HOOK_ATTR,
    FeedSlot,
    LookupContext,
    Lookups,
    Out,
    PrefetchedInputDist,
    RawIdHook,
    RawIdRouting,
    Stages,
)
from lightning_rec.pipeline.state_dict import load_hook, sharded_state_dict_hook
from lightning_rec.plans.shard_geometry import ShardMeta
from lightning_rec.sparse import KeyedJaggedTensor, checks_enabled


class ShardedCollection(Stages[Lookups, Out], nn.Module):
    """Shared machinery of the sharded pooled and sequence collections.

    ``forward`` is three stages, :meth:`input_dist` -> ``compute`` -> ``output_dist`` (``stages.Stages``), driven
    by a frozen :class:`~lightning_rec.pipeline.routing.RoutingTable`; data-parallel tables skip the two dists. Other
    modules read a sharded collection only through the read-only accessors below and
    ``sharded_collections(model)``; everything underscored is this module's own.
    """

    _attr = ""  # the attribute holding the tables, as in state_dict keys
    _pooled = False  # bags pooled into one row each (EmbeddingBagCollection), or a row per id
    per_rank_state = True  # DDP must neither broadcast nor reduce it (sharded.ddp_ignored_names)

    def __init__(
        self,
        module: nn.Module,
        shards: dict[str, list[ShardMeta] | None],
        shard_group: dist.ProcessGroup,
        *,
        embedding_grad: str = "sum",
        replica_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        sparse_grad: bool | None = None,
        embedding_optimizer: FusedOptimizerSpec | Mapping[str, Any] | None = None,
        peer_devices: dict[int, torch.device] | None = None,
        compute_kernels: Mapping[str, str | None] | None = None,
    ) -> None:
        super().__init__()
        if replica_group is not None and dist.get_world_size(replica_group) == 1:
            replica_group = None
        unsharded: Any = module  # an EmbeddingBagCollection or EmbeddingCollection (the subclass says which)
        tables = self._configs_of(module)
        # one spec for every table, or one per table (tables sharing a spec share a kernel)
        specs = table_specs(embedding_optimizer, tables)
        fused = next((s for s in specs if s is not None), None)  # any fused table: the collection is fused
        # keys no table reads are ignored unless the unsharded module was strict: sharding keeps its behaviour
        self._layout = FeatureLayout(tables, strict=getattr(getattr(module, "_layout", None), "strict", False))
        self._shards = shards
        self._group = shard_group
        self._replica_group = replica_group
        self._group_size = dist.get_world_size(shard_group)
        self._group_rank = dist.get_rank(shard_group)
        self._global_ranks = dist.get_process_group_ranks(shard_group)
        replicas = 1 if replica_group is None else dist.get_world_size(replica_group)
        self._num_dp_ranks = self._group_size * replicas
        # replicated tables live on every data-parallel rank: the shard group, times the replicas under 2D
        self._dp_group = shard_group if replica_group is None else dist.group.WORLD
        self.embedding_grad = embedding_grad
        self._scale = comm.grad_scale(embedding_grad, self._num_dp_ranks)
        # sparse_grad=None: data-parallel tables may switch to sparse gradients later (use_sparse_grads_where_possible)
        self._dp_grad = DataParallelGradMode(
            unsharded.sparse_grad if sparse_grad is None else sparse_grad,
            auto=sparse_grad is None and getattr(module, "_sparse_grad_auto", False),
        )
        self._table_dtypes = [cast(torch.dtype, t.dtype) for t in tables]  # set by the config's __post_init__
        self._keep_table_dtypes = False
        self._output_dtype: torch.dtype | None = None
        self._feed = FeedSlot()  # the input dist a train pipeline started for the batch it runs (feeding)
        dev = self._device = target_device(module, device)
        if dev.type == "cpu":
            kernels.keep_freed_memory()  # memory.py
        peers = peer_devices or {}
        self._peer_devices = [peers.get(g, dev) for g in self._global_ranks]

        me = self._group_rank
        source = getattr(module, self._attr)
        # every table's lookup kernel, resolved before anything is allocated or exchanged: a table fbgemm
        # cannot serve raises here, on every rank alike
        self._module_kernel = kernels.validate_kernel(getattr(module, "kernel", "auto"))
        self._requested_kernels = [
            requested_kernel((compute_kernels or {}).get(t.name), self._module_kernel) for t in tables
        ]
        self._fused_spec = fused
        self._table_kernels = self._resolve_kernels([source[t.name].weight.dtype for t in tables], dev)
        if fused is not None:  # before any shard is allocated
            check_fused(tables, shards, specs, dev)
        weights = [source[t.name].weight for t in tables]
        warn_large_tables(tables, weights, shards, me)
        placed = place_tables(tables, weights, shards, me, fused is not None, self._dp_group, replica_group, dev)
        self._local_shards = placed.shards
        self._fused: list[FusedGroup] = []  # this rank's shards, a kernel per spec
        self._dp_fused: list[FusedGroup] = []  # the data-parallel tables, a kernel per spec
        setattr(self, self._attr, placed.container)

        self._routing: RoutingTable = build_routing(
            self._layout.feature_table,
            self._layout.dims,
            [shards[t.name] for t in tables],
            [ti for ti, _ in self._local_shards],
            me,
            self._group_size,
        )
        if fused is not None:
            shard_kernels, dp_kernels = build_kernels(
                placed.sources,
                specs,
                [t.name for t in tables],
                self._layout.feature_table,
                self._routing,
                [ti for ti, _ in self._local_shards],
                dev,
                pooled=self._pooled,
            )
            object.__setattr__(self, "_fused", shard_kernels)
            object.__setattr__(self, "_dp_fused", dp_kernels)
            # registered once, under the same keys as plain tables: <attr>.<table>.weight
            held = kernels.FusedTables(self.fused_kernels(), [t.name for t in tables])
            setattr(self, self._attr, held)
            for name, group in placed.replicas:  # in table order on every rank, as the plain path broadcasts
                broadcast_from_first(cast(torch.Tensor, held[name].weight), group)
        self._build_lookups()
        _compat.register_state_dict_hook(self, sharded_state_dict_hook)
        _compat.register_load_state_dict_pre_hook(self, self._load_hook)
        # raw-id tables (managed collision): a permanent stage hook, carried over from the unsharded module
        self.set_raw_id_hook(getattr(module, RAW_ID_HOOK_ATTR, None))
        # the input dist, built once per layout (and per device: _apply)
        self._kjt_dist = InputDist(
            self._routing, shard_group, dev, with_positions=not self._pooled, ranks=self._global_ranks
        )

    # -- read-only accessors for the rest of the library --------------------------------------------
    @property
    def tables(self) -> list[BaseEmbeddingConfig]:
        """The table configs, in config order."""
        return list(self._layout.tables)

    @property
    def shards(self) -> dict[str, list[ShardMeta] | None]:
        """``{table: every shard of it (all ranks)}``; ``None`` for a data-parallel table."""
        return dict(self._shards)

    @property
    def local_shards(self) -> list[tuple[int, ShardMeta]]:
        """``(table index, shard)`` for the shards this rank holds, in table order."""
        return list(self._local_shards)

    @property
    def shard_group(self) -> dist.ProcessGroup:
        return self._group

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        return self._replica_group

    @property
    def shard_group_ranks(self) -> list[int]:
        """Global rank of every shard-group rank (``ShardMeta.rank`` indexes this list)."""
        return list(self._global_ranks)

    @property
    def table_dtypes(self) -> list[torch.dtype]:
        return list(self._table_dtypes)

    @property
    def table_attr(self) -> str:
        """The attribute holding the tables (``embedding_bags`` or ``embeddings``), as in state_dict keys."""
        return self._attr

    @property
    def is_fused(self) -> bool:
        """Whether any table here (sharded or data-parallel) updates inside backward."""
        return bool(self.fused_kernels())

    @property
    def device(self) -> torch.device:
        """The device of this rank's tables and of every tensor the pipeline makes (with its index)."""
        return self._device

    @property
    def peer_devices(self) -> list[torch.device]:
        """The device each shard-group rank reported at sharding time (the agreement check exchanges them)."""
        return list(self._peer_devices)

    @property
    def routing(self) -> RoutingTable:
        """This rank's routing table (frozen; rebuilt only by sharding again)."""
        return self._routing

    @property
    def lookup_kernels(self) -> dict[str, str]:
        """``{table: kernel}``: ``"torch"``, ``"fbgemm"`` (the plan's ``compute_kernel``, resolved) or ``"fused"``."""
        return {t.name: k for t, k in zip(self._layout.tables, self._table_kernels)}

    # -- the data-parallel tables' gradient mode, held by a dp_grad_mode.DataParallelGradMode -------------
    @property
    def sparse_grad(self) -> bool:
        """Whether the lookups make sparse gradients (data-parallel tables may switch to them later as well)."""
        return self._dp_grad.given

    @sparse_grad.setter
    def sparse_grad(self, sparse: bool) -> None:
        self._dp_grad.given = sparse

    def _dp_grad_facts(self) -> tuple[list[str], bool, set[str]]:
        """What the gradient mode decides on: the data-parallel tables, fused or not, the tables asking for fbgemm."""
        tables = self._layout.tables
        fbgemm = {t.name for t, k in zip(tables, self._requested_kernels) if k == "fbgemm"}
        return [tables[ti].name for ti in self._routing.dp_tables], self._fused_spec is not None, fbgemm

    def data_parallel_sparse_grad_allowed(self) -> str | None:
        """Why the data-parallel tables here cannot switch to sparse gradients by themselves (None: they can)."""
        return self._dp_grad.blocker(*self._dp_grad_facts())

    def data_parallel_weights(self) -> dict[str, torch.Tensor]:
        """``{table: weight}`` of the data-parallel (replicated) tables held as plain parameters."""
        if self._fused_spec is not None:
            return {}
        return {self._layout.tables[ti].name: self._table_param(ti) for ti in self._routing.dp_tables}

    def set_data_parallel_sparse_grad(self, sparse: bool) -> None:
        """Make the data-parallel tables' lookups produce sparse (or dense) gradients from the next forward.

        Only for a collection whose ``sparse_grad`` was left at ``None`` (auto); see
        ``lightning_rec.sharding.use_sparse_grads_where_possible``, which decides it from the optimizers.
        """
        if self._dp_grad.switch(sparse, *self._dp_grad_facts()) and self._fused_spec is None:
            self._table_kernels = self._resolve_kernels(self._table_dtypes, self._device)
            self._build_lookups()

    def _resolve_kernels(self, dtypes: list[torch.dtype], device: torch.device) -> list[str]:
        if self._fused_spec is not None:  # fused optimizers keep their fused kernel whatever the plan says
            return ["fused"] * len(dtypes)
        dp = {ti for ti, t in enumerate(self._layout.tables) if self._shards[t.name] is None}
        return [
            kernels.resolve_table_kernel(
                req, t.name, d, device, self._dp_grad.sparse if ti in dp else self.sparse_grad, self._pooled
            )
            for ti, (t, req, d) in enumerate(zip(self._layout.tables, self._requested_kernels, dtypes))
        ]

    def _build_lookups(self) -> None:
        """The lookups of this rank's tables, built again whenever their device or dtype changes (``_apply``)."""

    def _load_hook(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        load_hook(self, state_dict, prefix)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> ShardedCollection:  # type: ignore[override]
        # the lookup kernels for the converted tables, resolved before converting: a table whose plan asks
        # for fbgemm and whose new dtype fbgemm cannot serve raises and leaves the module as it was
        new = table_conversion(fn, self._table_dtypes, self._device, self._keep_table_dtypes)
        table_kernels = self._resolve_kernels(new.dtypes, new.device)
        out = super()._apply(new.fn, recurse)
        # ranks without a local piece of a table still need its dtype for the wire: it follows conversions
        self._table_kernels, self._table_dtypes, self._device = table_kernels, new.dtypes, new.device
        self._kjt_dist = self._kjt_dist.to(self._device)  # the routing holds no tensor: the input dist's move
        self._build_lookups()
        return out

    def keep_table_dtypes(self, output_dtype: torch.dtype | None) -> None:
        """Make later dtype conversions of this module leave the tables' configured dtypes alone.

        Lookups then return ``output_dtype`` (the precision the rest of the model computes in); gradients
        flow back into the tables at their own precision. Used by the strategy for ``*-true`` precision.
        """
        self._keep_table_dtypes = True
        self._output_dtype = output_dtype

    def _out_dtype(self) -> torch.dtype:
        return kernels.promoted_dtype(self._table_dtypes)

    def _wire_weights(self, weights: torch.Tensor | None) -> torch.Tensor | None:
        """Per-sample weights in the one dtype every rank agrees on, whatever float dtype the caller used.

        The torch kernel casts weights to the table dtype, so any dtype at least as wide as the tables (and
        float32, which the fused kernel takes) gives the unsharded module's answer.
        """
        if weights is None:
            return None
        return weights.to(torch.promote_types(self._out_dtype(), torch.float32))

    # -- forward helpers ----------------------------------------------------------------------------
    def _checked_input(self, features: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor | None, Exception | None]:
        """This rank's input in config order, or the error that rejects it (raised once every rank knows)."""
        try:
            kjt = (self._raw_ids.layout or self._layout).select(features)
            if kjt.device != self._device:
                raise ValueError(
                    f"the KeyedJaggedTensor is on {kjt.device} but this sharded collection is on "
                    f"{self._device}; move the batch (or the module) with .to()"
                )
            self._check_weights(kjt)
        except (ValueError, TypeError) as e:
            return None, e
        return kjt, None

    def _agree(self, err: Exception | None) -> None:
        """Raise on every rank this module exchanges with if any rejected its input (one all-gather).

        Only where the input dist's header cannot carry the verdict: no model-parallel table, or 2D replicas
        (data-parallel tables then reach beyond the shard group).
        """
        if dist.get_world_size(self._dp_group) > 1:
            status = comm.all_gather_ints([int(err is not None)], self._dp_group, device=self._device)
            bad = [g for g, (e,) in zip(dist.get_process_group_ranks(self._dp_group), status) if e]
            if err is None and bad:
                raise ValueError(
                    f"ranks {bad} rejected their input (see the error raised there); stopping this rank too"
                )
        if err is not None:
            raise err

    def _start(self, features: KeyedJaggedTensor, async_op: bool) -> LookupContext:
        """Check the input and start its input dist (the checks' verdict travels in the dist's header)."""
        kjt, err = self._checked_input(features)
        if not self._routing.has_model_parallel or self._replica_group is not None:
            self._agree(err)
            if not self._routing.has_model_parallel:
                assert kjt is not None  # _agree raised otherwise
                return LookupContext(kjt)
        weights = self._wire_weights(kjt.weights_or_none()) if kjt is not None and self._uses_weights() else None
        try:
            pending = self._kjt_dist.start_input_dist(
                kjt,
                weights,
                rejected=err is not None,
                async_op=async_op,
                row_keys=self._raw_ids.row_keys,
                ids_checked=checks_enabled(),
            )
        except InputRejected:
            if err is not None:
                raise err from None
            raise
        assert kjt is not None  # a rejected input raised above, on every rank
        hook = self._raw_ids.hook  # the ids were routed for this hook: its remap delivers them, whatever comes later
        return LookupContext(kjt, pending, None if hook is None else hook.on_received)

    # -- the three stages: input_dist here, compute and output_dist in the pooled and sequence subclasses ----
    @torch.compiler.disable  # collectives (and host-side bookkeeping): eager, one graph break
    def input_dist(self, features: KeyedJaggedTensor) -> LookupContext:
        """Stage 1: check ``features`` and send every route's ids to the shard's owner (every shard rank's
        batch size travels with them); returns the forward's context with the exchange in flight. Takes over
        the input dist a train pipeline started for this very KJT and handed to this forward (:meth:`feeding`)."""
        ctx = self._feed.take(features)
        if ctx is not None:
            return cast(LookupContext, ctx)
        return self._start(features, async_op=False)

    def prefetch_input_dist(self, features: KeyedJaggedTensor) -> PrefetchedInputDist:
        """Start the input dist of a coming batch now (collective) and return it, for :meth:`feeding`.

        For train pipelines: the ids of batch i+1 travel while batch i computes. Every rank must prefetch the
        same batches in the same order. ``features`` must reach this module's forward as the same object,
        unmodified (a modified one raises); the caller drops what no forward took (``PrefetchedInputDist.drop``).
        """
        return PrefetchedInputDist(features, self._start(features, async_op=True))

    def feeding(self, prefetched: PrefetchedInputDist) -> AbstractContextManager[None]:
        """Within this, a forward given ``prefetched``'s own KJT takes over its input dist (once)."""
        return self._feed.holding(prefetched)

    @staticmethod
    @abstractmethod
    def _configs_of(module: nn.Module) -> list[BaseEmbeddingConfig]: ...

    def _check_weights(self, kjt: KeyedJaggedTensor) -> None:
        pass

    def _uses_weights(self) -> bool:
        return False

    def shard_weights(self) -> list[torch.Tensor]:
        """This rank's pieces of the model-parallel tables (plain parameters; none when fused)."""
        return [] if self._fused_spec is not None else self._shard_params()

    def _shard_params(self) -> list[torch.Tensor]:
        return [self._table_param(ti) for ti, _ in self._local_shards]

    def _dp_params(self) -> list[torch.Tensor]:
        return [self._table_param(ti) for ti in self._routing.dp_tables]

    def _table_param(self, ti: int) -> torch.Tensor:
        return _compat.child_modules(getattr(self, self._attr))[self._layout.tables[ti].name].weight

    def fused_kernels(self) -> list[kernels.FusedPooledKernel]:
        """The fused kernels of this rank (shards first, then data-parallel tables; one per spec in each); empty
        without a fused optimizer."""
        return [g.kernel for g in (*self._fused, *self._dp_fused)]

    def _fused_lookup(
        self,
        groups: list[FusedGroup],
        widths: list[int],
        lengths: torch.Tensor,
        values: torch.Tensor,
        weights: torch.Tensor | None,
        ids_per_feature: list[int],
        batch: int,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        # select() checked every id of this step against its table (and each rank its own), unless checks
        # are off (compiling): then the kernel checks them itself
        return grouped_lookup(
            groups,
            widths,
            lengths,
            values,
            weights,
            ids_per_feature,
            batch,
            group,
            self._scale,
            self._device,
            ids_checked=checks_enabled(),
        )

    def _dp_weights(self, kjt: KeyedJaggedTensor) -> list[torch.Tensor]:
        """The data-parallel tables as the lookup sees them (their backward sums the touched rows over ranks)."""
        feature_table, dp_tables = self._layout.feature_table, self._routing.dp_tables
        return dp_lookup_weights(self._dp_params(), kjt, feature_table, dp_tables, self._dp_group, self._scale)

    def _dp_feature_tables(self) -> list[int]:
        pos = {ti: k for k, ti in enumerate(self._routing.dp_tables)}
        return [pos[self._layout.feature_table[f]] for f in self._routing.dp_features]

    @property
    def raw_id_hook(self) -> RawIdHook | None:
        """The stage hook of the tables fed raw ids (managed collision), or None."""
        return self._raw_ids.hook

    def set_raw_id_hook(self, hook: RawIdHook | None) -> None:
        """Install ``hook`` (``stages.RawIdHook``; None removes it): from the next input dist on, the tables it
        names take raw ids, routed by ``hook.row_key`` and remapped by ``hook.on_received`` at delivery. Input
        dists already started keep the hook they were routed for. Their ids are only checked to be non-negative.
        """
        routing = RawIdRouting(hook, self._layout)  # checks the hook's tables before it attaches
        if hook is not None:
            hook.attach(self)
        self._raw_ids = routing

    def _shard_weights(self, recv: Received) -> list[torch.Tensor]:
        """This rank's shards as the lookup sees them; under 2D replicas their backward sums over the replicas."""
        weights, route_table = self._shard_params(), self._routing.my_route_table
        return shard_lookup_weights(weights, recv, route_table, self._replica_group, self._scale, self._device)
