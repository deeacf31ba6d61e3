"""Row-wise CPU lookups: the stored rows read in place by the fused 8-bit / n-bit row-wise kernels of torch and fbgemm.

fbgemm's inference kernel reads fbgemm's rows (scale and bias first, fp16) but on CPU takes ~350 ns a lookup
(docs/ARCHITECTURE.md F16). The row-wise kernels (``quantized::embedding_bag_byte_rowwise_offsets``, ``..._4bit_...``,
``..._2bit_...``, and fbgemm's CPU forward ``split_embedding_codegen_forward_cpu`` over uint8 rows) are JIT-compiled
and take ~5 ns, but read the scale and bias at the *end* of a row (INT8: fp32, INT4 / INT2: fp16). Rows whose
padding has room carry that copy there (:mod:`lightning_rec.quant.rows`, the serving trailer), so the kernels read
the stored rows themselves, with no second copy: a row of ``row_bytes`` is, to them, a row of ``width`` values (INT8:
``row_bytes - 8``; INT4: ``2 * (row_bytes - 4)``; INT2: ``4 * (row_bytes - 4)``) whose values ``first`` ..
``first + dim`` are the table's (the leading scale and bias read as values, the padding as zeros); the other
output columns are dropped. The sums are the dequantized rows' (``scale * q + bias`` in fp32, the kernels fuse the
multiply-add), equal to fbgemm's within fp32 rounding.

INT8 tables that are views of one buffer (the collection allocates them so; a file mapped by
:func:`lightning_rec.quant.load_quantized_tables` is one buffer) are looked up by one call of fbgemm's forward for
every feature, straight into ``[batch, columns]``; other tables, one torch call per feature. FP16 / FP32 tables and
rows without room for the trailer dequantize in torch: the default (compact) layout always has room; with an int
``row_alignment`` INT8 rows need 8 bytes of padding (at 16: ``dim % 16`` in 0 or 4), INT4 / INT2 rows 4.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from lightning_rec import _compat
from lightning_rec.configs import DataType
from lightning_rec.kernels._capability import has_fbgemm_op
from lightning_rec.quant.mapped import MappedRows, plain_alias
from lightning_rec.quant.rows import (
    SCALE_BIAS_BYTES,
    TRAILER_BYTES,
    dequantize_rows,
    trailer_fits,
    trailer_ok,
    write_trailer,
)

#: fbgemm's CPU table-batched forward: over uint8 rows, the fused 8-bit row-wise kernel for many tables at once
FLAT_OP = "fbgemm::split_embedding_codegen_forward_cpu"
_TORCH_OPS = {
    DataType.INT8: "embedding_bag_byte_rowwise_offsets",
    DataType.INT4: "embedding_bag_4bit_rowwise_offsets",
    DataType.INT2: "embedding_bag_2bit_rowwise_offsets",
}
_warned: set[str] = set()


@functools.cache
def missing_reason() -> str | None:
    """Why the row-wise kernels cannot run in this torch build (None if they can)."""
    missing = [n for n in _TORCH_OPS.values() if not hasattr(torch.ops.quantized, n)]
    return f"this torch build has no quantized::{missing[0]}" if missing else None


class _Table(NamedTuple):
    kind: DataType | None  # the row-wise kernel's type; None: dequantized in torch
    data_type: DataType
    rows: torch.Tensor  # the stored rows, a plain tensor over the same memory
    first: int  # output column of the table's value 0
    dim: int


class _Flat(NamedTuple):
    """INT8 features looked up by one call of fbgemm's forward over the buffer their tables are views of."""

    features: list[int]
    buffer: torch.Tensor  # 1-D uint8 over the whole buffer
    weights_offsets: torch.Tensor  # per feature: its table's first byte in the buffer
    d_offsets: torch.Tensor  # per feature: its first output column (int32)
    width: int
    hash_size_cumsum: torch.Tensor  # per feature: cumulative rows of the tables read
    all_features: bool


class Plan(NamedTuple):
    """How each table is read, for the weights it was built from (``key``)."""

    key: tuple[Any, ...]
    weights: list[torch.Tensor]  # held so the identities in ``key`` stay unique
    tables: list[_Table]
    flat: _Flat | None


def _key(weights: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    out: list[Any] = []
    for w in weights:
        if type(w) is MappedRows:
            out.append(id(w))  # cannot change through torch
            continue
        try:
            version = _compat.tensor_version(w)
        except RuntimeError:  # an inference tensor keeps no version
            version = -1
        out.append((w.data_ptr(), version, tuple(w.shape), w.dtype))
    return tuple(out)


def _width(kind: DataType, row_bytes: int) -> int:
    return row_bytes - TRAILER_BYTES[kind] if kind == DataType.INT8 else (row_bytes - 4) * 8 // _bits(kind)


def _bits(kind: DataType) -> int:
    return {DataType.INT8: 8, DataType.INT4: 4, DataType.INT2: 2}[kind]


def _table(name: str, dim: int, data_type: DataType, weight: torch.Tensor) -> _Table:
    rows = plain_alias(weight) if isinstance(weight, MappedRows) else weight
    kind = data_type if data_type in TRAILER_BYTES else None
    if kind is None or rows.dim() != 2 or not rows.is_contiguous() or not trailer_fits(dim, kind, rows.size(1)):
        return _Table(None, data_type, rows, 0, dim)
    if not trailer_ok(rows, kind):
        if isinstance(weight, MappedRows):
            if name not in _warned:
                _warned.add(name)
                warnings.warn(
                    f"table {name!r} ({weight.source}): its rows carry no serving trailer and the file is mapped "
                    "read-only; dequantizing it in torch (write the file with lightning_rec.quant.save_quantized)",
                    RuntimeWarning,
                    stacklevel=5,
                )
            return _Table(None, data_type, rows, 0, dim)
        write_trailer(rows, kind)  # the padding only: the rows mean what they meant
    first = SCALE_BIAS_BYTES * 8 // _bits(kind)
    return _Table(kind, data_type, rows, first, dim)


def _flat(tables: list[_Table], feature_table: Sequence[int]) -> _Flat | None:
    feats = [f for f, t in enumerate(feature_table) if tables[t].kind == DataType.INT8]
    if not feats or not has_fbgemm_op(FLAT_OP, "cpu"):
        return None
    rows = [tables[feature_table[f]].rows for f in feats]
    storage = rows[0].untyped_storage()
    if any(r.untyped_storage().data_ptr() != storage.data_ptr() or r.device.type != "cpu" for r in rows):
        return None
    widths = [_width(DataType.INT8, r.size(1)) for r in rows]
    starts = [0]
    for w in widths:
        starts.append(starts[-1] + w)
    sizes = [0]
    for r in rows:
        sizes.append(sizes[-1] + r.size(0))
    return _Flat(
        feats,
        torch.empty(0, dtype=torch.uint8).set_(storage),
        torch.tensor([r.storage_offset() for r in rows], dtype=torch.long),
        torch.tensor(starts, dtype=torch.int32),
        starts[-1],
        torch.tensor(sizes, dtype=torch.long),
        len(feats) == len(feature_table),
    )


def build(
    names: Sequence[str],
    dims: Sequence[int],
    types: Sequence[DataType],
    feature_table: Sequence[int],
    weights: Sequence[torch.Tensor],
    plan: Plan | None,
) -> Plan:
    """The plan for ``weights``: ``plan`` itself when they are the tensors it was built for, unchanged."""
    key = _key(weights)
    if plan is not None and plan.key == key:
        return plan
    tables = [_table(n, d, t, w) for n, d, t, w in zip(names, dims, types, weights)]
    return Plan(_key(weights), list(weights), tables, _flat(tables, feature_table))


def _torch_op(kind: DataType) -> Any:
    return getattr(torch.ops.quantized, _TORCH_OPS[kind])


def _row_wise(tab: _Table, ids: torch.Tensor, offsets: torch.Tensor, psw: torch.Tensor | None) -> torch.Tensor:
    out = _torch_op(tab.kind)(tab.rows, ids, offsets.to(ids.dtype), False, 0, False, psw, None, True)  # type: ignore[arg-type]
    return out[:, tab.first : tab.first + tab.dim]


def _feature_slices(
    feats: Sequence[int],
    values: torch.Tensor,
    offsets: torch.Tensor,
    psw: torch.Tensor | None,
    batch: int,
    bounds: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``values`` / ``offsets`` / weights of some features, as if the input held only them."""
    ids = torch.cat([values[bounds[f] : bounds[f + 1]] for f in feats])
    parts, base = [], 0
    for f in feats:
        parts.append(offsets[f * batch : (f + 1) * batch] - bounds[f] + base)
        base += bounds[f + 1] - bounds[f]
    parts.append(torch.tensor([base], dtype=offsets.dtype))
    w = None if psw is None else torch.cat([psw[bounds[f] : bounds[f + 1]] for f in feats])
    return ids, torch.cat(parts), w


def pooled_sum(
    plan: Plan,
    feature_table: Sequence[int],
    values: torch.Tensor,
    offsets: torch.Tensor,
    psw: torch.Tensor | None,
    batch: int,
    bounds: Sequence[int],
) -> torch.Tensor:
    """SUM-pooled ``[batch, sum of feature widths]`` float32 (feature-major ``values`` / ``offsets``)."""
    psw = None if psw is None else psw.float()
    cols: list[torch.Tensor | None] = [None] * len(feature_table)
    flat = plan.flat
    if flat is not None:
        if flat.all_features:
            ids, offs, w = values, offsets, psw
        else:
            ids, offs, w = _feature_slices(flat.features, values, offsets, psw, batch, bounds)
        out = torch.ops.fbgemm.split_embedding_codegen_forward_cpu(
            flat.buffer, flat.weights_offsets, flat.d_offsets, flat.width, flat.hash_size_cumsum, ids, offs, 0, w, 0
        )
        for k, f in enumerate(flat.features):
            tab = plan.tables[feature_table[f]]
            start = int(flat.d_offsets[k]) + tab.first
            cols[f] = out[:, start : start + tab.dim]
    for f, t in enumerate(feature_table):
        if cols[f] is not None:
            continue
        tab, (lo, hi) = plan.tables[t], (bounds[f], bounds[f + 1])
        ids, offs = values[lo:hi], offsets[f * batch : (f + 1) * batch + 1] - lo
        w = None if psw is None else psw[lo:hi]
        if tab.kind is not None:
            cols[f] = _row_wise(tab, ids, offs, w)
            continue
        rows = dequantize_rows(tab.rows[ids], tab.data_type, tab.dim)
        cols[f] = F.embedding_bag(
            torch.arange(hi - lo), rows, offs, mode="sum", include_last_offset=True, per_sample_weights=w
        )
    return torch.cat(cols, 1) if cols else torch.zeros(batch, 0)  # type: ignore[arg-type]


def sequence(
    plan: Plan, feature_table: Sequence[int], values: torch.Tensor, bounds: Sequence[int]
) -> list[torch.Tensor]:
    """One float32 ``[ids of feature, width]`` tensor per feature: each id a bag of its own."""
    out = []
    for f, t in enumerate(feature_table):
        tab, ids = plan.tables[t], values[bounds[f] : bounds[f + 1]]
        if tab.kind is None:
            out.append(dequantize_rows(tab.rows[ids], tab.data_type, tab.dim))
        else:
            out.append(_row_wise(tab, ids, torch.arange(ids.numel() + 1), None).contiguous())
    return out
