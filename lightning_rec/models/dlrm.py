"""TorchRec's DLRM family (``torchrec.models.dlrm``): same constructors, shapes and state_dict keys.

``DLRM(embedding_bag_collection=, dense_in_features=, dense_arch_layer_sizes=, over_arch_layer_sizes=)``
maps ``forward(dense_features, sparse_features)`` to logits ``[B, 1]``; a TorchRec DLRM checkpoint loads into
it. ``DLRM_DCN`` and ``DLRM_Projection`` swap the interaction; ``DLRMTrain`` adds the loss. The Lightning model
that trains these parts is ``lightning_rec.models.DLRM`` (``models/lightning_dlrm.py``).
"""

# No ``from __future__ import annotations``: fx-traced copies of these modules are TorchScript-ed by
# TorchRec users, and TorchScript needs the annotations as real objects.

import math
from typing import Any

import torch
from torch import nn

from lightning_rec._compat import is_fx_symbolic_tracing
from lightning_rec.embedding_modules import EmbeddingBagCollection
from lightning_rec.nn import MLP, LowRankCrossNet
from lightning_rec.sparse import KeyedJaggedTensor


def choose(n: int, k: int) -> int:
    """Binomial coefficient (TorchRec's helper)."""
    return math.comb(n, k) if 0 <= k <= n else 0


class SparseArch(nn.Module):
    """Pooled embeddings of every feature as ``[B, F, D]`` (features in the collection's config order)."""

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection) -> None:
        super().__init__()
        # a collection, or a wrapper called the same way (_ManagedSparseArch's managed collision)
        self.embedding_bag_collection: nn.Module = embedding_bag_collection
        configs = embedding_bag_collection.embedding_bag_configs()
        if not configs:
            raise ValueError("SparseArch needs an EmbeddingBagCollection with at least one table")
        self.D = configs[0].embedding_dim
        self._sparse_feature_names = [f for c in configs for f in c.feature_names]
        self.F = len(self._sparse_feature_names)

    @property
    def sparse_feature_names(self) -> list[str]:
        return self._sparse_feature_names

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.embedding_bag_collection(features)
        # the collection's output is already in config order: one reshape, no per-feature copies
        return pooled.values().reshape(-1, self.F, self.D)


class DenseArch(nn.Module):
    """Bottom MLP ``[B, in_features] -> [B, layer_sizes[-1]]`` (ReLU after every layer)."""

    def __init__(self, in_features: int, layer_sizes: list[int], device: torch.device | None = None) -> None:
        super().__init__()
        self.model = MLP(in_features, layer_sizes, bias=True, activation="relu", device=device)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)


def _combined(dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
    return torch.cat([dense_features.unsqueeze(1), sparse_features], dim=1)  # [B, F + 1, D]


class _PairDots(torch.autograd.Function):
    """The dot products of the pairs ``pairs`` (flat indices ``i * n + j``, i < j) of the ``n`` rows of every
    sample of ``combined`` ``[B, n, D]``; ``spread[i * n + j]`` is the pair of (i, j) or (j, i), or the number of
    pairs on the diagonal.

    Backward uses the symmetry of ``C C^T``: the gradient ``G`` (upper triangle) gives ``(G + G^T) C``, a gather
    and one batched matmul where autograd's ``bmm`` backward runs an ``index_put`` and two; the interaction's
    backward takes about half as long (``benchmarks/results/vs_torchrec_golden.md``)."""

    @staticmethod
    def forward(ctx: Any, combined: torch.Tensor, pairs: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(combined, spread)
        b, n, _ = combined.shape
        return torch.bmm(combined, combined.transpose(1, 2)).view(b, n * n).index_select(1, pairs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        combined, spread = ctx.saved_tensors
        b, n, _ = combined.shape
        # G + G^T in one gather: (i, j) and (j, i) read their pair's gradient, the diagonal a zero column
        sym = torch.cat([grad, grad.new_zeros(b, 1)], 1).index_select(1, spread)
        # under autocast the products (and so grad) are narrower than combined: the matmul runs in grad's dtype,
        # as autograd's bmm backward would, and combined's gradient comes back in its own dtype
        return torch.bmm(sym.view(b, n, n), combined.to(grad.dtype)).to(combined.dtype), None, None


class InteractionArch(nn.Module):
    """Dense vector, then the dot products of every pair of ``[dense, sparse_1, ..., sparse_F]``:
    ``[B, D + F + choose(F, 2)]``."""

    triu_indices: torch.Tensor  # buffers (register_buffer in __init__)
    _pairs: torch.Tensor
    _spread: torch.Tensor

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__()
        self.F = num_sparse_features
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """(Re)build the pair indices: buffers so ``.to(device)`` moves them, not persistent (derived from ``F``).
        A model built on the meta device gets them back this way (``DistributedModelParallel`` calls it once the
        buffers have storage), where its buffers would otherwise hold zeros."""
        old = dict(self.named_buffers(recurse=False)).get("triu_indices")
        device = None if old is None or old.device.type == "meta" else old.device
        n = self.F + 1
        triu = torch.triu_indices(n, n, offset=1, device=device)
        pairs = triu[0] * n + triu[1]
        spread = torch.full((n * n,), pairs.numel(), dtype=torch.long, device=device)
        spread[pairs] = spread[triu[1] * n + triu[0]] = torch.arange(pairs.numel(), device=device)
        self.register_buffer("triu_indices", triu, persistent=False)
        self.register_buffer("_pairs", pairs, persistent=False)
        self.register_buffer("_spread", spread, persistent=False)

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        combined = _combined(dense_features, sparse_features)
        if torch.jit.is_scripting() or not self._symmetric_backward(combined):
            # one index_select of the flat products: advanced indexing by (row, column) took 1.8 ms more than
            # the bmm itself at batch 512 x 27 x 128 (one thread)
            dots = torch.bmm(combined, combined.transpose(1, 2)).flatten(1).index_select(1, self._pairs)
            return torch.cat([dense_features, dots], dim=1)
        return torch.cat([dense_features, self._pair_dots(combined)], dim=1)

    @torch.jit.unused
    def _symmetric_backward(self, combined: torch.Tensor) -> bool:
        # tracers (fx, torch.compile / export) record the plain ops, which they can read and fuse
        if is_fx_symbolic_tracing() or torch.compiler.is_compiling():
            return False
        return combined.requires_grad

    @torch.jit.unused
    def _pair_dots(self, combined: torch.Tensor) -> torch.Tensor:
        return _PairDots.apply(combined, self._pairs, self._spread)


class InteractionDCNArch(nn.Module):
    """A cross network over the flattened ``[dense, sparse...]``: ``[B, (F + 1) * D]``."""

    def __init__(self, num_sparse_features: int, crossnet: nn.Module) -> None:
        super().__init__()
        self.F = num_sparse_features
        self.crossnet = crossnet

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        return self.crossnet(_combined(dense_features, sparse_features).flatten(1))


class InteractionProjectionArch(nn.Module):
    """Two MLP branches over the flattened inputs, multiplied as ``[B, F1, D] x [B, D, F2]``:
    ``[B, D + F1 * F2]``."""

    def __init__(
        self, num_sparse_features: int, interaction_branch1: nn.Module, interaction_branch2: nn.Module
    ) -> None:
        super().__init__()
        self.F = num_sparse_features
        self.interaction_branch1 = interaction_branch1
        self.interaction_branch2 = interaction_branch2

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        b, d = dense_features.shape
        flat = _combined(dense_features, sparse_features).reshape(b, -1)
        y = self.interaction_branch1(flat).reshape(b, -1, d)
        z = self.interaction_branch2(flat).reshape(b, d, -1)
        return torch.cat([dense_features, torch.bmm(y, z).reshape(b, -1)], dim=1)


class OverArch(nn.Module):
    """Top MLP: ReLU layers, then a last linear layer without activation."""

    def __init__(self, in_features: int, layer_sizes: list[int], device: torch.device | None = None) -> None:
        super().__init__()
        if len(layer_sizes) <= 1:
            raise ValueError(
                f"OverArch needs at least two layer sizes (ReLU layers, then the output), got {layer_sizes}"
            )
        self.model = nn.Sequential(
            MLP(in_features, layer_sizes[:-1], bias=True, activation="relu", device=device),
            nn.Linear(layer_sizes[-2], layer_sizes[-1], bias=True, device=device),
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)


def _embedding_dim(ebc: EmbeddingBagCollection, dense_arch_layer_sizes: list[int]) -> int:
    configs = ebc.embedding_bag_configs()
    if not configs:
        raise ValueError("DLRM needs at least one embedding table")
    dims = {c.name: c.embedding_dim for c in configs}
    if len(set(dims.values())) > 1:
        raise ValueError(f"every table of a DLRM needs the same embedding_dim, got {dims}")
    d = configs[0].embedding_dim
    if dense_arch_layer_sizes[-1] != d:
        raise ValueError(
            f"the tables' embedding_dim ({d}) and the last dense arch layer size ({dense_arch_layer_sizes[-1]}) "
            "must match"
        )
    return d


class DLRM(nn.Module):
    """DLRM (Naumov et al., 2019) as TorchRec defines it: logits ``[B, 1]`` from dense and sparse features.

    Args:
        embedding_bag_collection: the tables; all with the same ``embedding_dim``.
        dense_in_features: dense features per sample.
        dense_arch_layer_sizes: bottom MLP; must end with ``embedding_dim``.
        over_arch_layer_sizes: top MLP (at least two sizes; the last is the output width, usually 1).
        dense_device: where to allocate the MLPs.
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        dense_arch_layer_sizes: list[int],
        over_arch_layer_sizes: list[int],
        dense_device: torch.device | None = None,
    ) -> None:
        super().__init__()
        d = _embedding_dim(embedding_bag_collection, dense_arch_layer_sizes)
        self.sparse_arch = SparseArch(embedding_bag_collection)
        f = len(self.sparse_arch.sparse_feature_names)
        self.dense_arch = DenseArch(dense_in_features, dense_arch_layer_sizes, device=dense_device)
        self.inter_arch: nn.Module = InteractionArch(num_sparse_features=f)
        self.over_arch = OverArch(d + choose(f, 2) + f, over_arch_layer_sizes, device=dense_device)

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        embedded_dense = self.dense_arch(dense_features)
        embedded_sparse = self.sparse_arch(sparse_features)
        return self.over_arch(self.inter_arch(dense_features=embedded_dense, sparse_features=embedded_sparse))


class DLRM_Projection(DLRM):
    """DLRM whose interaction is ``InteractionProjectionArch`` (two MLP branches)."""

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        dense_arch_layer_sizes: list[int],
        over_arch_layer_sizes: list[int],
        interaction_branch1_layer_sizes: list[int],
        interaction_branch2_layer_sizes: list[int],
        dense_device: torch.device | None = None,
    ) -> None:
        super().__init__(
            embedding_bag_collection, dense_in_features, dense_arch_layer_sizes, over_arch_layer_sizes, dense_device
        )
        d = dense_arch_layer_sizes[-1]
        f = len(self.sparse_arch.sparse_feature_names)
        for name, sizes in (("branch1", interaction_branch1_layer_sizes), ("branch2", interaction_branch2_layer_sizes)):
            if sizes[-1] % d:
                raise ValueError(
                    f"the last interaction {name} layer size ({sizes[-1]}) is not a multiple of the embedding dim ({d})"
                )
        self.inter_arch = InteractionProjectionArch(
            num_sparse_features=f,
            interaction_branch1=DenseArch(f * d + d, interaction_branch1_layer_sizes, device=dense_device),
            interaction_branch2=DenseArch(f * d + d, interaction_branch2_layer_sizes, device=dense_device),
        )
        projected = (interaction_branch1_layer_sizes[-1] // d) * (interaction_branch2_layer_sizes[-1] // d)
        self.over_arch = OverArch(d + projected, over_arch_layer_sizes, device=dense_device)


class DLRM_DCN(DLRM):
    """DLRM whose interaction is a low-rank cross network (DCN-V2)."""

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        dense_arch_layer_sizes: list[int],
        over_arch_layer_sizes: list[int],
        dcn_num_layers: int,
        dcn_low_rank_dim: int,
        dense_device: torch.device | None = None,
    ) -> None:
        super().__init__(
            embedding_bag_collection, dense_in_features, dense_arch_layer_sizes, over_arch_layer_sizes, dense_device
        )
        d = dense_arch_layer_sizes[-1]
        f = len(self.sparse_arch.sparse_feature_names)
        self.inter_arch = InteractionDCNArch(
            num_sparse_features=f,
            crossnet=LowRankCrossNet(in_features=(f + 1) * d, num_layers=dcn_num_layers, low_rank=dcn_low_rank_dim),
        )
        self.over_arch = OverArch((f + 1) * d, over_arch_layer_sizes, device=dense_device)


class DLRMTrain(nn.Module):
    """A DLRM-family model plus its loss: ``forward(batch) -> (loss, (loss, logits, labels))`` (TorchRec's)."""

    def __init__(self, dlrm_module: DLRM) -> None:
        super().__init__()
        self.model = dlrm_module
        self.loss_fn = nn.BCEWithLogitsLoss()

    def forward(self, batch: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        # TorchRec's Batch field names, or lightning_rec.data.Batch's (dense / sparse)
        dense = batch.dense_features if hasattr(batch, "dense_features") else batch.dense
        sparse = batch.sparse_features if hasattr(batch, "sparse_features") else batch.sparse
        logits = self.model(dense, sparse).squeeze(-1)
        loss = self.loss_fn(logits, batch.labels.float())
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())
