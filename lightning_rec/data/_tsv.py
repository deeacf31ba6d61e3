"""Vectorised Criteo TSV parsing: a sparse line index for random access, pyarrow's CSV reader, numpy hex ids.

A rank reads only the byte range of its own rows: the index keeps the byte offset of every ``_EVERY``-th
line, so a read starts at most ``_EVERY - 1`` lines early and cuts the exact lines with one newline scan.
Bad lines are explained by the slow per-line checker only after pyarrow or the vectorised checks refused
a range, so the error still names the file, the line and the column.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from lightning_rec.data._hashing import key_of, mix64
from lightning_rec.data.synthetic import CRITEO_CARDINALITIES, FEATURE_NAMES, NUM_DENSE

NUM_CAT = len(CRITEO_CARDINALITIES)
NUM_COLUMNS = 1 + NUM_DENSE + NUM_CAT
_EVERY = 256  # lines between indexed byte offsets
_NAMES = ["label"] + [f"i{j}" for j in range(NUM_DENSE)] + [f"c{j}" for j in range(NUM_CAT)]
_TYPES = {
    "label": pa.int8(),
    **{f"i{j}": pa.int64() for j in range(NUM_DENSE)},
    **{f"c{j}": pa.binary() for j in range(NUM_CAT)},
}
_PARSE = pacsv.ParseOptions(
    delimiter="\t", quote_char=False, double_quote=False, escape_char=False, ignore_empty_lines=False
)
_CONVERT = pacsv.ConvertOptions(
    column_types=_TYPES, null_values=[""], strings_can_be_null=False, quoted_strings_can_be_null=False
)
_INT_FIELD = re.compile(rb"(?:-?[0-9]+)?")
_HEX_FIELD = re.compile(rb"[0-9a-fA-F]{0,16}")
_FEATURE_KEYS = np.asarray([key_of(j) for j in range(NUM_CAT)], dtype=np.uint64)


def _hex_tables() -> tuple[np.ndarray, np.ndarray]:
    nib = np.full(256, 255, dtype=np.uint8)
    for c in b"0123456789abcdefABCDEF":
        nib[c] = int(chr(c), 16)
    # two ASCII hex digits, read as one little-endian uint16, -> their byte value (256: not two hex digits)
    hi, lo = np.meshgrid(np.arange(256), np.arange(256), indexing="ij")
    pair = np.where((nib[lo] < 16) & (nib[hi] < 16), nib[lo].astype(np.uint16) * 16 + nib[hi], 256)
    return nib, pair.astype(np.uint16).reshape(-1)  # index: lo + 256 * hi = the uint16 of bytes (lo, hi)


_NIBBLE, _PAIR = _hex_tables()


@dataclass
class LineIndex:
    """One file's line count and the byte offset of every ``_EVERY``-th line."""

    path: str
    lines: int
    size: int
    offsets: np.ndarray  # offsets[k]: byte offset of line k * _EVERY

    @classmethod
    def build(cls, path: str) -> LineIndex:
        """Scan ``path`` once (numpy newline search)."""
        parts, n, pos, last = [np.zeros(1, dtype=np.int64)], 0, 0, b"\n"
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                nl = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10)
                first = (-(n + 1)) % _EVERY  # the newline ending line n + i starts line n + i + 1
                parts.append(pos + nl[first::_EVERY].astype(np.int64) + 1)
                n, pos, last = n + nl.size, pos + len(chunk), chunk[-1:]
        lines = n + (last != b"\n")
        offsets = np.concatenate(parts)[: (lines + _EVERY - 1) // _EVERY]
        return cls(path, lines, pos, offsets)

    def read(self, a: int, b: int) -> bytes:
        """The bytes of lines ``[a, b)`` (0-based), each ending in a newline (one is added to a last line)."""
        k0, k1 = a // _EVERY, -(-b // _EVERY)
        end = int(self.offsets[k1]) if k1 < self.offsets.size else self.size
        with open(self.path, "rb") as f:
            f.seek(int(self.offsets[k0]))
            buf = f.read(end - int(self.offsets[k0]))
        if buf and buf[-1:] != b"\n":
            buf += b"\n"
        nl = np.flatnonzero(np.frombuffer(buf, dtype=np.uint8) == 10)
        skip, want = a - k0 * _EVERY, b - a
        if nl.size < skip + want:
            raise RuntimeError(
                f"CriteoTSV: {self.path} has fewer lines than when it was indexed ({self.lines}); "
                "did the file change while reading?"
            )
        start = int(nl[skip - 1]) + 1 if skip else 0
        return buf[start : int(nl[skip + want - 1]) + 1]


def explain_bad_line(line: bytes, where: str) -> str | None:
    """Why ``line`` is not a Criteo line (naming ``where`` and the column), or None if it is one."""
    fields = line.rstrip(b"\r\n").split(b"\t")
    if len(fields) != NUM_COLUMNS:
        return (
            f"{where}: expected {NUM_COLUMNS} tab-separated columns (label, {NUM_DENSE} integers, {NUM_CAT} "
            f"hex categorical ids), got {len(fields)}"
        )
    if fields[0] not in (b"0", b"1"):
        return f"{where}: column 1 (label) must be 0 or 1, got {fields[0][:40]!r}"
    for j, v in enumerate(fields[1 : 1 + NUM_DENSE]):
        if not _INT_FIELD.fullmatch(v) or (v and not -(2**63) <= int(v) < 2**63):
            return f"{where}: column {j + 2} (integer feature {j}) must be a 64-bit integer or empty, got {v[:40]!r}"
    for j, v in enumerate(fields[1 + NUM_DENSE :]):
        if not _HEX_FIELD.fullmatch(v):
            return (
                f"{where}: column {j + 2 + NUM_DENSE} (categorical feature {FEATURE_NAMES[j]}) must be a hex id "
                f"of at most 16 digits or empty, got {v[:40]!r}"
            )
    return None


def _bad_range(buf: bytes, path: str, first_line: int, detail: str) -> ValueError:
    for i, line in enumerate(buf.split(b"\n")[:-1]):
        why = explain_bad_line(line, f"{path}:{first_line + i}")
        if why is not None:
            return ValueError(why)
    last = first_line + buf.count(b"\n") - 1
    return ValueError(f"CriteoTSV: {path} lines {first_line}-{last}: {detail}")


def _hex_values(chars: np.ndarray, lens: np.ndarray) -> np.ndarray | None:
    """uint64 values of the non-empty hex strings (concatenated ``chars``, lengths ``lens``); None if any is bad."""
    if chars.size == 0:
        return np.zeros(0, dtype=np.uint64)
    if np.all((lens == 8) | (lens == 0)):  # Criteo's 8-digit ids: a pair lookup table and a big-endian view
        pairs = _PAIR[chars.view(np.uint16)]
        if pairs.max() > 255:
            return None
        return pairs.astype(np.uint8).view(">u4").astype(np.uint64)
    nib = _NIBBLE[chars]
    if nib.max() > 15 or lens.max() > 16:
        return None
    full = lens[lens > 0]
    ends = np.repeat(np.cumsum(full), full)
    shift = ((ends - 1 - np.arange(chars.size)) * 4).astype(np.uint64)
    return np.add.reduceat(nib.astype(np.uint64) << shift, np.cumsum(full) - full)


def parse_raw(buf: bytes, path: str, first_line: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Parse Criteo lines: labels int8 [n], integers int64 [n, 13] (missing: 0), lengths int64 [26, n] (0 for
    a missing id, else 1) and the ids' uint64 values, key-major. ``path`` / ``first_line`` (1-based) name a
    bad line in the error."""
    try:
        table = pacsv.read_csv(
            pa.py_buffer(buf),
            read_options=pacsv.ReadOptions(
                column_names=_NAMES, use_threads=False, block_size=max(len(buf), 1 << 16) + 1
            ),
            parse_options=_PARSE,
            convert_options=_CONVERT,
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise _bad_range(buf, path, first_line, str(e)) from None
    labels = table.column("label").to_numpy(zero_copy_only=False)
    if table.column("label").null_count or not np.all((labels == 0) | (labels == 1)):
        raise _bad_range(buf, path, first_line, "a label is not 0 or 1")
    n = table.num_rows
    ints = np.empty((n, NUM_DENSE), dtype=np.int64)
    for j in range(NUM_DENSE):
        col = table.column(f"i{j}").combine_chunks()
        values = np.frombuffer(col.buffers()[1], dtype=np.int64)[col.offset : col.offset + n]
        if col.null_count:  # a missing integer is 0 (the values under null slots are unspecified)
            first, skip = divmod(col.offset, 8)
            bits = np.frombuffer(col.buffers()[0], dtype=np.uint8)[first : (col.offset + n + 7) // 8]
            valid = np.unpackbits(bits, bitorder="little")[skip : skip + n].astype(bool)
            ints[:, j] = np.where(valid, values, 0)
        else:
            ints[:, j] = values
    chars, lens = [], []
    for j in range(NUM_CAT):
        col = table.column(f"c{j}").combine_chunks()
        offsets = np.frombuffer(col.buffers()[1], dtype=np.int32)[col.offset : col.offset + n + 1]
        data = col.buffers()[2]
        data = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, dtype=np.uint8)
        chars.append(data[offsets[0] : offsets[-1]])
        lens.append(np.diff(offsets))
    lens_all = np.stack(lens)  # [26, n]
    raw = _hex_values(np.concatenate(chars), lens_all.reshape(-1))
    if raw is None:
        raise _bad_range(buf, path, first_line, "a categorical id is not hex")
    return labels.astype(np.int8), ints, (lens_all > 0).astype(np.int64), raw


def dense_of(ints: np.ndarray) -> np.ndarray:
    """DLRM's dense input: ``log1p(max(x, 0))`` as float32."""
    return np.log1p(np.maximum(ints, 0).astype(np.float64)).astype(np.float32)


def hash_ids(raw: np.ndarray, lengths: np.ndarray, cardinalities: np.ndarray) -> np.ndarray:
    """Key-major raw ids -> ``[0, cardinality)`` per feature, as ``hash_into(raw, feature, cardinality)``."""
    counts = lengths.sum(1)
    with np.errstate(over="ignore"):
        return (
            mix64(raw ^ np.repeat(_FEATURE_KEYS, counts))
            % np.repeat(np.asarray(cardinalities, dtype=np.uint64), counts)
        ).astype(np.int64)


def parse_lines(
    buf: bytes, path: str, first_line: int, cardinalities: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Parse Criteo lines: (dense float32 [n, 13], lengths int64 [26, n], values int64, labels float32 [n]),
    ids hashed per feature into ``[0, cardinality)``."""
    labels, ints, lengths, raw = parse_raw(buf, path, first_line)
    return dense_of(ints), lengths, hash_ids(raw, lengths, cardinalities), labels.astype(np.float32)
