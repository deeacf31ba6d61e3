"""The sharded ``EmbeddingCollection``: per-id embeddings through input dist -> compute -> output dist.

The stages are the pooled collection's (``pooled.py``) without pooling: the owner returns each received
id's columns of its shard, and the output dist sends them back to the id's rank, where every feature's
``[ids, dim]`` output is assembled from the pieces of its shards (column shards side by side).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from lightning_rec import kernels
from lightning_rec.configs import BaseEmbeddingConfig, EmbeddingConfig
from lightning_rec.embedding_modules import EmbeddingCollection
from lightning_rec.pipeline.fused_rows import grouped_rows
from lightning_rec.pipeline.output_dist import SequenceOutputDist
from lightning_rec.pipeline.sharded_collection import ShardedCollection
from lightning_rec.pipeline.stages import LookupContext, SequenceLookups
from lightning_rec.plans.shard_geometry import ShardMeta
from lightning_rec.sparse import JaggedTensor, checks_enabled
from lightning_rec.sparse.jagged_tensor import jagged_from_checked


class ShardedEmbeddingCollection(ShardedCollection[SequenceLookups, dict[str, JaggedTensor]]):
    """An ``EmbeddingCollection`` spread over a process group; returns ``{feature: JaggedTensor}`` per rank."""

    _attr = "embeddings"

    @staticmethod
    def _configs_of(module: nn.Module) -> list[BaseEmbeddingConfig]:
        return list(cast(EmbeddingCollection, module).embedding_configs())

    def __init__(
        self,
        module: EmbeddingCollection,
        shards: dict[str, list[ShardMeta] | None],
        shard_group: dist.ProcessGroup,
        **kw: Any,
    ) -> None:
        super().__init__(module, shards, shard_group, **kw)
        # built once per layout, and again on a device or dtype conversion (_apply)
        self._out_dist = SequenceOutputDist(
            self._routing, shard_group, self._layout.dims, self._device, self._out_dtype()
        )

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> ShardedEmbeddingCollection:  # type: ignore[override]
        out = super()._apply(fn, recurse)
        self._out_dist = self._out_dist.to(self._device, self._out_dtype())
        return cast(ShardedEmbeddingCollection, out)

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return list(self._layout.tables)  # type: ignore[arg-type]

    def compute(self, ctx: LookupContext) -> SequenceLookups:
        """Stage 2: the data-parallel tables' rows of this rank's ids (``{feature: [ids, dim]}``), then the rows
        of every id this rank received, per route (source-major within a route)."""
        routing = self._routing
        if self._fused_spec is not None:
            return self._fused_compute(ctx)
        dp: dict[int, torch.Tensor] = {}
        if routing.dp_tables:
            sub = ctx.kjt.permute(list(routing.dp_features))
            embs = kernels.torch_sequence(
                self._dp_weights(ctx.kjt),
                self._dp_feature_tables(),
                sub.values(),
                sub.length_per_key(),
                self._dp_grad.sparse,
            )
            dp = dict(zip(routing.dp_features, embs))
        recv = ctx.wait()
        if recv is None:
            return SequenceLookups(dp, None)
        return SequenceLookups(
            dp,
            kernels.torch_sequence(
                self._shard_weights(recv),
                list(routing.my_route_table),
                recv.values,
                recv.ids_per_route(),
                self.sparse_grad,
            ),
        )

    def _fused_compute(self, ctx: LookupContext) -> SequenceLookups:
        """Stage 2 through fused kernels: each id's row, the tables updated in backward (copies by the union rule)."""
        routing, dev, checked = self._routing, self._device, checks_enabled()
        dp: dict[int, torch.Tensor] = {}
        if self._dp_fused:
            sub = ctx.kjt.permute(list(routing.dp_features))
            values = list(torch.split(sub.values(), sub.length_per_key()))
            group = self._dp_group if dist.get_world_size(self._dp_group) > 1 else None
            rows = grouped_rows(self._dp_fused, values, group, self._scale, dev, checked)
            dp = dict(zip(routing.dp_features, rows))
        recv = ctx.wait()
        if recv is None:
            return SequenceLookups(dp, None)
        values = list(torch.split(recv.values, recv.ids_per_route()))
        return SequenceLookups(dp, grouped_rows(self._fused, values, self._replica_group, self._scale, dev, checked))

    def output_dist(self, ctx: LookupContext, lookups: SequenceLookups) -> dict[str, JaggedTensor]:
        """Stage 3: every id's embedding columns back to the id's rank, summed into each feature's output."""
        layout, kjt, recv = self._layout, ctx.kjt, ctx.received
        b = kjt.stride()
        lpk = kjt.length_per_key()
        dtypes = [self._table_dtypes[ti] for ti in layout.feature_table]
        pieces: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in layout.feature_names]
        if recv is not None:
            pieces = self._out_dist(lookups.shards or [], recv)
        out = {}
        for f, name in enumerate(layout.feature_names):
            if f in lookups.dp:
                emb = lookups.dp[f]
            else:
                d, n = layout.dims[f], lpk[f]
                idx = (
                    torch.cat([i for i, _ in pieces[f]])
                    if pieces[f]
                    else torch.zeros(0, dtype=torch.long, device=self._device)
                )
                src = (
                    torch.cat([c for _, c in pieces[f]])
                    if pieces[f]
                    else torch.zeros(0, dtype=self._out_dtype(), device=self._device)
                )
                emb = torch.zeros(n * d, dtype=src.dtype, device=self._device).index_add(0, idx, src).view(n, d)
            lengths = kjt.lengths()[f * b : (f + 1) * b]
            out[name] = jagged_from_checked(emb.to(self._output_dtype or dtypes[f]), lengths)
        return out
