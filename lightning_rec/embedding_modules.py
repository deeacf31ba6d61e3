"""Unsharded embedding collections: the reference semantics every sharded plan must reproduce."""

# no ``from __future__ import annotations``: TorchScript reads the annotations of ignored methods as objects
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from lightning_rec import _compat, kernels
from lightning_rec.configs import BaseEmbeddingConfig, EmbeddingBagConfig, EmbeddingConfig

# the layout of a collection's features lives beside it; its names stay importable from here
from lightning_rec.feature_layout import FeatureLayout, check_tables
from lightning_rec.sparse import (
    JaggedTensor,
    KeyedJaggedTensor,
    KeyedTensor,
)


class Table(nn.Module):
    """Holds one table's ``weight`` so that state_dict keys read ``<collection>.<table>.weight``."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)

    def _load_from_state_dict(  # type: ignore[override]
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # Unexpected keys are checked by the container: with tables "a" and "a.b", the key "a.b.weight"
        # starts with this table's prefix "a." but belongs to the other table.
        n = len(unexpected_keys)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        del unexpected_keys[n:]


def _make_tables(tables: Sequence[BaseEmbeddingConfig], device: torch.device | str | None) -> kernels.TableContainer:
    container = kernels.TableContainer()
    for t in tables:
        w = torch.empty(t.num_embeddings, t.embedding_dim, dtype=t.dtype, device=device)
        t.init_weight(w)
        container.add(t.name, Table(w))
    return container


class _CollectionBase(nn.Module):
    """What both collections share: TorchRec's ``device`` attribute and ``reset_parameters``.

    ``torch.jit.script``-able, as TorchRec's: scripted (and fx-traced) code runs ``_traced_forward``, one
    lookup per feature on its JaggedTensor; eager code runs the batched kernels.
    """

    # TorchScript: the layout is Python-only (the scripted forward reads the typed lists below)
    __jit_ignored_attributes__ = ["_layout"]  # noqa: RUF012
    __jit_unused_properties__ = ["device"]  # noqa: RUF012
    _layout: FeatureLayout

    def _set_layout(self, layout: FeatureLayout) -> None:
        self._layout = layout
        # typed copies for the traced / scripted forward
        self._feature_names: list[str] = list(layout.feature_names)
        self._feature_table: list[int] = list(layout.feature_table)
        self._embedding_names: list[str] = list(layout.embedding_names)
        self._dims: list[int] = list(layout.dims)
        self._table_names: list[str] = [t.name for t in layout.tables]
        self._container_name = "embeddings" if isinstance(self, EmbeddingCollection) else "embedding_bags"

    def _table_modules(self) -> kernels.TableContainer:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        for p in self.parameters():
            return p.device
        return torch.device("cpu")

    def reset_parameters(self) -> None:
        """Initialise every table again from its config (``init_fn`` or the uniform bounds)."""
        for t in self._layout.tables:
            w = cast(torch.Tensor, self._table_modules()[t.name].weight)
            if w.device.type != "meta":
                t.init_weight(w)

    @torch.jit.ignore
    def _traced_tables(self) -> list[torch.Tensor]:
        # plain attributes only: under TorchScript ``self`` is the scripted module (no ``_layout``)
        tables = getattr(self, self._container_name)
        if isinstance(tables, nn.Module):
            # fx names a parameter by its dotted module path: a table named "geo.city" has no such path
            dotted = [name for name in _compat.child_modules(tables) if "." in name]
            if dotted:
                raise ValueError(
                    f"torch.fx cannot address tables {dotted}: their names hold a '.', which fx reads as "
                    "a module path. Trace with lightning_rec.export.fx_trace(model), which renames them"
                )
            return [cast(torch.Tensor, cast(kernels.TableContainer, tables)[name].weight) for name in self._table_names]
        return [getattr(tables, name).weight for name in self._table_names]  # TorchScript's C++ module


class EmbeddingBagCollection(_CollectionBase):
    """Pooled embedding tables looked up by a KeyedJaggedTensor (TorchRec's ``EmbeddingBagCollection``).

    Each feature's bag is pooled (SUM or MEAN, per table) into one vector; the output KeyedTensor has one
    block per feature, in config order. Several features may share a table, and one feature may be read by
    several tables (its output keys are then ``"<feature>@<table>"``, as in TorchRec). With
    ``is_weighted=True`` the KJT's per-id weights scale each embedding (weighted MEAN divides the weighted
    sum by the bag length); without it, weights in the input are ignored, as in TorchRec. Input keys the
    tables do not read are ignored (TorchRec's behaviour) unless ``strict_features=True``. A KJT with a
    batch size per feature (VBE) needs ``inverse_indices``; the output has the full batch.

    Args:
        tables: one ``EmbeddingBagConfig`` per table.
        is_weighted: use the KJT weights.
        device: where to allocate the tables.
        kernel: ``"auto"`` (default), ``"fbgemm"`` (one table-batched fbgemm call) or ``"torch"``
            (``F.embedding_bag``; the reference).
        sparse_grad: produce sparse gradients (for torch's SGD, Adagrad, SparseAdam), so a step costs
            what the batch touched, not the table size. ``None`` (default) means dense here; once sharded,
            data-parallel tables then switch to sparse gradients where the optimizer allows it
            (``use_sparse_grads_where_possible``). ``False`` keeps them dense.
        strict_features: raise when the input has keys no table reads.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        kernel: str = "auto",
        sparse_grad: bool | None = None,
        strict_features: bool = False,
    ) -> None:
        super().__init__()
        check_tables(tables, EmbeddingBagConfig, allow_shared=True)
        self._set_layout(FeatureLayout(tables, strict=strict_features, allow_shared=True))
        self._is_mean: list[bool] = list(self._layout.is_mean)
        self._is_weighted = is_weighted
        self.kernel = kernels.validate_kernel(kernel)
        self.sparse_grad = bool(sparse_grad)
        self._sparse_grad_auto = sparse_grad is None  # sharded data-parallel tables may pick sparse themselves
        self.embedding_bags = _make_tables(tables, device)
        self._fbgemm: kernels.FbgemmPooledKernel | None = None

    def _table_modules(self) -> kernels.TableContainer:
        return self.embedding_bags

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return list(self._layout.tables)  # type: ignore[arg-type]

    def is_weighted(self) -> bool:
        return self._is_weighted

    def _weights(self) -> list[torch.Tensor]:
        return [cast(torch.Tensor, self.embedding_bags[t.name].weight) for t in self._layout.tables]

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if torch.jit.is_scripting():
            return self._traced_forward(features)
        return self._eager_forward(features)

    @torch.jit.unused
    def _eager_forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        layout = self._layout
        if _compat.is_fx_symbolic_tracing():
            return self._traced_forward(features)
        if isinstance(features, KeyedJaggedTensor) and features.values().device.type == "meta":
            # shapes only, as TorchRec: a forward on the meta device sizes a model without data
            missing = [f for f in layout.feature_names if f not in features.keys()]  # noqa: SIM118 (a KJT, not a dict)
            if missing:
                raise ValueError(layout.mismatch(features.keys(), missing))
            dtype = kernels.promoted_dtype([w.dtype for w in self._weights()])
            return KeyedTensor(
                layout.embedding_names,
                layout.dims,
                torch.empty(features.stride(), sum(layout.dims), dtype=dtype, device="meta"),
            )
        kjt = layout.select(features)
        psw = None
        if self._is_weighted:
            psw = kjt.weights_or_none()
            if psw is None:
                raise ValueError(
                    "this EmbeddingBagCollection is weighted (is_weighted=True) but the input has no weights"
                )
            if not psw.is_floating_point():
                psw = psw.float()
        tables = self._weights()
        b = kjt.stride()
        if torch.compiler.is_compiling():
            # the fbgemm kernel is opaque to torch.compile; one F.embedding_bag per feature traces
            pooled = self._compiled_pooled(kjt, tables, psw)
        elif kernels.resolve_kernel(self.kernel, tables, self.sparse_grad) == "fbgemm" and b > 0:
            if self._fbgemm is None:
                self._fbgemm = kernels.FbgemmPooledKernel(layout.feature_table)
            pooled = self._fbgemm(tables, kjt.values(), kjt.offsets(), psw)
        else:
            pooled = kernels.torch_pooled(
                tables, layout.feature_table, kjt.values(), kjt.offsets(), b, psw, self.sparse_grad
            )
        pooled = layout.apply_mean(pooled, kjt.lengths(), b)
        return KeyedTensor(layout.embedding_names, layout.dims, pooled)

    def _compiled_pooled(
        self, kjt: KeyedJaggedTensor, tables: list[torch.Tensor], psw: torch.Tensor | None
    ) -> torch.Tensor:
        # narrow() with the same (symbolic) start and length keeps ids and weights the same size for dynamo
        b, values, offsets = kjt.stride(), kjt.values(), kjt.offsets()
        opk, lpk = kjt.offset_per_key(), kjt.length_per_key()
        outs = []
        for i, t in enumerate(self._layout.feature_table):
            w = tables[t]
            bag_offsets = offsets[i * b : (i + 1) * b + 1] - offsets[i * b]
            outs.append(
                F.embedding_bag(
                    values.narrow(0, opk[i], lpk[i]),
                    w,
                    bag_offsets,
                    mode="sum",
                    include_last_offset=True,
                    per_sample_weights=None if psw is None else psw.narrow(0, opk[i], lpk[i]).to(w.dtype),
                    sparse=self.sparse_grad,
                )
            )
        return torch.cat(outs, dim=1)

    def _traced_forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        # torch.fx sees a Proxy, not a KJT, and TorchScript cannot compile the batched kernels: one
        # F.embedding_bag per feature on its JaggedTensor, as TorchRec traces, so the graph holds only KJT /
        # JaggedTensor method calls and torch functions (written so that TorchScript compiles it too).
        jts = features.to_dict(True)
        tables = self._traced_tables()
        outs: list[torch.Tensor] = []
        for i in range(len(self._feature_names)):
            jt = jts[self._feature_names[i]]
            w = tables[self._feature_table[i]]
            psw: torch.Tensor | None = None
            if self._is_weighted:
                psw = jt.weights().to(w.dtype)
            # norm_type as a float: fx records every argument, and TorchScript refuses torch's int default
            out = F.embedding_bag(
                jt.values().long(),
                w,
                jt.offsets().long(),
                mode="sum",
                per_sample_weights=psw,
                include_last_offset=True,
                norm_type=2.0,
            )
            if self._is_mean[i]:
                out = out / jt.lengths().clamp(min=1).unsqueeze(1).to(out.dtype)
            outs.append(out)
        return KeyedTensor(self._embedding_names, self._dims, torch.cat(outs, dim=1), 1, None, None)


class EmbeddingCollection(_CollectionBase):
    """Sequence embedding tables (TorchRec's ``EmbeddingCollection``): one vector per id, no pooling.

    ``forward`` returns ``{feature: JaggedTensor}`` whose values are ``[ids, dim]``, in config order (keys
    ``"<feature>@<table>"`` for a feature read by several tables). With ``need_indices=True`` each
    JaggedTensor's weights are the looked-up ids, as in TorchRec.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        device: torch.device | str | None = None,
        need_indices: bool = False,
        sparse_grad: bool | None = None,
        strict_features: bool = False,
    ) -> None:
        super().__init__()
        check_tables(tables, EmbeddingConfig, allow_shared=True)
        self._set_layout(FeatureLayout(tables, strict=strict_features, allow_shared=True))
        self._need_indices = need_indices
        self.sparse_grad = bool(sparse_grad)
        self._sparse_grad_auto = sparse_grad is None  # sharded data-parallel tables may pick sparse themselves
        self.embeddings = _make_tables(tables, device)

    def _table_modules(self) -> kernels.TableContainer:
        return self.embeddings

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return list(self._layout.tables)  # type: ignore[arg-type]

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_dim(self) -> int:
        return self._layout.dims[0] if self._layout.dims else 0

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        if torch.jit.is_scripting():
            return self._traced_forward(features)
        return self._eager_forward(features)

    @torch.jit.unused
    def _eager_forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        layout = self._layout
        if _compat.is_fx_symbolic_tracing():
            return self._traced_forward(features)
        kjt = layout.select(features)
        tables = [cast(torch.Tensor, self.embeddings[t.name].weight) for t in layout.tables]
        embs = kernels.torch_sequence(
            tables, layout.feature_table, kjt.values(), kjt.length_per_key(), self.sparse_grad
        )
        b = kjt.stride()
        opk = kjt.offset_per_key()
        return {
            name: JaggedTensor(
                e,
                lengths=kjt.lengths()[i * b : (i + 1) * b],
                weights=kjt.values()[opk[i] : opk[i + 1]] if self._need_indices else None,
            )
            for i, (name, e) in enumerate(zip(layout.embedding_names, embs))
        }

    def _traced_forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        # one F.embedding per feature (torch.fx and TorchScript; see EmbeddingBagCollection._traced_forward)
        jts = features.to_dict(True)
        tables = self._traced_tables()
        out: dict[str, JaggedTensor] = {}
        for i in range(len(self._feature_names)):
            jt = jts[self._feature_names[i]]
            out[self._embedding_names[i]] = JaggedTensor(
                F.embedding(jt.values().long(), tables[self._feature_table[i]]),
                weights=jt.values() if self._need_indices else None,
                lengths=jt.lengths(),
                offsets=None,
            )
        return out
