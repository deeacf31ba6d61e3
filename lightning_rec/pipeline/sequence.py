"""The sharded ``EmbeddingCollection``: per-id embeddings through input dist -> compute -> output dist.

The stages are the pooled collection's (``pooled.py``) without pooling: the owner returns each received
id's columns of its shard, and the output dist sends them back to the id's rank, where every feature's
``[ids, dim]`` output is assembled from the pieces of its shards (column shards side by side).
"""

from __future__ import annotations

import torch

from lightning_rec import kernels
from lightning_rec.configs import EmbeddingConfig
from lightning_rec.pipeline.output_dist import sequence_output_dist
from lightning_rec.pipeline.sharded_collection import LookupContext, ShardedCollection
from lightning_rec.sparse import JaggedTensor, KeyedJaggedTensor
from lightning_rec.sparse.jagged_tensor import jagged_from_checked


class ShardedEmbeddingCollection(ShardedCollection):
    """An ``EmbeddingCollection`` spread over a process group; returns ``{feature: JaggedTensor}`` per rank."""

    _attr = "embeddings"

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return list(self._layout.tables)  # type: ignore[arg-type]

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        ctx = self.input_dist(features)
        ctx = self.compute(ctx)
        return self.output_dist(ctx)

    def compute(self, ctx: LookupContext) -> LookupContext:
        """Stage 2: the data-parallel tables' rows of this rank's ids (``dp_out``: ``{feature: [ids, dim]}``),
        then the rows of every id this rank received, per route (``shard_out``, source-major within a route)."""
        routing = self._routing
        ctx.dp_out = {}
        if routing.dp_tables:
            sub = ctx.kjt.permute(list(routing.dp_features))
            embs = kernels.torch_sequence(
                self._dp_weights(ctx.kjt),
                self._dp_feature_tables(),
                sub.values(),
                sub.length_per_key(),
                self._dp_sparse_grad,
            )
            ctx.dp_out = dict(zip(routing.dp_features, embs))
        recv = ctx.wait()
        if recv is not None:
            ctx.shard_out = kernels.torch_sequence(
                self._shard_weights(recv),
                list(routing.my_route_table),
                recv.values,
                recv.ids_per_route(),
                self.sparse_grad,
            )
        return ctx

    def output_dist(self, ctx: LookupContext) -> dict[str, JaggedTensor]:
        """Stage 3: every id's embedding columns back to the id's rank, summed into each feature's output."""
        layout, kjt, recv = self._layout, ctx.kjt, ctx.received
        b = kjt.stride()
        lpk = kjt.length_per_key()
        dtypes = [self._table_dtypes[ti] for ti in layout.feature_table]
        pieces: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in layout.feature_names]
        if recv is not None:
            pieces = sequence_output_dist(
                ctx.shard_out, recv, self._routing, layout.dims, self._out_dtype(), self._group, self._device
            )
        out = {}
        for f, name in enumerate(layout.feature_names):
            if f in ctx.dp_out:
                emb = ctx.dp_out[f]
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
