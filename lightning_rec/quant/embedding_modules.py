"""Quantized embedding collections for inference (TorchRec's ``torchrec.quant.embedding_modules``).

Same inputs and outputs as the float collections (``KeyedJaggedTensor`` in; ``KeyedTensor`` or
``{feature: JaggedTensor}`` out), same feature rules (missing, unexpected and repeated keys; ids outside a table
raise naming feature and table), same pooling (SUM, MEAN dividing the (weighted) sum by the bag length). Each
table is stored in fbgemm's row-wise layout (:mod:`lightning_rec.quant.rows`) as a uint8 ``weight`` buffer, so
``state_dict`` keys stay ``embedding_bags.<table>.weight`` / ``embeddings.<table>.weight``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from lightning_rec import kernels
from lightning_rec.configs import BaseEmbeddingConfig, DataType, EmbeddingBagConfig, EmbeddingConfig
from lightning_rec.embedding_modules import EmbeddingBagCollection as FloatEmbeddingBagCollection
from lightning_rec.embedding_modules import EmbeddingCollection as FloatEmbeddingCollection
from lightning_rec.embedding_modules import FeatureLayout, check_tables
from lightning_rec.quant.lookup import QuantLookup, TableSpec
from lightning_rec.quant.rows import (
    BITS,
    DEFAULT_ROW_ALIGNMENT,
    check_alignment,
    check_storable,
    output_type,
    quantize_rows,
    relayout,
    table_types,
)
from lightning_rec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor

#: recorded in every quantized collection's state_dict (``_extra_state``) and checked on load
STATE_FORMAT = "lightning_rec.quant/1"


class QuantTable(nn.Module):
    """Holds one table's stored rows, the uint8 ``weight`` buffer ``[rows, row_bytes]``."""

    def __init__(self, weight: torch.Tensor, spec: TableSpec | None = None) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self._spec = spec

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
        given = state_dict.get(prefix + "weight")
        if isinstance(given, torch.Tensor) and given.dtype != torch.uint8:
            # copy_ would cast float weights into bytes without a word
            error_msgs.append(
                f"{prefix}weight: a quantized table holds its stored rows (uint8), got {given.dtype} of shape "
                f"{list(given.shape)}; load float weights into the float model, then quantize it"
            )
            return
        own = self.weight
        if (
            self._spec is not None
            and isinstance(given, torch.Tensor)
            and isinstance(own, torch.Tensor)
            and given.dim() == 2
            and given.shape[0] == own.shape[0]
            and given.shape != own.shape
        ):
            # rows written in another layout (e.g. the previous default, 16-byte rows): the bytes the kernels read
            # are the same in every layout, so they convert; the collection's extra state matched type and shape
            s = self._spec
            conv = torch.empty(own.shape, dtype=torch.uint8, device=given.device if own.is_meta else own.device)
            try:
                relayout(given, conv, s.dim, s.data_type, s.name)
            except ValueError as e:
                error_msgs.append(f"{prefix}weight: {e}")
                return
            state_dict = {**state_dict, prefix + "weight": conv}
        # unexpected keys are checked by the container (a key of table "a.b" starts with "a.")
        n = len(unexpected_keys)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        del unexpected_keys[n:]


def _storage_type(t: BaseEmbeddingConfig) -> DataType:
    dt = t.data_type or DataType.FP32
    if dt not in BITS:
        raise ValueError(
            f"table {t.name!r}: a quantized collection stores INT8, INT4, INT2, FP16 or FP32 rows, not {dt.name}"
        )
    check_storable(t.name, t.embedding_dim, dt)
    return dt


def quantized_configs(
    tables: Sequence[BaseEmbeddingConfig], dtype: Any, per_table_weight_dtype: Mapping[str, Any] | None
) -> list[Any]:
    """Copies of ``tables`` whose ``data_type`` is the storage type (``dtype``, or the table's entry in
    ``per_table_weight_dtype``), as TorchRec's ``from_float`` reports them; every width checked first."""
    types = table_types([t.name for t in tables], dtype, per_table_weight_dtype)
    out = []
    for t in tables:
        check_storable(t.name, t.embedding_dim, types[t.name])
        c = copy.copy(t)  # the configs' own __post_init__ accepts float types only: set after construction
        c.data_type = types[t.name]
        out.append(c)
    return out


def from_float_options(
    module: nn.Module, dtype: Any, output_dtype: Any, per_table: Mapping[str, Any] | None
) -> tuple[Any, torch.dtype, Mapping[str, Any] | None]:
    """``(storage dtype, output dtype, per-table dtypes)`` of ``from_float``: the arguments given, else the
    module's ``qconfig`` (TorchRec's way)."""
    qconfig = getattr(module, "qconfig", None)
    if dtype is None:
        if qconfig is None:
            raise ValueError(
                f"{type(module).__name__}.from_float needs the module's qconfig (lightning_rec.quant.QuantConfig, as "
                "TorchRec) or dtype= (e.g. torch.qint8); quantize_embeddings(model, dtype) sets both for you"
            )
        dtype = qconfig.weight().dtype
        if per_table is None:
            per_table = getattr(qconfig, "per_table_weight_dtype", None)
    if output_dtype is None:
        output_dtype = qconfig.activation().dtype if qconfig is not None else torch.float32
    return dtype, output_type(output_dtype), per_table


class _QuantCollection(nn.Module):
    """What both quantized collections share: stored tables, the lookup, device, output dtype, state checks."""

    _attr = ""

    def _setup(
        self,
        tables: Sequence[BaseEmbeddingConfig],
        pooled: bool,
        device: torch.device | str | None,
        output_dtype: torch.dtype,
        row_alignment: int | None,
        kernel: str,
        strict_features: bool,
    ) -> None:
        check_tables(tables, EmbeddingBagConfig if pooled else EmbeddingConfig, allow_shared=True)
        check_alignment(row_alignment)
        self._layout = FeatureLayout(tables, strict=strict_features, allow_shared=True)
        self._output_dtype = output_type(output_dtype)
        self.row_alignment = row_alignment
        self._specs = [TableSpec(t.name, t.num_embeddings, t.embedding_dim, _storage_type(t)) for t in tables]
        # MEAN divides after pooling: pool in fp32, then round once to the output dtype
        pooled_dtype = torch.float32 if any(self._layout.is_mean) else self._output_dtype
        self._lookup = QuantLookup(self._specs, self._layout.feature_table, pooled, pooled_dtype, row_alignment, kernel)
        container = kernels.TableContainer()
        for s, w in zip(self._specs, self._lookup.allocate(device)):
            container.add(s.name, QuantTable(w, s))
        setattr(self, self._attr, container)

    def _weights(self) -> list[torch.Tensor]:
        """The stored rows, in config order, each the fbgemm kernel's own view (rebuilt if one is not)."""
        tables = cast(kernels.TableContainer, getattr(self, self._attr))
        weights = [cast(torch.Tensor, tables[s.name].weight) for s in self._specs]
        fresh = self._lookup.bind(weights)
        if fresh is None:
            return weights
        for s, w in zip(self._specs, fresh):
            tables[s.name].weight = w
        return fresh

    def use_torch_lookup(self) -> None:
        """Dequantize in torch from now on, every table in a buffer of its own: what ``torch.export`` traces.

        The program then holds aten ops only and serves without fbgemm. fbgemm's module cannot be traced (it holds a
        TorchScript counter without a fake class), and its tables are views of one flat buffer, which
        ``torch.export.save`` would store as overlapping tensors."""
        tables = cast(kernels.TableContainer, getattr(self, self._attr))
        for s in self._specs:
            tables[s.name].weight = cast(torch.Tensor, tables[s.name].weight).clone()
        self._lookup.use_torch()

    def copy_rows_from(self, other: _QuantCollection) -> None:
        """Take ``other``'s stored rows: a collection of the same tables, storage types and row alignment."""
        if other.get_extra_state() != self.get_extra_state():
            raise ValueError(
                f"cannot copy stored rows between collections of different tables or storage: "
                f"{other.get_extra_state()} vs {self.get_extra_state()}"
            )
        with torch.no_grad():
            for s, dst, src in zip(self._specs, self._weights(), other._weights()):
                relayout(src, dst, s.dim, s.data_type, s.name)

    def quantize_from(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Store float ``weights`` (``{table: [rows, dim]}``, every table) in this collection's formats."""
        missing = [s.name for s in self._specs if s.name not in weights]
        if missing:
            raise ValueError(f"no weights given for tables {missing}")
        for s, dst in zip(self._specs, self._weights()):
            w = weights[s.name]
            if tuple(w.shape) != (s.rows, s.dim):
                raise ValueError(f"table {s.name!r}: weights of shape {list(w.shape)}, expected {[s.rows, s.dim]}")
            quantize_rows(w, s.data_type, dst, s.name)

    @property
    def device(self) -> torch.device:
        for b in self.buffers():
            return b.device
        return torch.device("cpu")

    def output_dtype(self) -> torch.dtype:
        return self._output_dtype

    def storage_types(self) -> dict[str, DataType]:
        """``{table: how its rows are stored}``, in config order."""
        return {s.name: s.data_type for s in self._specs}

    def storage_bytes(self) -> int:
        """Bytes of every stored row (padding included)."""
        tables = cast(kernels.TableContainer, getattr(self, self._attr))
        return sum(cast(torch.Tensor, tables[s.name].weight).numel() for s in self._specs)

    def get_extra_state(self) -> dict[str, Any]:
        # a state_dict records each table's storage, so rows of another type or width never load as these
        return {
            "format": STATE_FORMAT,
            "row_alignment": self.row_alignment,
            "tables": {s.name: [s.data_type.name, s.rows, s.dim] for s in self._specs},
        }

    def set_extra_state(self, state: Any) -> None:
        mine = self.get_extra_state()
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"not the state of a lightning_rec quantized collection (format {STATE_FORMAT})")
        theirs, ours = state.get("tables", {}), mine["tables"]
        problems = [f"table {n!r} is not in this collection" for n in theirs if n not in ours]
        problems += [f"table {n!r} is missing from the state_dict" for n in ours if n not in theirs]
        problems += [
            f"table {n!r} is stored as {theirs[n][0]} [{theirs[n][1]} x {theirs[n][2]}] in the state_dict but as "
            f"{ours[n][0]} [{ours[n][1]} x {ours[n][2]}] here"
            for n in ours
            if n in theirs and list(theirs[n]) != ours[n]
        ]
        # another row_alignment is no problem: each table's rows are converted as they load (QuantTable)
        if problems:
            raise ValueError("quantized state_dict does not match the collection: " + "; ".join(problems))

    def extra_repr(self) -> str:
        kinds = sorted({s.data_type.name for s in self._specs})
        return f"tables={len(self._specs)}, storage={'/'.join(kinds)}, output_dtype={self._output_dtype}"


class EmbeddingBagCollection(_QuantCollection):
    """Pooled tables stored quantized (TorchRec's ``torchrec.quant.embedding_modules.EmbeddingBagCollection``).

    ``forward(kjt) -> KeyedTensor`` as the float ``EmbeddingBagCollection``: SUM or MEAN per table, per-id
    weights with ``is_weighted=True``, output keys in config order. Build it with :meth:`from_float` (or
    :func:`lightning_rec.quant.quantize_embeddings`); constructed directly, each config's ``data_type`` (set on
    the config after construction, as TorchRec's ``from_float`` does) is its storage type and the rows start at
    zero (load a quantized ``state_dict`` into them).

    Args:
        tables: one ``EmbeddingBagConfig`` per table.
        is_weighted: use the KJT's per-id weights.
        device: where the rows live (fbgemm's kernel serves CPU, and CUDA with a CUDA build).
        output_dtype: of the pooled output: float32, float16 or bfloat16.
        row_alignment: ``None`` (default): the compact layout, each row what fbgemm's format needs plus the serving
            trailer the CPU row-wise kernels read, padded to 4 bytes (on CUDA, where fbgemm's kernel needs it, 16);
            an int: fbgemm's rows padded to a multiple of it (TorchRec's 16; 1 packs them). A state_dict of another
            alignment loads, its rows converted.
        kernel: ``"auto"`` (fbgemm where the installed build has the kernel for the device, else torch with one
            warning), ``"fbgemm"`` or ``"torch"`` (dequantize the looked-up rows, pool with ``F.embedding_bag``).
        strict_features: raise when the input has keys no table reads.
    """

    _attr = "embedding_bags"

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        output_dtype: torch.dtype = torch.float32,
        *,
        row_alignment: int | None = DEFAULT_ROW_ALIGNMENT,
        kernel: str = "auto",
        strict_features: bool = False,
    ) -> None:
        super().__init__()
        self._is_weighted = is_weighted
        self._setup(tables, True, device, output_dtype, row_alignment, kernel, strict_features)

    @classmethod
    def from_float(
        cls,
        module: FloatEmbeddingBagCollection,
        use_precomputed_fake_quant: bool = False,
        *,
        dtype: Any = None,
        output_dtype: torch.dtype | None = None,
        per_table_weight_dtype: Mapping[str, Any] | None = None,
        row_alignment: int | None = DEFAULT_ROW_ALIGNMENT,
        kernel: str = "auto",
    ) -> EmbeddingBagCollection:
        """The quantized copy of a float (unsharded) ``EmbeddingBagCollection``. The storage type is ``dtype``,
        else ``module.qconfig.weight().dtype`` (TorchRec's way); ``per_table_weight_dtype`` (or the qconfig's)
        overrides it per table; ``output_dtype`` defaults to ``module.qconfig.activation().dtype`` or float32."""
        if not isinstance(module, FloatEmbeddingBagCollection):
            raise TypeError(
                f"from_float expects an unsharded lightning_rec EmbeddingBagCollection, got {type(module).__name__}"
            )
        dtype, out, per_table = from_float_options(module, dtype, output_dtype, per_table_weight_dtype)
        configs = quantized_configs(module.embedding_bag_configs(), dtype, per_table)
        q = cls(
            configs,
            module.is_weighted(),
            module.device,
            out,
            row_alignment=row_alignment,
            kernel=kernel,
            strict_features=module._layout.strict,
        )
        q.quantize_from({t.name: cast(torch.Tensor, module.embedding_bags[t.name].weight) for t in configs})
        return q

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return list(self._layout.tables)  # type: ignore[arg-type]

    def is_weighted(self) -> bool:
        return self._is_weighted

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        layout = self._layout
        kjt = layout.select(features)
        psw = None
        if self._is_weighted:
            psw = kjt.weights_or_none()
            if psw is None:
                raise ValueError(
                    "this EmbeddingBagCollection is weighted (is_weighted=True) but the input has no weights"
                )
        b = kjt.stride()
        pooled = self._lookup.pooled_sum(self._weights(), kjt.values(), kjt.offsets(), psw, b, kjt.offset_per_key())
        pooled = layout.apply_mean(pooled, kjt.lengths(), b).to(self._output_dtype)
        return KeyedTensor(layout.embedding_names, layout.dims, pooled)


class EmbeddingCollection(_QuantCollection):
    """Sequence tables stored quantized (TorchRec's ``torchrec.quant.embedding_modules.EmbeddingCollection``).

    ``forward(kjt) -> {feature: JaggedTensor}`` as the float ``EmbeddingCollection`` (``[ids, dim]`` values,
    the ids as weights with ``need_indices=True``). Tables may differ in width (TorchRec's requires one width).
    Arguments as the quantized ``EmbeddingBagCollection``, plus ``need_indices``.
    """

    _attr = "embeddings"

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        device: torch.device | str | None = None,
        need_indices: bool = False,
        output_dtype: torch.dtype = torch.float32,
        *,
        row_alignment: int | None = DEFAULT_ROW_ALIGNMENT,
        kernel: str = "auto",
        strict_features: bool = False,
    ) -> None:
        super().__init__()
        self._need_indices = need_indices
        self._setup(tables, False, device, output_dtype, row_alignment, kernel, strict_features)

    @classmethod
    def from_float(
        cls,
        module: FloatEmbeddingCollection,
        use_precomputed_fake_quant: bool = False,
        *,
        dtype: Any = None,
        output_dtype: torch.dtype | None = None,
        per_table_weight_dtype: Mapping[str, Any] | None = None,
        row_alignment: int | None = DEFAULT_ROW_ALIGNMENT,
        kernel: str = "auto",
    ) -> EmbeddingCollection:
        """The quantized copy of a float (unsharded) ``EmbeddingCollection``; options as the pooled one's."""
        if not isinstance(module, FloatEmbeddingCollection):
            raise TypeError(
                f"from_float expects an unsharded lightning_rec EmbeddingCollection, got {type(module).__name__}"
            )
        dtype, out, per_table = from_float_options(module, dtype, output_dtype, per_table_weight_dtype)
        configs = quantized_configs(module.embedding_configs(), dtype, per_table)
        q = cls(
            configs,
            module.device,
            module.need_indices(),
            out,
            row_alignment=row_alignment,
            kernel=kernel,
            strict_features=module._layout.strict,
        )
        q.quantize_from({t.name: cast(torch.Tensor, module.embeddings[t.name].weight) for t in configs})
        return q

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return list(self._layout.tables)  # type: ignore[arg-type]

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_dim(self) -> int:
        return self._layout.dims[0] if self._layout.dims else 0

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        layout = self._layout
        kjt = layout.select(features)
        opk = kjt.offset_per_key()
        embs = self._lookup.sequence(self._weights(), kjt.values(), opk)
        b = kjt.stride()
        return {
            name: JaggedTensor(
                e,
                lengths=kjt.lengths()[i * b : (i + 1) * b],
                weights=kjt.values()[opk[i] : opk[i + 1]] if self._need_indices else None,
            )
            for i, (name, e) in enumerate(zip(layout.embedding_names, embs))
        }
