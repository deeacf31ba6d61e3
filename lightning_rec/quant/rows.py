"""fbgemm's row-wise storage of an inference table: the storage types, a row's bytes, quantizing and reading rows.

One row of a table stored as ``INT8`` / ``INT4`` / ``INT2`` (fbgemm's ``IntNBitTableBatchedEmbeddingBagsCodegen``,
``reverse_qparam=False``) is, in bytes::

    [scale: fp16][bias: fp16][value 0, 1, ... packed: 8 / bits values a byte, value j in bits (j * bits) % 8 up]
    [zero padding up to a multiple of row_alignment]

and a value reads back as ``q * scale + bias``. ``FP16`` / ``FP32`` rows are the values themselves, then the
padding. TorchRec's quantized collections store the same rows (row alignment 16 by default).

Every reader takes the row's first :func:`used_bytes` and ignores the rest, so rows of one table in two layouts
differ only in padding and convert by copying that prefix (:func:`relayout`). The layout is ``row_alignment``:
an int is fbgemm's (the row padded to a multiple of it; TorchRec's 16, which fbgemm's CUDA kernel needs: it reads
rows as 16-byte vectors); ``None`` (the default) is the compact serving layout, the row plus its serving trailer
padded to 4 bytes (int8 at dim 64: 76 bytes, 0.297x fp32; int4 40, 0.156x). fbgemm's CPU kernel reads rows of any
stride, so its own buffers (``kernel="fbgemm"``) take alignment 4 on CPU and 16 on CUDA (:func:`kernel_alignment`).

The serving trailer: where a quantized row's padding has room, its last bytes repeat the scale and bias in the
layout of the row-wise CPU kernels (:mod:`lightning_rec.quant.rowwise`), which read them at the end of a row: INT8
rows end in ``[scale: fp32][bias: fp32]`` (8 bytes), INT4 / INT2 rows in ``[scale: fp16][bias: fp16]`` (4 bytes).
fbgemm never reads the padding, so the rows stay fbgemm's; the kernels then read the stored rows in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from lightning_rec.configs import DataType

#: bits per value of every storage type fbgemm's inference kernel reads on CPU
BITS = {DataType.INT2: 2, DataType.INT4: 4, DataType.INT8: 8, DataType.FP16: 16, DataType.FP32: 32}
#: bytes of a quantized row's scale and bias (two fp16 values)
SCALE_BIAS_BYTES = 4
#: bytes of the serving trailer at the end of a quantized row (INT8: fp32 scale and bias; INT4 / INT2: fp16)
TRAILER_BYTES = {DataType.INT8: 8, DataType.INT4: 4, DataType.INT2: 4}
#: TorchRec's default row alignment, which fbgemm's CUDA kernel needs (16-byte vector loads of a row)
TORCHREC_ROW_ALIGNMENT = 16
#: the default ``row_alignment``: None, the compact serving layout (the row, its serving trailer, 4-byte padding)
DEFAULT_ROW_ALIGNMENT: int | None = None
#: padding of the compact layout: keeps the fp16 scale / bias and the fp32 trailer on their natural alignment
COMPACT_ALIGNMENT = 4
_FP16_MAX = 65504.0
# rows quantized at once: bounds the float temporaries of a large table to about 16 MiB
_CHUNK_VALUES = 1 << 22

_BY_DTYPE = {
    torch.qint8: DataType.INT8,
    torch.quint8: DataType.INT8,
    torch.int8: DataType.INT8,
    torch.quint4x2: DataType.INT4,
    torch.quint2x4: DataType.INT2,
    torch.float16: DataType.FP16,
    torch.float32: DataType.FP32,
}
_BY_NAME = {"int8": DataType.INT8, "int4": DataType.INT4, "int2": DataType.INT2, "fp16": DataType.FP16}
_BY_NAME |= {"float16": DataType.FP16, "fp32": DataType.FP32, "float32": DataType.FP32}


class QuantConfig(NamedTuple):
    """TorchRec's ``QuantConfig``: observers whose ``dtype`` names the output (``activation``) and storage
    (``weight``) types, e.g. ``torch.ao.quantization.PlaceholderObserver.with_args(dtype=torch.qint8)``;
    ``per_table_weight_dtype`` overrides the storage type of the tables it names."""

    activation: Any
    weight: Any
    per_table_weight_dtype: dict[str, torch.dtype] | None = None


def storage_type(dtype: torch.dtype | DataType | str, table: str | None = None) -> DataType:
    """The ``DataType`` a table is stored as, from a torch dtype (TorchRec's: ``torch.qint8``, ``torch.quint4x2``,
    ``torch.quint2x4``, ``torch.float16``), a ``DataType`` or a name (``"int8"``, ``"int4"``, ``"int2"``, ...)."""
    found = dtype if isinstance(dtype, DataType) else None
    if isinstance(dtype, torch.dtype):
        found = _BY_DTYPE.get(dtype)
    elif isinstance(dtype, str):
        found = _BY_NAME.get(dtype.lower())
    if found is None or found not in BITS:
        where = f"table {table!r}: " if table is not None else ""
        raise ValueError(
            f"{where}cannot store embeddings as {dtype!r}: fbgemm's inference kernel takes torch.qint8 (int8), "
            "torch.quint4x2 (int4), torch.quint2x4 (int2), torch.float16 (fp16) or torch.float32 (fp32)"
        )
    return found


def output_type(dtype: torch.dtype) -> torch.dtype:
    """The pooled / looked-up output dtype (``QuantConfig.activation``'s): float32, float16 or bfloat16."""
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"output_dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype}")
    return dtype


def is_quantized(data_type: DataType) -> bool:
    """Whether rows of this type carry a scale and a bias (the integer types)."""
    return BITS[data_type] <= 8


def data_bytes(dim: int, data_type: DataType) -> int:
    """Bytes of a row's values, without scale, bias and padding."""
    return dim * BITS[data_type] // 8


def used_bytes(dim: int, data_type: DataType) -> int:
    """Bytes of a row that fbgemm's kernels read: scale and bias (integer types), then the values."""
    return data_bytes(dim, data_type) + (SCALE_BIAS_BYTES if is_quantized(data_type) else 0)


def row_bytes(dim: int, data_type: DataType, row_alignment: int | None = DEFAULT_ROW_ALIGNMENT) -> int:
    """Bytes of one stored row: fbgemm's row padded to a multiple of ``row_alignment``, or with ``None`` the
    compact serving layout (the row, the serving trailer of integer types, padded to 4 bytes)."""
    n = used_bytes(dim, data_type)
    if row_alignment is None:
        n, row_alignment = n + TRAILER_BYTES.get(data_type, 0), COMPACT_ALIGNMENT
    return -(-n // row_alignment) * row_alignment


def kernel_alignment(row_alignment: int | None, device: torch.device) -> int:
    """The row alignment fbgemm's inference kernel is built with for a layout: the int itself, else (``None``)
    4 on CPU (its CPU kernel reads any stride) and 16 elsewhere (its CUDA kernel needs 16)."""
    if row_alignment is not None:
        return row_alignment
    return COMPACT_ALIGNMENT if device.type == "cpu" else TORCHREC_ROW_ALIGNMENT


def check_alignment(row_alignment: Any) -> int | None:
    """``row_alignment`` itself if it is None or a positive int."""
    if row_alignment is not None and (type(row_alignment) is not int or row_alignment < 1):
        raise ValueError(f"row_alignment must be None (the compact layout) or a positive int, got {row_alignment!r}")
    return row_alignment  # type: ignore[no-any-return]


def relayout(src: torch.Tensor, dst: torch.Tensor, dim: int, data_type: DataType, table: str) -> None:
    """Copy the stored rows ``src`` into ``dst``, rows of another padding (the bytes every kernel reads are the
    same in any layout); ``dst``'s padding is zeroed, then given the serving trailer where it has room. Raises,
    naming the table, when the rows cannot hold the table's rows."""
    n = used_bytes(dim, data_type)
    if src.dim() != 2 or dst.dim() != 2 or src.size(0) != dst.size(0) or min(src.size(1), dst.size(1)) < n:
        raise ValueError(
            f"table {table!r}: cannot convert stored rows of shape {list(src.shape)} to {list(dst.shape)}: "
            f"each {data_type.name} row of width {dim} needs {n} bytes"
        )
    with torch.no_grad():
        dst[:, n:] = 0
        dst[:, :n] = src[:, :n].to(dst.device)
        if trailer_fits(dim, data_type, dst.size(1)):
            write_trailer(dst, data_type)


def check_storable(table: str, dim: int, data_type: DataType) -> None:
    """Refuse a width fbgemm cannot pack: a byte holds 2 int4 or 4 int2 values of one row, never a part of one."""
    per_byte = 8 // BITS[data_type] if is_quantized(data_type) else 1
    if dim % per_byte:
        ok = [t.name for t in (DataType.INT8, DataType.INT4, DataType.INT2) if dim % (8 // BITS[t]) == 0]
        raise ValueError(
            f"table {table!r} (embedding_dim={dim}) cannot be stored as {data_type.name}: fbgemm packs {per_byte} "
            f"{data_type.name} values a byte, so embedding_dim must be a multiple of {per_byte}. Store this table "
            f"as one of {ok + ['FP16']} (per_table_weight_dtype={{{table!r}: ...}})"
        )


def table_types(
    names: list[str], dtype: torch.dtype | DataType | str, per_table: Mapping[str, Any] | None
) -> dict[str, DataType]:
    """``{table: storage type}``: ``per_table`` where it names the table, else ``dtype``; unknown names refused."""
    per_table = dict(per_table or {})
    unknown = sorted(set(per_table) - set(names))
    if unknown:
        raise ValueError(f"per_table_weight_dtype names tables {unknown} that are not in the model (tables: {names})")
    return {n: storage_type(per_table.get(n, dtype), n) for n in names}


def _fp16_toward(x: torch.Tensor, up: bool) -> torch.Tensor:
    """``x`` rounded to fp16 toward +inf (``up``) or -inf: the stored value never falls on the wrong side."""
    h = x.to(torch.float16)
    off = h.float() < x if up else h.float() > x
    step = torch.nextafter(h, torch.full_like(h, float("inf") if up else float("-inf")))
    return torch.where(off, step, h)


def _quantize_chunk(w: torch.Tensor, data_type: DataType, out: torch.Tensor) -> None:
    bits = BITS[data_type]
    qmax = (1 << bits) - 1
    # bias rounded down and scale rounded up to fp16, so every value lies in [bias, bias + qmax * scale] and is
    # at most scale / 2 away from its stored value; fbgemm's own quantizer rounds both to nearest and can clip
    # the row's largest value (docs/ARCHITECTURE.md F16)
    bias = _fp16_toward(w.amin(1), up=False)
    scale = _fp16_toward((w.amax(1) - bias.float()) / qmax, up=True)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # a constant row: any scale reads back bias
    q = torch.round((w - bias.float().unsqueeze(1)) / scale.float().unsqueeze(1)).clamp_(0, qmax).to(torch.uint8)
    per_byte = 8 // bits
    if per_byte > 1:  # value j of a row at bits (j * bits) % 8 of byte j // per_byte, low bits first
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
        q = (q.view(q.size(0), -1, per_byte) << shifts).sum(2, dtype=torch.uint8)
    out[:, 0:2] = scale.unsqueeze(1).view(torch.uint8)
    out[:, 2:4] = bias.unsqueeze(1).view(torch.uint8)
    out[:, SCALE_BIAS_BYTES : SCALE_BIAS_BYTES + q.size(1)] = q


def quantize_rows(weight: torch.Tensor, data_type: DataType, out: torch.Tensor, table: str) -> None:
    """Write ``weight`` (``[rows, dim]``, any float dtype) into ``out`` (``[rows, row_bytes]`` uint8) as fbgemm's
    rows of ``data_type``; the padding bytes are set to zero. Refuses values fp16 cannot hold (the scale, bias and
    FP16 values are fp16), naming the table and the row."""
    rows, dim = weight.shape
    check_storable(table, dim, data_type)
    n = data_bytes(dim, data_type)
    step = max(1, _CHUNK_VALUES // max(dim, 1))
    with torch.no_grad():
        for start in range(0, rows, step):
            w = weight[start : start + step].detach().float()
            dst = out[start : start + step]
            if data_type != DataType.FP32:
                bad = ~(w.abs() <= _FP16_MAX).all(1)  # NaN fails the comparison too
                if bool(bad.any()):
                    r = start + int(torch.nonzero(bad)[0])
                    raise ValueError(
                        f"table {table!r}: row {r} holds {weight[r].abs().max().item()}, which {data_type.name} "
                        f"storage cannot represent (its scale, bias and values are fp16: |value| <= {_FP16_MAX:g})"
                    )
            dst.zero_()
            if data_type == DataType.FP32:
                dst[:, :n] = w.view(torch.uint8)
            elif data_type == DataType.FP16:
                dst[:, :n] = w.to(torch.float16).view(torch.uint8)
            else:
                _quantize_chunk(w, data_type, dst)
                if trailer_fits(dim, data_type, dst.size(1)):
                    write_trailer(dst, data_type)


def dequantize_rows(rows: torch.Tensor, data_type: DataType, dim: int) -> torch.Tensor:
    """``[n, dim]`` float32 values of stored rows (``[n, row_bytes]`` uint8): the torch lookup path."""
    n = data_bytes(dim, data_type)
    if data_type == DataType.FP32:
        return rows[:, :n].contiguous().view(torch.float32)
    if data_type == DataType.FP16:
        return rows[:, :n].contiguous().view(torch.float16).float()
    scale_bias = rows[:, :SCALE_BIAS_BYTES].contiguous().view(torch.float16).float()
    q = rows[:, SCALE_BIAS_BYTES : SCALE_BIAS_BYTES + n]
    bits = BITS[data_type]
    if bits < 8:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=rows.device)
        q = ((q.unsqueeze(2) >> shifts) & ((1 << bits) - 1)).reshape(rows.size(0), dim)
    return q.float() * scale_bias[:, 0:1] + scale_bias[:, 1:2]


def trailer_fits(dim: int, data_type: DataType, row_bytes: int) -> bool:
    """Whether rows of ``row_bytes`` bytes have padding enough for the serving trailer (quantized types only)."""
    extra = TRAILER_BYTES.get(data_type)
    return extra is not None and row_bytes - SCALE_BIAS_BYTES - data_bytes(dim, data_type) >= extra


def _trailer_of(rows: torch.Tensor, data_type: DataType) -> torch.Tensor:
    """The trailer bytes ``rows`` (``[n, row_bytes]`` uint8) should end in, from their fp16 scale and bias."""
    if data_type == DataType.INT8:
        return rows[:, :SCALE_BIAS_BYTES].contiguous().view(torch.float16).float().view(torch.uint8)
    return rows[:, :SCALE_BIAS_BYTES]


def write_trailer(rows: torch.Tensor, data_type: DataType) -> None:
    """Write the serving trailer of ``rows`` in place (their padding must have room: :func:`trailer_fits`)."""
    extra = TRAILER_BYTES[data_type]
    with torch.no_grad():
        for start in range(0, rows.size(0), _CHUNK_VALUES // 8):
            part = rows[start : start + _CHUNK_VALUES // 8]
            part[:, part.size(1) - extra :] = _trailer_of(part, data_type)


def trailer_ok(rows: torch.Tensor, data_type: DataType) -> bool:
    """Whether every row of ``rows`` ends in its serving trailer (rows quantized elsewhere have zero padding)."""
    extra = TRAILER_BYTES[data_type]
    for start in range(0, rows.size(0), _CHUNK_VALUES // 8):
        part = rows[start : start + _CHUNK_VALUES // 8]
        if not torch.equal(part[:, part.size(1) - extra :], _trailer_of(part, data_type)):
            return False
    return True
