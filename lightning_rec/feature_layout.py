"""What a collection knows of its features, and how it reads a KeyedJaggedTensor: the table checks, the feature
layout in config order, and the input it hands the lookup (keys reordered, int64 ids checked against their
tables, a variable batch per feature expanded, values past the last bag dropped), and MEAN pooling's division.

Shared by the unsharded collections (``embedding_modules``) and the sharded ones, which check the same way.
"""

# no ``from __future__ import annotations``: as in embedding_modules, whose collections TorchScript reads
from collections.abc import Sequence
from typing import cast

import torch

from lightning_rec import kernels
from lightning_rec.configs import BaseEmbeddingConfig, EmbeddingBagConfig, EmbeddingConfig, PoolingType
from lightning_rec.sparse import (
    KeyedJaggedTensor,
    checks_enabled,
    segment_gather_index,
)


def check_tables(
    tables: Sequence[BaseEmbeddingConfig], kind: type = BaseEmbeddingConfig, allow_shared: bool = False
) -> None:
    """Refuse repeated table names and, unless ``allow_shared``, a feature read by several tables.

    The sharded collections and the planner make the same check with the same messages.
    """
    names = set()
    owner: dict[str, str] = {}
    for t in tables:
        if not isinstance(t, kind):
            raise TypeError(f"expected {kind.__name__} objects, got {type(t).__name__}")
        if t.name in names:
            raise ValueError(f"table name {t.name!r} is used twice; table names must be unique")
        names.add(t.name)
        for f in t.feature_names:
            if f in owner and not allow_shared:
                raise ValueError(
                    f"feature {f!r} is listed by tables {owner[f]!r} and {t.name!r}; a feature may look up one table "
                    "(a feature read by several tables works in the unsharded collections only, not yet sharded)"
                )
            owner[f] = t.name


class FeatureLayout:
    """Static facts about a collection's features, in config order (shared with the sharded modules)."""

    def __init__(self, tables: Sequence[BaseEmbeddingConfig], strict: bool = True, allow_shared: bool = False) -> None:
        # allow_shared: one feature read by several tables; only the unsharded collections support it so far
        if not allow_shared:
            check_tables(tables, BaseEmbeddingConfig)
        self.tables = list(tables)
        # strict: the input KJT must hold exactly these features; otherwise extra keys are ignored (TorchRec)
        self.strict = strict
        self.feature_names = [f for t in tables for f in t.feature_names]
        # output keys: a feature read by several tables is named "<feature>@<table>", as in TorchRec
        shared = {f for f in self.feature_names if self.feature_names.count(f) > 1}
        self.embedding_names = [f"{f}@{t.name}" if f in shared else f for t in tables for f in t.feature_names]
        self.feature_table = [i for i, t in enumerate(tables) for _ in t.feature_names]
        self.feature_table_names = [tables[i].name for i in self.feature_table]
        self.dims = [tables[i].embedding_dim for i in self.feature_table]
        self.rows = [tables[i].num_embeddings for i in self.feature_table]
        # every table is an EmbeddingBagConfig or an EmbeddingConfig
        self.is_mean = [
            cast("EmbeddingBagConfig | EmbeddingConfig", tables[i]).pooling == PoolingType.MEAN
            for i in self.feature_table
        ]
        self._index = {f: i for i, f in enumerate(self.feature_names)}

    def mismatch(self, keys: list[str], missing: list[str], duplicated: Sequence[str] = ()) -> str:
        """The error for a KJT with ``keys``: what is missing, unexpected or repeated, and every key it has."""
        ignored = [k for k in keys if k not in self._index]
        found = f"missing {missing}, unexpected {ignored}" if self.strict else f"missing {missing}"
        found += f", duplicated {list(duplicated)}" if duplicated else ""
        # without strict, unexpected keys were dropped silently: naming them shows a misspelt or wrong input
        ignoring = "" if self.strict or not ignored else f"; no table reads {ignored}, ignored as strict_features=False"
        return (
            f"KeyedJaggedTensor keys do not match the collection's features: {found} (expected "
            f"{self.feature_names}; the KeyedJaggedTensor has keys {list(keys)}{ignoring})"
        )

    def select(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """Return ``features`` in config order with int64 ids; raise listing missing and unexpected keys."""
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"expected a KeyedJaggedTensor, got {type(features).__name__}")
        v = features.values()
        if v.dim() != 1 or v.is_floating_point() or v.is_complex() or v.dtype == torch.bool:
            raise ValueError(
                f"the embedding lookup needs 1-D integer ids, but the KeyedJaggedTensor values are "
                f"{v.dtype} of shape {tuple(v.shape)} (features {features.keys()})"
            )
        if features.variable_stride_per_key():
            features = _expand_variable_batch(features)
        keys = features.keys()
        if keys != self.feature_names:
            missing = [f for f in self.feature_names if f not in set(keys)]
            unexpected = [k for k in keys if k not in self._index] if self.strict else []
            # a KJT from permute() may repeat a key; which copy to use would be a guess
            duplicated = sorted({k for k in keys if keys.count(k) > 1 and k in self._index})
            if missing or unexpected or duplicated:
                raise ValueError(self.mismatch(keys, missing, duplicated))
            pos = {k: i for i, k in enumerate(keys)}
            features = features.permute([pos[f] for f in self.feature_names])
        if features.values().dtype != torch.long or features.lengths().dtype != torch.long:
            features = KeyedJaggedTensor(
                features.keys(),
                features.values().long(),
                weights=features.weights_or_none(),
                lengths=features.lengths().long(),
                stride=features.stride(),
                length_per_key=features.length_per_key(),
            )
        if checks_enabled() and features.values().device.type != "meta":
            features = _drop_trailing(features)
            kernels.validate_ids(
                features.values(), features.length_per_key(), self.rows, self.feature_names, self.feature_table_names
            )
        return features

    def apply_mean(self, pooled: torch.Tensor, lengths: torch.Tensor, batch_size: int) -> torch.Tensor:
        if not any(self.is_mean):
            return pooled
        div: torch.Tensor | None
        n = len(self.dims)
        if n and len(set(self.dims)) == 1 and pooled.shape == (batch_size, sum(self.dims)):
            # one width: divide [batch, feature, dim] by [batch, feature, 1] without a [batch, width] divisor
            lens = lengths.view(n, batch_size).to(torch.float32).clamp_min(1.0)
            if not all(self.is_mean):
                lens = torch.where(torch.tensor(self.is_mean, device=lens.device).view(n, 1), lens, 1.0)
            div = lens.t().unsqueeze(2).to(pooled.dtype)
            return (pooled.view(batch_size, n, self.dims[0]) / div).view(batch_size, n * self.dims[0])
        div = kernels.mean_divisor(lengths, self.dims, self.is_mean, batch_size)
        assert div is not None  # some feature is MEAN (checked above)
        return pooled / div.to(pooled.dtype)


def _drop_trailing(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """Without the values / weights past the last bag (TorchRec allows them; they belong to no bag)."""
    lpk = kjt.length_per_key()  # needed by the id check anyway (cached)
    n = sum(lpk)
    v, w = kjt.values(), kjt.weights_or_none()
    if v.size(0) == n and (w is None or w.size(0) == n):
        return kjt
    return KeyedJaggedTensor(
        kjt.keys(),
        v[:n],
        weights=None if w is None else w[:n],
        lengths=kjt.lengths(),
        offsets=kjt.offsets(),
        stride=kjt.stride(),
        length_per_key=lpk,
    )


def _expand_variable_batch(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """A variable-batch (VBE) KJT as a full-batch one: sample ``j`` of feature ``f`` reads the bag
    ``inverse_indices[f][j]``. Pooling the expanded bags equals pooling then expanding (TorchRec's result)."""
    inv = kjt.inverse_indices_or_none()
    if inv is None:
        raise ValueError(
            "this KeyedJaggedTensor has a batch size per feature (stride_per_key_per_rank) but no "
            "inverse_indices: the collections need them to give every feature the full batch"
        )
    inv_keys, inv_t = inv
    row = {k: i for i, k in enumerate(inv_keys)}
    missing = [k for k in kjt.keys() if k not in row]  # noqa: SIM118 (a KJT, not a dict)
    if missing:
        raise ValueError(f"inverse_indices has no row for features {missing} (it has {list(inv_keys)})")
    lopk = kjt.lengths_offset_per_key()
    idx = torch.cat([inv_t[row[k]].long() + lopk[i] for i, k in enumerate(kjt.keys())])
    lengths = kjt.lengths()[idx]
    gather = segment_gather_index(kjt.offsets()[:-1][idx].long(), lengths.long())
    w = kjt.weights_or_none()
    return KeyedJaggedTensor(
        kjt.keys(),
        kjt.values()[gather],
        weights=None if w is None else w[gather],
        lengths=lengths,
        stride=inv_t.size(1),
    )
