"""Readers for the real Criteo click logs: the raw TSV lines and the preprocessed NumPy arrays.

Both yield :class:`Batch` objects sharded over data-parallel ranks by the rule in
``lightning_rec.data._sharding`` (same number of batches per rank, no overlap, no loss) and read rows in
file order (no shuffling). Dense integers become ``log1p(max(x, 0))``, as DLRM feeds them; categorical
ids are folded into each table's range (hashed for raw hex strings, modulo for preprocessed ids).
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from lightning_rec.data._hashing import hash_into
from lightning_rec.data._sharding import global_batch_spans, rank_batch_ranges, worker_share
from lightning_rec.data.batch import Batch, batch_from_arrays
from lightning_rec.data.synthetic import CRITEO_CARDINALITIES, FEATURE_NAMES, NUM_DENSE

NUM_CAT = len(CRITEO_CARDINALITIES)
NUM_COLUMNS = 1 + NUM_DENSE + NUM_CAT
_LINE = re.compile(rb"[01](?:\t(?:-?[0-9]+)?){%d}(?:\t[0-9a-fA-F]{0,16}){%d}\r?\n?" % (NUM_DENSE, NUM_CAT))


def resolve_paths(path: str | Sequence[str]) -> list[str]:
    """A file, a directory (its files, sorted), a glob pattern, or a list of those -> existing files in order."""
    if not isinstance(path, str):
        return [p for item in path for p in resolve_paths(item)]
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if os.path.isfile(os.path.join(path, f)))
    elif any(c in path for c in "*?["):
        files = sorted(glob.glob(path))
    else:
        files = [path] if os.path.isfile(path) else []
    if not files:
        raise FileNotFoundError(f"no Criteo file found at {path!r}")
    return files


def _check_cardinalities(cardinalities: Sequence[int] | None, what: str) -> list[int]:
    cards = list(CRITEO_CARDINALITIES if cardinalities is None else [int(c) for c in cardinalities])
    if len(cards) != NUM_CAT or min(cards) < 1:
        raise ValueError(f"{what}: cardinalities must be {NUM_CAT} positive ints, got {cards}")
    return cards


def _dense_transform(x: np.ndarray) -> np.ndarray:
    return np.log1p(np.maximum(x.astype(np.float64), 0.0)).astype(np.float32)


def _window(total: int, start: int, num_rows: int | None, what: str) -> int:
    if start < 0 or (num_rows is not None and num_rows < 0):
        raise ValueError(f"{what}: start and num_rows must be >= 0, got {start} and {num_rows}")
    if num_rows is None:
        return max(0, total - start)
    if start + num_rows > total:
        raise ValueError(f"{what}: asked for rows [{start}, {start + num_rows}) but the data has {total} rows")
    return num_rows


def count_lines(path: str) -> int:
    """Lines in a text file (a last line without a newline counts)."""
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def _explain_bad_line(line: bytes, where: str) -> str:
    fields = line.rstrip(b"\r\n").split(b"\t")
    if len(fields) != NUM_COLUMNS:
        return (f"{where}: expected {NUM_COLUMNS} tab-separated columns (label, {NUM_DENSE} integers, {NUM_CAT} "
                f"hex categorical ids), got {len(fields)}")
    if fields[0] not in (b"0", b"1"):
        return f"{where}: column 1 (label) must be 0 or 1, got {fields[0][:40]!r}"
    for j, v in enumerate(fields[1 : 1 + NUM_DENSE]):
        if not re.fullmatch(rb"(?:-?[0-9]+)?", v):
            return f"{where}: column {j + 2} (integer feature {j}) must be an integer or empty, got {v[:40]!r}"
    for j, v in enumerate(fields[1 + NUM_DENSE :]):
        if not re.fullmatch(rb"[0-9a-fA-F]{0,16}", v):
            return (f"{where}: column {j + 2 + NUM_DENSE} (categorical feature {FEATURE_NAMES[j]}) must be a hex id "
                    f"of at most 16 digits or empty, got {v[:40]!r}")
    return f"{where}: malformed line"


class CriteoTSV(torch.utils.data.IterableDataset):
    """Criteo Kaggle / Terabyte click logs as tab-separated lines.

    Each line: ``label \\t 13 integers \\t 26 hex ids``; integers and ids may be empty (a missing integer
    is 0; a missing id is an empty bag for that feature). Hex ids are hashed into ``[0, cardinality)`` per
    feature. Several files (a list, a directory, or a glob such as ``day_*``) read as one stream of rows;
    ``start`` / ``num_rows`` pick a window of it (``None``: to the end).

    Lines are counted once at construction (about 1 GB/s) so that every rank knows the row count. Every
    rank reads every line but parses only its own; each global batch is checked whole by every rank before
    it yields its slice, so a bad line stops all ranks at the same step, with an error naming the file,
    the line number and the column. For large data sets prefer the preprocessed NumPy layout
    (:class:`CriteoNpy`).
    """

    num_dense: int = NUM_DENSE

    def __init__(
        self,
        path: str | Sequence[str],
        batch_size: int,
        cardinalities: Sequence[int] | None = None,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
        start: int = 0,
        num_rows: int | None = None,
    ) -> None:
        super().__init__()
        self.paths = resolve_paths(path)
        self.cardinalities = _check_cardinalities(cardinalities, "CriteoTSV")
        self.feature_names = list(FEATURE_NAMES)
        self.batch_size, self.start = int(batch_size), int(start)
        self._lines = [count_lines(p) for p in self.paths]
        what = f"CriteoTSV({self.paths[0]!r}{' ...' if len(self.paths) > 1 else ''})"
        self.num_rows_total = sum(self._lines)
        self.num_rows = _window(self.num_rows_total, self.start, num_rows, what)
        ranges = rank_batch_ranges(self.num_rows, self.batch_size, rank, world_size, drop_last, what)
        spans = global_batch_spans(self.num_rows, self.batch_size, world_size, drop_last)
        self._plan = [((a + self.start, b + self.start), (c + self.start, d + self.start))
                      for (a, b), (c, d) in zip(ranges, spans)]

    def __len__(self) -> int:
        return len(self._plan)

    def _lines_from(self, first: int) -> Iterator[tuple[int, bytes, str]]:
        """(global row, line, "file:line") from row ``first`` on."""
        row = 0
        for path, n in zip(self.paths, self._lines):
            if row + n <= first:
                row += n
                continue
            with open(path, "rb") as f:
                for lineno, line in enumerate(f, 1):
                    if row >= first:
                        yield row, line, f"{path}:{lineno}"
                    row += 1

    def __iter__(self) -> Iterator[Batch]:
        plan = list(worker_share(self._plan))
        if not plan:
            return
        lines = self._lines_from(plan[0][1][0])
        row, line, where = next(lines)
        for (own_a, own_b), (span_a, span_b) in plan:
            mine = []
            while row < span_b:
                if row >= span_a:
                    if not _LINE.fullmatch(line):
                        raise ValueError(_explain_bad_line(line, where))
                    if own_a <= row < own_b:
                        mine.append(line)
                nxt = next(lines, None)
                if nxt is None and row + 1 < span_b:
                    raise RuntimeError(f"CriteoTSV: {where} was the last line, but {self.paths} had more lines when "
                                       "counted; did a file change while reading?")
                row, line, where = nxt if nxt is not None else (span_b, b"", "")
            yield self._parse(mine)

    def _parse(self, lines: list[bytes]) -> Batch:
        fields = [ln.rstrip(b"\r\n").split(b"\t") for ln in lines]
        labels = np.asarray([int(f[0]) for f in fields], dtype=np.float32)
        ints = np.asarray([[int(v) if v else 0 for v in f[1 : 1 + NUM_DENSE]] for f in fields], dtype=np.int64)
        cats = [[f[1 + NUM_DENSE + j] for f in fields] for j in range(NUM_CAT)]
        lengths = np.asarray([[1 if v else 0 for v in col] for col in cats], dtype=np.int64).reshape(NUM_CAT, -1)
        values = [hash_into(np.asarray([int(v, 16) for v in col if v], dtype=np.uint64), j, self.cardinalities[j])
                  for j, col in enumerate(cats)]
        return batch_from_arrays(_dense_transform(ints.reshape(-1, NUM_DENSE)), lengths, np.concatenate(values),
                                 labels, self.feature_names)


class CriteoNpy(torch.utils.data.IterableDataset):
    """The preprocessed Criteo layout: arrays ``X_int`` ``[N, 13]``, ``X_cat`` ``[N, 26]`` and ``y`` ``[N]``.

    ``path`` is either a directory holding ``X_int.npy``, ``X_cat.npy`` and ``y.npy`` (memory-mapped, so any
    size streams), or an ``.npz`` file with arrays ``X_int``, ``X_cat``, ``y`` (as DLRM's
    ``*_processed.npz``; loaded whole). Integer ``X_int`` are raw counts and become ``log1p(max(x, 0))``;
    floating ``X_int`` are taken as already transformed. ``X_cat`` holds non-negative integer ids; ids at or
    above a table's cardinality are folded in by modulo (DLRM's ``--max-ind-range``). ``y`` must be 0/1.
    Every rank checks each whole global batch before yielding its slice, so bad values stop all ranks at
    the same step with an error naming the file, row and feature.
    """

    num_dense: int = NUM_DENSE
    FILES = ("X_int", "X_cat", "y")

    def __init__(
        self,
        path: str,
        batch_size: int,
        cardinalities: Sequence[int] | None = None,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
        start: int = 0,
        num_rows: int | None = None,
    ) -> None:
        super().__init__()
        self.path = path
        self.cardinalities = _check_cardinalities(cardinalities, "CriteoNpy")
        self.feature_names = list(FEATURE_NAMES)
        self.batch_size, self.start = int(batch_size), int(start)
        arrays, self._names = self._open(path)
        x_int, x_cat, y = arrays
        n = y.shape[0] if y.ndim else -1
        for arr, name, want in ((x_int, "X_int", (n, NUM_DENSE)), (x_cat, "X_cat", (n, NUM_CAT))):
            if arr.shape != want:
                raise ValueError(f"CriteoNpy: {self._names[name]} has shape {arr.shape}, expected {want} "
                                 f"({want[1]} columns, one row per label in {self._names['y']})")
        if y.ndim == 2 and y.shape[1] == 1:
            y = y.reshape(-1)
        if y.ndim != 1:
            raise ValueError(f"CriteoNpy: {self._names['y']} has shape {y.shape}, expected [N] or [N, 1]")
        if not np.issubdtype(x_cat.dtype, np.integer):
            raise ValueError(f"CriteoNpy: {self._names['X_cat']} must hold integer ids, got dtype {x_cat.dtype}")
        self._x_int, self._x_cat, self._y = x_int, x_cat, y
        what = f"CriteoNpy({path!r})"
        self.num_rows_total = int(y.shape[0])
        self.num_rows = _window(self.num_rows_total, self.start, num_rows, what)
        ranges = rank_batch_ranges(self.num_rows, self.batch_size, rank, world_size, drop_last, what)
        spans = global_batch_spans(self.num_rows, self.batch_size, world_size, drop_last)
        self._plan = [((a + self.start, b + self.start), (c + self.start, d + self.start))
                      for (a, b), (c, d) in zip(ranges, spans)]

    @classmethod
    def _open(cls, path: str) -> tuple[list[np.ndarray], dict[str, str]]:
        if os.path.isdir(path):
            names = {k: os.path.join(path, f"{k}.npy") for k in cls.FILES}
            missing = [p for p in names.values() if not os.path.isfile(p)]
            if missing:
                raise FileNotFoundError(f"CriteoNpy: {path!r} lacks {missing}; expected X_int.npy, X_cat.npy, y.npy")
            return [np.load(names[k], mmap_mode="r") for k in cls.FILES], names
        if not os.path.isfile(path):
            raise FileNotFoundError(f"CriteoNpy: no directory or .npz file at {path!r}")
        with np.load(path) as z:
            missing = [k for k in cls.FILES if k not in z.files]
            if missing:
                raise ValueError(f"CriteoNpy: {path!r} lacks arrays {missing} (has {z.files}); expected X_int, X_cat, y")
            return [z[k] for k in cls.FILES], {k: f"{path}[{k}]" for k in cls.FILES}

    def __len__(self) -> int:
        return len(self._plan)

    def _check(self, a: int, b: int) -> None:
        cat, y = np.asarray(self._x_cat[a:b]), np.asarray(self._y[a:b])
        bad = np.argwhere(cat < 0)
        if bad.size:
            r, j = bad[0]
            raise ValueError(f"CriteoNpy: {self._names['X_cat']} row {a + r} (0-based), feature {FEATURE_NAMES[j]}: "
                             f"id {cat[r, j]} is negative")
        bad = np.flatnonzero((y != 0) & (y != 1))
        if bad.size:
            raise ValueError(f"CriteoNpy: {self._names['y']} row {a + bad[0]} (0-based): label {y[bad[0]]} is not 0 or 1")
        if np.issubdtype(self._x_int.dtype, np.floating) and not np.isfinite(np.asarray(self._x_int[a:b])).all():
            r = int(np.argwhere(~np.isfinite(np.asarray(self._x_int[a:b])))[0][0])
            raise ValueError(f"CriteoNpy: {self._names['X_int']} row {a + r} (0-based) is not finite")

    def __iter__(self) -> Iterator[Batch]:
        cards = np.asarray(self.cardinalities, dtype=np.int64)
        for (a, b), span in worker_share(self._plan):
            self._check(*span)
            x_int = np.asarray(self._x_int[a:b])
            dense = x_int.astype(np.float32) if np.issubdtype(x_int.dtype, np.floating) else _dense_transform(x_int)
            ids = np.asarray(self._x_cat[a:b]).astype(np.int64) % cards  # [B, F]
            lengths = np.ones((NUM_CAT, b - a), dtype=np.int64)
            yield batch_from_arrays(dense, lengths, ids.T.reshape(-1), np.asarray(self._y[a:b], dtype=np.float32),
                                    self.feature_names)
