"""``quantize_embeddings``: every unsharded embedding collection of a model replaced by its quantized copy
(TorchRec's ``torchrec.inference.modules.quantize_embeddings``)."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_rec.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from lightning_rec.mc import ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection
from lightning_rec.quant import embedding_modules as quant
from lightning_rec.quant import mc as qmc
from lightning_rec.quant.rows import DEFAULT_ROW_ALIGNMENT, QuantConfig, output_type, storage_type
from lightning_rec.sharding import sharded_collections


def _configs(m: EmbeddingBagCollection | EmbeddingCollection) -> list[Any]:
    return list(m.embedding_bag_configs() if isinstance(m, EmbeddingBagCollection) else m.embedding_configs())


def _collections(module: nn.Module) -> list[list[Any]]:
    """The table configs of every unsharded collection quantize_embeddings replaces."""
    return [_configs(m) for m in module.modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))]


def _own(per_table: Mapping[str, Any], configs: list[Any]) -> dict[str, Any]:
    names = {c.name for c in configs}
    return {k: v for k, v in per_table.items() if k in names}


def check_quantizable(
    module: nn.Module,
    dtype: Any = torch.qint8,
    output_dtype: torch.dtype = torch.float32,
    per_table_weight_dtype: Mapping[str, Any] | None = None,
) -> None:
    """Raise what :func:`quantize_embeddings` would refuse, without changing anything: an unknown type, a width
    the storage type cannot pack (naming the table), a ``per_table_weight_dtype`` entry no collection holds,
    sharded collections, managed-collision tables with a bucket resize pending."""
    storage_type(dtype)
    output_type(output_dtype)
    sharded = [p or "<model>" for p, _ in sharded_collections(module)]
    if sharded:
        raise ValueError(
            f"quantize_embeddings needs unsharded collections; {sharded} are sharded. Quantize the unsharded copy "
            "(lightning_rec.export.inference_model(model), collective) or a checkpoint directory "
            "(lightning_rec.quant.load_quantized)"
        )
    for p, m in module.named_modules():
        if isinstance(m, (ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection)):
            for t, mch in m._managed_collision_collection.modules_by_table().items():
                if mch.pending_resize():
                    raise ValueError(
                        f"managed-collision collection {p or '<model>'!r}, table {t!r}: its state was written with "
                        f"{int(mch._mch_num_buckets)} buckets but the module is set to {mch.num_buckets}; run a "
                        "forward (or resize()) of the float model first, so the rows move with their ids"
                    )
    per_table = dict(per_table_weight_dtype or {})
    found = _collections(module)
    names = [c.name for configs in found for c in configs]
    unknown = sorted(set(per_table) - set(names))
    if unknown:
        raise ValueError(
            f"per_table_weight_dtype names tables {unknown} that no collection of the model holds (tables: {names})"
        )
    for configs in found:
        quant.quantized_configs(configs, dtype, _own(per_table, configs))


def quantize_embeddings(
    module: nn.Module,
    dtype: Any = torch.qint8,
    inplace: bool = True,
    additional_qconfig_spec_keys: Sequence[type[nn.Module]] | None = None,
    additional_mapping: Mapping[type[nn.Module], type[nn.Module]] | None = None,
    output_dtype: torch.dtype = torch.float32,
    per_table_weight_dtype: Mapping[str, Any] | None = None,
    *,
    row_alignment: int | None = DEFAULT_ROW_ALIGNMENT,
    kernel: str = "auto",
) -> nn.Module:
    """Replace every (unsharded) ``EmbeddingBagCollection`` / ``EmbeddingCollection`` of ``module`` by its quantized
    copy (:mod:`lightning_rec.quant.embedding_modules`) and return the model. A managed-collision collection
    (``ManagedCollisionEmbeddingBagCollection`` / ``ManagedCollisionEmbeddingCollection``) becomes a
    ``QuantManagedCollisionEmbeddingBagCollection`` / ``QuantManagedCollisionEmbeddingCollection``
    (:mod:`lightning_rec.quant.mc`): its id -> row maps as they are now, read only, and its quantized table.

    Args:
        module: the model (or a collection itself, whose quantized copy is returned).
        dtype: how tables are stored: ``torch.qint8`` (int8), ``torch.quint4x2`` (int4), ``torch.quint2x4``
            (int2), ``torch.float16`` or ``torch.float32`` (also ``"int8"``, ``"int4"``, ``"int2"``, ``"fp16"``).
        inplace: change ``module`` (True), or a deep copy of it.
        additional_qconfig_spec_keys: TorchRec's: module types (exact) whose modules get ``qconfig`` set.
        additional_mapping: TorchRec's: ``{module type: quantized type}`` (exact types) for further modules to
            replace; their ``from_float(m)`` reads ``m.qconfig`` (a :class:`QuantConfig`).
        output_dtype: of the collections' outputs (float32, float16 or bfloat16).
        per_table_weight_dtype: ``{table name: dtype}`` for tables stored otherwise than ``dtype``.
        row_alignment: ``None`` (default): compact rows, fbgemm's row plus the serving trailer padded to 4 bytes;
            an int: fbgemm's rows padded to a multiple of it (16, TorchRec's; 1 packs them).
        kernel: ``"auto"``, ``"fbgemm"`` or ``"torch"`` (see the quantized ``EmbeddingBagCollection``).

    A width the storage type cannot pack (int4 needs an even ``embedding_dim``, int2 a multiple of 4), a value
    fp16 cannot hold, a table name in ``per_table_weight_dtype`` that no collection has, sharded collections, a
    managed table whose bucket resize is pending raise (naming the table or the collection) and leave the model
    unchanged.
    """
    check_quantizable(module, dtype, output_dtype, per_table_weight_dtype)
    per_table = dict(per_table_weight_dtype or {})
    if not inplace:
        module = copy.deepcopy(module)
    qconfig = QuantConfig(
        activation=torch.ao.quantization.PlaceholderObserver.with_args(dtype=output_dtype),
        weight=torch.ao.quantization.PlaceholderObserver.with_args(dtype=dtype),
        per_table_weight_dtype=per_table or None,
    )
    others = dict(additional_mapping or {})
    for m in module.modules():
        if type(m) in others or any(type(m) is k for k in additional_qconfig_spec_keys or ()):
            m.qconfig = qconfig  # type: ignore[assignment]  # TorchRec's protocol: their from_float reads it

    def quantized(m: nn.Module) -> nn.Module | None:
        if isinstance(m, (ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection)):
            # the wrapper is replaced whole: its maps move into the quantized collection with the table
            pooled = isinstance(m, ManagedCollisionEmbeddingBagCollection)
            mc_target = (
                qmc.QuantManagedCollisionEmbeddingBagCollection
                if pooled
                else qmc.QuantManagedCollisionEmbeddingCollection
            )
            return mc_target.from_float(
                m,  # type: ignore[arg-type]
                dtype=dtype,
                output_dtype=output_dtype,
                per_table_weight_dtype=_own(per_table, _configs(m.embedding_module)),  # type: ignore[arg-type]
                row_alignment=row_alignment,
                kernel=kernel,
            )
        if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection)):
            target = (
                quant.EmbeddingBagCollection if isinstance(m, EmbeddingBagCollection) else quant.EmbeddingCollection
            )
            return target.from_float(
                m,  # type: ignore[arg-type]
                dtype=dtype,
                output_dtype=output_dtype,
                per_table_weight_dtype=_own(per_table, _configs(m)),
                row_alignment=row_alignment,
                kernel=kernel,
            )
        if type(m) in others:
            return others[type(m)].from_float(m)  # type: ignore[attr-defined]
        return None

    # every copy is built before any is swapped in: a table that fails to quantize leaves the model unchanged
    swaps: list[tuple[nn.Module | None, str, nn.Module]] = []

    def collect(parent: nn.Module | None, name: str, m: nn.Module) -> None:
        q = quantized(m)
        if q is not None:
            swaps.append((parent, name, q))
            return
        for child_name, child in m.named_children():
            collect(m, child_name, child)

    collect(None, "", module)
    for parent, name, q in swaps:
        if parent is None:
            return q  # the model is a collection itself
        setattr(parent, name, q)
    return module
