"""Unsharded embedding collections: the reference semantics every sharded plan must reproduce."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_rec import kernels
from lightning_rec.configs import BaseEmbeddingConfig, EmbeddingBagConfig, EmbeddingConfig, PoolingType
from lightning_rec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor


class _Table(nn.Module):
    """Holds one table's ``weight`` so that state_dict keys read ``<collection>.<table>.weight``."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):  # type: ignore[override]
        # Unexpected keys are checked by the container: with tables "a" and "a.b", the key "a.b.weight"
        # starts with this table's prefix "a." but belongs to the other table.
        n = len(unexpected_keys)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        del unexpected_keys[n:]


# table names are user data (".", spaces): the container shared with the fused kernels keeps them as given
_TableContainer = kernels.TableContainer


def _check_tables(tables: Sequence[BaseEmbeddingConfig], kind: type) -> None:
    names = set()
    owner: dict[str, str] = {}
    for t in tables:
        if not isinstance(t, kind):
            raise TypeError(f"expected {kind.__name__} objects, got {type(t).__name__}")
        if t.name in names:
            raise ValueError(f"table name {t.name!r} is used twice; table names must be unique")
        names.add(t.name)
        for f in t.feature_names:
            if f in owner:
                raise ValueError(
                    f"feature {f!r} is listed by tables {owner[f]!r} and {t.name!r}; a feature may look up one table"
                )
            owner[f] = t.name


class _FeatureLayout:
    """Static facts about a collection's features, in config order (shared with the sharded modules)."""

    def __init__(self, tables: Sequence[BaseEmbeddingConfig]) -> None:
        self.tables = list(tables)
        self.feature_names = [f for t in tables for f in t.feature_names]
        self.feature_table = [i for i, t in enumerate(tables) for _ in t.feature_names]
        self.feature_table_names = [tables[i].name for i in self.feature_table]
        self.dims = [tables[i].embedding_dim for i in self.feature_table]
        self.rows = [tables[i].num_embeddings for i in self.feature_table]
        self.is_mean = [tables[i].pooling == PoolingType.MEAN for i in self.feature_table]
        self._index = {f: i for i, f in enumerate(self.feature_names)}

    def select(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """Return ``features`` in config order; raise listing missing and unexpected keys."""
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"expected a KeyedJaggedTensor, got {type(features).__name__}")
        keys = features.keys()
        if keys != self.feature_names:
            missing = [f for f in self.feature_names if f not in set(keys)]
            unexpected = [k for k in keys if k not in self._index]
            # a KJT from permute() may repeat a key; which copy to use would be a guess
            duplicated = sorted({k for k in keys if keys.count(k) > 1})
            if missing or unexpected or duplicated:
                raise ValueError(
                    f"KeyedJaggedTensor keys do not match the collection's features: missing {missing}, "
                    f"unexpected {unexpected}" + (f", duplicated {duplicated}" if duplicated else "")
                    + f" (expected {self.feature_names})"
                )
            pos = {k: i for i, k in enumerate(keys)}
            features = features.permute([pos[f] for f in self.feature_names])
        kernels.validate_ids(
            features.values(), features.length_per_key(), self.rows, self.feature_names, self.feature_table_names
        )
        return features

    def apply_mean(self, pooled: torch.Tensor, lengths: torch.Tensor, batch_size: int) -> torch.Tensor:
        div = kernels.mean_divisor(lengths, self.dims, self.is_mean, batch_size)
        return pooled if div is None else pooled / div.to(pooled.dtype)


def _make_tables(tables: Sequence[BaseEmbeddingConfig], device: torch.device | str | None) -> _TableContainer:
    container = _TableContainer()
    for t in tables:
        w = torch.empty(t.num_embeddings, t.embedding_dim, dtype=t.dtype, device=device)
        t.init_weight(w)
        container.add(t.name, _Table(w))
    return container


class EmbeddingBagCollection(nn.Module):
    """Pooled embedding tables looked up by a KeyedJaggedTensor (TorchRec's ``EmbeddingBagCollection``).

    Each feature's bag is pooled (SUM or MEAN, per table) into one vector; the output KeyedTensor has one
    block per feature, in config order. Several features may share a table. With ``is_weighted=True`` the
    KJT's per-id weights scale each embedding (weighted MEAN divides the weighted sum by the bag length);
    without it, weights in the input are ignored, as in TorchRec.

    Args:
        tables: one ``EmbeddingBagConfig`` per table.
        is_weighted: use the KJT weights.
        device: where to allocate the tables.
        kernel: ``"auto"`` (default), ``"fbgemm"`` (one table-batched fbgemm call) or ``"torch"``
            (``F.embedding_bag``; the reference).
        sparse_grad: produce sparse gradients (for torch's SGD, Adagrad, SparseAdam), so a step costs
            what the batch touched, not the table size.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        kernel: str = "auto",
        sparse_grad: bool = False,
    ) -> None:
        super().__init__()
        _check_tables(tables, EmbeddingBagConfig)
        self._layout = _FeatureLayout(tables)
        self._is_weighted = is_weighted
        self.kernel = kernels.validate_kernel(kernel)
        self.sparse_grad = sparse_grad
        self.embedding_bags = _make_tables(tables, device)
        self._fbgemm: kernels.FbgemmPooledKernel | None = None

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return list(self._layout.tables)  # type: ignore[arg-type]

    def is_weighted(self) -> bool:
        return self._is_weighted

    def _weights(self) -> list[torch.Tensor]:
        return [self.embedding_bags[t.name].weight for t in self._layout.tables]

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        layout = self._layout
        kjt = layout.select(features)
        psw = None
        if self._is_weighted:
            psw = kjt.weights_or_none()
            if psw is None:
                raise ValueError("this EmbeddingBagCollection is weighted (is_weighted=True) but the input has no weights")
        tables = self._weights()
        b = kjt.stride()
        if kernels.resolve_kernel(self.kernel, tables, self.sparse_grad) == "fbgemm" and b > 0:
            if self._fbgemm is None:
                self._fbgemm = kernels.FbgemmPooledKernel(layout.feature_table)
            pooled = self._fbgemm(tables, kjt.values(), kjt.offsets(), psw)
        else:
            pooled = kernels.torch_pooled(
                tables, layout.feature_table, kjt.values(), kjt.offsets(), b, psw, self.sparse_grad
            )
        pooled = layout.apply_mean(pooled, kjt.lengths(), b)
        return KeyedTensor(layout.feature_names, layout.dims, pooled)


class EmbeddingCollection(nn.Module):
    """Sequence embedding tables (TorchRec's ``EmbeddingCollection``): one vector per id, no pooling.

    ``forward`` returns ``{feature: JaggedTensor}`` whose values are ``[ids, dim]``, in config order.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        device: torch.device | str | None = None,
        sparse_grad: bool = False,
    ) -> None:
        super().__init__()
        _check_tables(tables, EmbeddingConfig)
        self._layout = _FeatureLayout(tables)
        self.sparse_grad = sparse_grad
        self.embeddings = _make_tables(tables, device)

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return list(self._layout.tables)  # type: ignore[arg-type]

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        layout = self._layout
        kjt = layout.select(features)
        tables = [self.embeddings[t.name].weight for t in layout.tables]
        embs = kernels.torch_sequence(tables, layout.feature_table, kjt.values(), kjt.length_per_key(), self.sparse_grad)
        b = kjt.stride()
        return {
            f: JaggedTensor(e, lengths=kjt.lengths()[i * b : (i + 1) * b])
            for i, (f, e) in enumerate(zip(layout.feature_names, embs))
        }
