"""The sharded ``EmbeddingBagCollection``: pooled lookups through input dist -> compute -> output dist.

Every model-parallel sharding type (table-wise, row-wise, column-wise, table-row-wise, grid) is a tiling
of the table into rectangular shards (``shard_geometry.ShardMeta``), each owned by one rank of the shard
group. The stages only ever see shards, so the types differ in their layout, not in their code:

* :meth:`~ShardedCollection.input_dist` -- for every (feature, shard) pair (a *route*), each rank keeps the
  ids that fall in the shard's row block, makes them local to the block and sends them, with their bag
  lengths, to the shard's owner (a fixed-size header all-to-all of batch size and id counts, then one
  all-to-all of lengths, ids and weights). A train pipeline may start it one batch ahead.
* :meth:`ShardedEmbeddingBagCollection.compute` -- the data-parallel tables look up this rank's samples
  while the ids travel; then the owner pools each received bag over its local rows and columns with SUM.
* :meth:`ShardedEmbeddingBagCollection.output_dist` -- pooled partial rows go back to the rank that owns
  the sample (all-to-all, the reverse of the input dist) and are placed into their columns: row blocks add
  up (row-wise's reduce-scatter, done as all-to-all + local sum so gloo can run it), column blocks sit side
  by side. MEAN pooling then divides by the full bag length, once, on the sample's rank (C1).

Backward comm: the reverse all-to-all of the pooled gradient; ids get none. Gradient scale (C2): each
shard receives the sum of every rank's gradient; ``embedding_grad="mean"`` multiplies it by
``1 / data-parallel ranks`` in ``collectives.embedding_grad``, the one place a scale is applied.
Data-parallel tables skip the dists: every rank looks up its own replica and, in backward, the rows
some rank touched are summed across ranks (only those rows move) and scaled the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from lightning_rec import kernels
from lightning_rec.configs import BaseEmbeddingConfig, EmbeddingBagConfig
from lightning_rec.embedding_modules import EmbeddingBagCollection
from lightning_rec.pipeline import collectives as comm
from lightning_rec.pipeline.input_dist import Received
from lightning_rec.pipeline.output_dist import OutputDistKind, PooledOutputDist, QuantizedCommCodecs
from lightning_rec.pipeline.sharded_collection import ShardedCollection
from lightning_rec.pipeline.stages import LookupContext, PooledLookups
from lightning_rec.plans.shard_geometry import ShardMeta
from lightning_rec.sparse import KeyedJaggedTensor, KeyedTensor, offsets_from_lengths
from lightning_rec.sparse._utils import cumsum_list, from_checked


class ShardedEmbeddingBagCollection(ShardedCollection[PooledLookups, KeyedTensor]):
    """An ``EmbeddingBagCollection`` whose tables are spread over a process group by a plan.

    Same input (each rank its own local KJT; batch sizes may differ) and same output (a local KeyedTensor
    in config order) as the unsharded module. ``forward`` is ``input_dist -> compute -> output_dist``.
    """

    _attr = "embedding_bags"
    _pooled = True

    @staticmethod
    def _configs_of(module: nn.Module) -> list[BaseEmbeddingConfig]:
        return list(cast(EmbeddingBagCollection, module).embedding_bag_configs())

    def __init__(
        self,
        module: EmbeddingBagCollection,
        shards: dict[str, list[ShardMeta] | None],
        shard_group: dist.ProcessGroup,
        *,
        qcomm_codecs: QuantizedCommCodecs | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(module, shards, shard_group, **kw)
        self._is_weighted = module.is_weighted()
        self._qcomm = qcomm_codecs  # the output dist's wire precision (its codecs); None: as the rows are
        # built once per layout; it holds no tensor, so a device move keeps it (the input dist moves: _apply)
        self._out_dist = PooledOutputDist(self._routing, shard_group, qcomm_codecs)

    @property
    def qcomm_codecs(self) -> QuantizedCommCodecs | None:
        """The wire precision of the output dist (forward rows, backward gradients); None: unchanged."""
        return self._qcomm

    @property
    def output_dist_kind(self) -> OutputDistKind:
        """Which exchange the output dist runs (flat, host blocks, quantized), decided when it was built."""
        return self._out_dist.kind

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return list(self._layout.tables)  # type: ignore[arg-type]

    def is_weighted(self) -> bool:
        return self._is_weighted

    def _uses_weights(self) -> bool:
        return self._is_weighted

    def _check_weights(self, kjt: KeyedJaggedTensor) -> None:
        if self._is_weighted and kjt.weights_or_none() is None:
            raise ValueError("this EmbeddingBagCollection is weighted (is_weighted=True) but the input has no weights")

    def _build_lookups(self) -> None:
        """The pooled lookups of this rank's shards and of the data-parallel tables, grouped by kernel (none:
        fused kernels look up instead)."""
        self._shard_lookup: kernels.GroupedPooledLookup | None = None
        self._dp_table_lookup: kernels.GroupedPooledLookup | None = None
        if self._fused_spec is not None:
            return
        routing, kinds, dtypes = self._routing, self._table_kernels, self._table_dtypes
        local = [ti for ti, _ in self._local_shards]
        self._shard_lookup = kernels.GroupedPooledLookup(
            [kinds[ti] for ti in local],
            [dtypes[ti] for ti in local],
            routing.my_route_table,
            [r.shard.cols for r in routing.my_routes],
        )
        dp = routing.dp_tables
        self._dp_table_lookup = kernels.GroupedPooledLookup(
            [kinds[ti] for ti in dp],
            [dtypes[ti] for ti in dp],
            self._dp_feature_tables(),
            [self._layout.dims[f] for f in routing.dp_features],
        )

    def compute(self, ctx: LookupContext) -> PooledLookups:
        """Stage 2: the data-parallel tables pool this rank's samples while the ids travel; then this rank's
        shards SUM-pool every bag it received."""
        dp = self._dp_lookup(ctx.kjt) if self._routing.dp_tables else None
        recv = ctx.wait()
        return PooledLookups(dp, None if recv is None else self._lookup_shards(recv, sum(recv.batches)))

    def output_dist(self, ctx: LookupContext, lookups: PooledLookups) -> KeyedTensor:
        """Stage 3: every rank's pooled rows for this rank's samples into their columns of the ``[b, sum of
        dims]`` output, beside the data-parallel columns; then MEAN (C1) and the output dtype."""
        layout, routing, kjt, recv = self._layout, self._routing, ctx.kjt, ctx.received
        b = kjt.stride()
        if recv is None:  # every table data-parallel: their columns are the output, in config order
            out = (
                lookups.dp
                if lookups.dp is not None
                else torch.zeros(b, 0, dtype=self._out_dtype(), device=self._device)
            )
        else:
            out = self._out_dist(lookups.shards, lookups.dp, recv.batches, b)
            if not routing.my_routes and recv.weights is not None and recv.weights.requires_grad:
                # weights received for no shard still came by a differentiable all-to-all that every rank must
                # run backward: keep it in this rank's graph, or the ranks holding shards wait for it forever
                out = comm.tie_backward(out, recv.weights)
        out = layout.apply_mean(out, kjt.lengths(), b)
        if self._output_dtype is not None and out.dtype != self._output_dtype:
            out = out.to(self._output_dtype)
        return KeyedTensor(layout.feature_names, layout.dims, out)

    def _dp_lookup(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """``[batch, widths of the data-parallel features]``: every rank looks up its own replica."""
        b, dtype = kjt.stride(), self._out_dtype()
        dp_features = list(self._routing.dp_features)
        # every feature data-parallel (the usual data_parallel plan): the input is already the sub-batch
        sub = kjt if dp_features == list(range(len(kjt.keys()))) else _permuted(kjt, dp_features)
        psw = self._wire_weights(sub.weights_or_none()) if self._is_weighted else None
        if self._dp_fused:
            group = self._dp_group if dist.get_world_size(self._dp_group) > 1 else None
            widths = [self._layout.dims[f] for f in dp_features]
            return self._fused_lookup(
                self._dp_fused, widths, sub.lengths(), sub.values(), psw, sub.length_per_key(), b, group
            ).to(dtype)
        assert self._dp_table_lookup is not None
        return self._dp_table_lookup(
            self._dp_weights(kjt),
            sub.values(),
            sub.offsets(),
            b,
            psw,
            self._dp_grad.sparse,
            storage=self._dp_params(),
            bounds=self._host_bounds(sub.length_per_key),  # read once by the input check: no second host sync
        ).to(dtype)

    @staticmethod
    def _host_bounds(counts: Callable[[], list[int]]) -> list[int] | None:
        """Where each feature's ids start (and end), from ``counts`` the host already holds; None while compiling,
        where sizes that change every step would recompile the graph (the kernel reads the offsets instead)."""
        return None if torch.compiler.is_compiling() else cumsum_list(counts())

    def _lookup_shards(self, recv: Received, b_global: int) -> torch.Tensor:
        """SUM-pool every received bag over this rank's shards: ``[b_global, route columns]``."""
        dtype, routing = self._out_dtype(), self._routing
        if self._fused:
            return self._fused_lookup(
                self._fused,
                [r.shard.cols for r in routing.my_routes],
                recv.lengths,
                recv.values,
                recv.weights,
                recv.ids_per_route(),
                b_global,
                self._replica_group,
            ).to(dtype)
        if not routing.my_routes:
            return torch.zeros(b_global, 0, dtype=dtype, device=self._device)
        assert self._shard_lookup is not None
        return self._shard_lookup(
            self._shard_weights(recv),
            recv.values,
            offsets_from_lengths(recv.lengths),
            b_global,
            recv.weights,
            self.sparse_grad,
            storage=self._shard_params(),
            bounds=self._host_bounds(recv.ids_per_route),  # from the input dist's header, on the host
        ).to(dtype)


def _permuted(kjt: KeyedJaggedTensor, features: list[int]) -> KeyedJaggedTensor:
    """``kjt.permute(features)`` of an input already checked: built without checking it again (each check reads
    the device), except while compiling, where no check runs anyway."""
    if torch.compiler.is_compiling():
        return kjt.permute(features)
    with from_checked():
        return kjt.permute(features)
