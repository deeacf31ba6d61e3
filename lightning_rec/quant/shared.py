"""Quantized tables that serving processes share: one file, mapped read-only by every process.

``save_quantized(model, path)`` writes a model whose collections are quantized (``quantize_embeddings``,
``load_quantized``) to one file: every table's stored rows (fbgemm's layout, with the serving trailer:
:mod:`lightning_rec.quant.rows`), each at a page boundary, then the rest of the model's state. In each serving
process, ``load_quantized_tables(path, Model(...))`` builds the quantized model with its tables *mapped* from the file
(``mmap=True``): N processes on one host hold one copy of the tables in the page cache, not N, and a table nobody
reads costs no memory at all. The model may be built on the meta device (``with torch.device("meta"): Model(...)``),
so no process ever allocates the float tables.

File layout: ``MAGIC`` (8 bytes), the header's length (8 bytes, little-endian), the header (JSON: format, collections,
tables with their type, shape and byte range, the rest's byte range, the file's size), then the sections.
"""

from __future__ import annotations

import io
import json
import os
import struct
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_rec.configs import DataType
from lightning_rec.embedding_modules import EmbeddingBagCollection as FloatEBC
from lightning_rec.embedding_modules import EmbeddingCollection as FloatEC
from lightning_rec.quant.embedding_modules import EmbeddingBagCollection, EmbeddingCollection, quantized_configs
from lightning_rec.quant.lookup import resolve
from lightning_rec.quant.mapped import MappedRows, map_read_only
from lightning_rec.quant.rows import output_type, relayout, row_bytes, trailer_fits, write_trailer

MAGIC = b"LRQTAB\x00\x01"
FORMAT = "lightning_rec.quant.tables/1"
_ALIGN = 4096  # each table starts on a page of its own: its pages are its alone
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _collections(model: nn.Module) -> list[tuple[str, EmbeddingBagCollection | EmbeddingCollection]]:
    return [(p, m) for p, m in model.named_modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))]


def _container(m: EmbeddingBagCollection | EmbeddingCollection) -> Any:
    return m.embedding_bags if isinstance(m, EmbeddingBagCollection) else m.embeddings


def _configs(m: nn.Module) -> list[Any]:
    if isinstance(m, (EmbeddingBagCollection, FloatEBC)):
        return list(m.embedding_bag_configs())
    return list(m.embedding_configs())  # type: ignore[operator]


def _key(path: str, m: EmbeddingBagCollection | EmbeddingCollection, table: str) -> str:
    attr = "embedding_bags" if isinstance(m, EmbeddingBagCollection) else "embeddings"
    return f"{path}.{attr}.{table}.weight" if path else f"{attr}.{table}.weight"


def _pad(f: Any) -> int:
    pos = f.tell()
    f.write(b"\0" * (-pos % _ALIGN))
    return pos + (-pos % _ALIGN)


def save_quantized(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write ``model`` (its collections quantized) to ``path`` for :func:`load_quantized_tables`; returns the path.

    The file appears whole or not at all (written next to it, then renamed): processes mapping the old file keep
    reading the old one. Rows without the serving trailer get it in the file (the model is not changed)."""
    found = _collections(model)
    if not found:
        raise ValueError("save_quantized: the model has no quantized collection (quantize_embeddings(model) first)")
    path = Path(path)
    state = model.state_dict()
    collections: list[dict[str, Any]] = []
    table_keys: set[str] = set()
    for where, m in found:
        tables: list[dict[str, Any]] = []
        for c, (name, data_type) in zip(_configs(m), m.storage_types().items()):
            key = _key(where, m, name)
            rows = state[key]
            table_keys.add(key)
            tables.append(
                {
                    "name": name,
                    "type": data_type.name,
                    "rows": c.num_embeddings,
                    "dim": c.embedding_dim,
                    # the compact layout is written compact whatever the model holds (fbgemm's own buffers)
                    "row_bytes": int(rows.shape[1])
                    if m.row_alignment is not None
                    else row_bytes(c.embedding_dim, data_type, None),
                    "rows_tensor": rows,
                }
            )
        collections.append(
            {
                "path": where,
                "kind": type(m).__name__,
                "row_alignment": m.row_alignment,
                "output_dtype": str(m.output_dtype()).removeprefix("torch."),
                "is_weighted": bool(m.is_weighted()) if isinstance(m, EmbeddingBagCollection) else False,
                "need_indices": bool(m.need_indices()) if isinstance(m, EmbeddingCollection) else False,
                "tables": tables,
            }
        )
    rest = io.BytesIO()
    torch.save({k: v for k, v in state.items() if k not in table_keys}, rest)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(b"\0" * _ALIGN)  # the header goes here once the offsets are known (or at the end, if larger)
        for c in collections:
            for t in c["tables"]:
                t["offset"] = _pad(f)
                _write_rows(f, t.pop("rows_tensor"), DataType[t["type"]], t)
                t["nbytes"] = f.tell() - t["offset"]
        rest_at = _pad(f)
        f.write(rest.getbuffer())
        header: dict[str, Any] = {"format": FORMAT, "collections": collections, "rest": [rest_at, f.tell() - rest_at]}
        header["file_bytes"] = f.tell()
        blob = json.dumps(header).encode()
        if len(blob) + 16 > _ALIGN:
            raise ValueError(f"save_quantized: the header ({len(blob)} bytes) outgrew its {_ALIGN - 16}-byte slot")
        f.seek(0)
        f.write(MAGIC + struct.pack("<Q", len(blob)) + blob)
    os.replace(tmp, path)
    return path


def _write_rows(f: Any, rows: torch.Tensor, data_type: DataType, table: dict[str, Any]) -> None:
    dim, width = table["dim"], table["row_bytes"]
    step = max(1, (1 << 24) // max(rows.shape[1], width, 1))
    fits = trailer_fits(dim, data_type, width)
    for start in range(0, rows.shape[0], step):
        part = rows[start : start + step].detach().cpu().contiguous()
        if part.shape[1] != width:
            out = torch.empty(part.shape[0], width, dtype=torch.uint8)
            relayout(part, out, dim, data_type, table["name"])  # gives the trailer too
            part = out
        elif fits:
            part = part.clone()
            write_trailer(part, data_type)
        f.write(part.numpy().tobytes())


def read_header(path: str | os.PathLike) -> dict[str, Any]:
    """The header of a file :func:`save_quantized` wrote (raises naming the file if it is not one)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no quantized tables file at {path} (write one with lightning_rec.quant.save_quantized)"
        )
    with open(path, "rb") as f:
        head = f.read(16)
        if len(head) < 16 or head[:8] != MAGIC:
            raise ValueError(f"{path} is not a quantized tables file (lightning_rec.quant.save_quantized): bad magic")
        (n,) = struct.unpack("<Q", head[8:])
        try:
            header: dict[str, Any] = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"{path}: its header is not valid JSON ({e}); the file is damaged") from e
    if header.get("format") != FORMAT:
        raise ValueError(f"{path} is in format {header.get('format')!r}; this version reads {FORMAT}")
    size = path.stat().st_size
    if size < header["file_bytes"]:
        ends = [(t["offset"] + t["nbytes"], t["name"]) for c in header["collections"] for t in c["tables"]]
        cut = sorted(name for end, name in ends if end > size)
        raise ValueError(
            f"{path} is truncated: {size} bytes of {header['file_bytes']}"
            + (f"; the rows of tables {cut} lie past its end" if cut else "")
        )
    return header


def _quantized_copy(float_m: nn.Module, entry: dict[str, Any], kernel: str, where: str) -> nn.Module:
    """An empty (meta) quantized collection for the float one at ``where``, with the file's storage types."""
    saved = {t["name"]: t for t in entry["tables"]}
    configs = _configs(float_m)
    _check_tables(where, {c.name: (c.num_embeddings, c.embedding_dim) for c in configs}, saved)
    configs = quantized_configs(configs, torch.qint8, {n: DataType[t["type"]].name.lower() for n, t in saved.items()})
    out = _DTYPES[entry["output_dtype"]]
    strict = bool(float_m._layout.strict)  # type: ignore[union-attr]
    if isinstance(float_m, FloatEBC):
        return EmbeddingBagCollection(
            configs,
            entry["is_weighted"],
            "meta",
            output_type(out),
            row_alignment=entry["row_alignment"],
            kernel=kernel,
            strict_features=strict,
        )
    return EmbeddingCollection(
        configs,
        "meta",
        entry["need_indices"],
        output_type(out),
        row_alignment=entry["row_alignment"],
        kernel=kernel,
        strict_features=strict,
    )


def _check_tables(where: str, ours: dict[str, tuple[int, int]], saved: dict[str, dict[str, Any]]) -> None:
    label = f"collection {where or '<model>'!r}"
    problems = [f"table {n!r} is only in the file" for n in saved if n not in ours]
    problems += [f"table {n!r} is only in the model" for n in ours if n not in saved]
    problems += [
        f"table {n!r} is [{saved[n]['rows']} x {saved[n]['dim']}] in the file but {list(ours[n])} in the model"
        for n in ours
        if n in saved and (saved[n]["rows"], saved[n]["dim"]) != ours[n]
    ]
    if problems:
        raise ValueError(f"{label} does not match the file: " + "; ".join(problems))


def load_quantized_tables(
    path: str | os.PathLike, model: nn.Module, *, mmap: bool = True, kernel: str = "auto"
) -> nn.Module:
    """``model`` with the quantized tables and the rest of the state of a file :func:`save_quantized` wrote, in
    ``eval()`` mode. ``model`` is the unsharded model (float collections, on any device, the meta device included,
    or quantized ones); each float collection the file names is replaced by its quantized copy.

    ``mmap=True``: the tables are views of the file mapped read-only and shared (every process that maps the file
    reads the same pages; writes into them raise, :class:`lightning_rec.quant.mapped.MappedRows`); the lookups read
    them in place, so the kernel must be ``"auto"`` (CPU) or ``"torch"``. ``mmap=False``: a private copy read from
    the file. Tables the model and the file disagree on, a damaged or truncated file raise, naming them.
    """
    header = read_header(path)
    source = str(Path(path).resolve())
    if mmap and kernel == "fbgemm":
        raise ValueError(
            "load_quantized_tables(mmap=True) reads the mapped rows in place: kernel='fbgemm' copies "
            "them into fbgemm's own buffer; use kernel='auto' or 'torch', or mmap=False"
        )
    if mmap:
        data = map_read_only(path)
    else:
        data = torch.empty(header["file_bytes"], dtype=torch.uint8)
        with open(path, "rb") as f:
            f.readinto(data.numpy())  # type: ignore[arg-type]
    tables: set[str] = set()
    for entry in header["collections"]:
        where = entry["path"]
        try:
            m = model.get_submodule(where) if where else model
        except AttributeError as e:
            raise ValueError(
                f"{path}: the model has no module {where!r} (collection of tables "
                f"{[t['name'] for t in entry['tables']]})"
            ) from e
        if isinstance(m, (FloatEBC, FloatEC)):
            q = _quantized_copy(m, entry, kernel, where)
            if not where:
                model = q
            else:
                parent, _, name = where.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, name, q)
            m = q
        if not isinstance(m, (EmbeddingBagCollection, EmbeddingCollection)):
            raise ValueError(f"{path}: module {where!r} is a {type(m).__name__}, not an embedding collection")
        if mmap and resolve(m._lookup.kernel, torch.device("cpu")) == "fbgemm":
            raise ValueError(
                f"collection {where or '<model>'!r} looks up through fbgemm's inference kernel, which would copy the "
                "mapped rows into its own buffer: quantize it with kernel='auto' or 'torch', or load with mmap=False"
            )
        _attach(m, entry, data, source, mmap, where)
        tables.update(_key(where, m, t["name"]) for t in entry["tables"])
    rest_at, rest_n = header["rest"]
    rest = torch.load(io.BytesIO(data[rest_at : rest_at + rest_n].numpy().tobytes()), weights_only=True)
    result = model.load_state_dict(rest, strict=False, assign=True)
    missing = sorted(set(result.missing_keys) - tables)
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{path} was not written from this model: keys only in the model {missing}, only in the "
            f"file {sorted(result.unexpected_keys)}"
        )
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{path}: nothing in the file for {left} (still on the meta device)")
    return model.eval()


def _attach(
    m: EmbeddingBagCollection | EmbeddingCollection,
    entry: dict[str, Any],
    data: torch.Tensor,
    source: str,
    mmap: bool,
    where: str,
) -> None:
    saved = {t["name"]: t for t in entry["tables"]}
    _check_tables(where, {c.name: (c.num_embeddings, c.embedding_dim) for c in _configs(m)}, saved)
    if entry["row_alignment"] != m.row_alignment:
        raise ValueError(
            f"collection {where or '<model>'!r}: the file holds rows of row_alignment={entry['row_alignment']}, "
            f"the model row_alignment={m.row_alignment} (None: compact), and mapped rows cannot be converted in "
            "place: pass the float model (its collections are then built in the file's layout) or quantize with "
            f"row_alignment={entry['row_alignment']}"
        )
    container = _container(m)
    for name, data_type in m.storage_types().items():
        t = saved[name]
        if t["type"] != data_type.name:
            raise ValueError(f"table {name!r} is stored as {t['type']} in the file but {data_type.name} in the model")
        expected = row_bytes(t["dim"], data_type, m.row_alignment)
        if t["row_bytes"] != expected or t["nbytes"] != t["rows"] * expected or t["offset"] % 64:
            raise ValueError(
                f"table {name!r}: the file holds {t['nbytes']} bytes of {t['row_bytes']}-byte rows at offset "
                f"{t['offset']}, expected {t['rows']} rows of {expected} bytes at a 64-byte boundary (a damaged file)"
            )
        rows = data[t["offset"] : t["offset"] + t["nbytes"]].view(t["rows"], t["row_bytes"])
        container[name].weight = MappedRows.wrap(rows, name, source) if mmap else rows
