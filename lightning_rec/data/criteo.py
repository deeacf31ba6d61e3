"""Readers for the real Criteo click logs: the raw TSV lines and the preprocessed NumPy arrays.

Both yield :class:`Batch` objects sharded over data-parallel ranks by the rule in
``lightning_rec.data._rank_rows`` (same number of batches per rank, no overlap, no loss), each rank reading
only its own rows, in file order or block-shuffled per epoch (``lightning_rec.data._stream``). Dense
integers become ``log1p(max(x, 0))``, as DLRM feeds them; categorical ids are folded into each table's
range (hashed for raw hex strings, modulo for preprocessed ids), or kept raw (``raw_ids=True``) for
managed-collision tables.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence

import numpy as np

from lightning_rec.data._stream import Arrays, ClickStream, concat_rows
from lightning_rec.data._tsv import NUM_CAT, LineIndex, dense_of, hash_ids, parse_raw
from lightning_rec.data.synthetic import CRITEO_CARDINALITIES, FEATURE_NAMES, NUM_DENSE


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


def raw_id_values(raw: np.ndarray, lengths: np.ndarray, what: str) -> np.ndarray:
    """Raw uint64 ids as int64 (``raw_ids=True``): refused, naming the feature, if one does not fit below 2**63."""
    bad = np.flatnonzero(raw >= np.uint64(1 << 63))
    if bad.size:
        f = int(np.searchsorted(np.cumsum(lengths.sum(1)), bad[0], side="right"))
        raise ValueError(
            f"{what}: feature {FEATURE_NAMES[f]} has raw id {int(raw[bad[0]]):#x}, which does not fit "
            "a non-negative int64 (raw ids must be below 2**63); read it hashed (raw_ids=False)"
        )
    return raw.astype(np.int64)


class _CriteoFiles(ClickStream):
    """The shared part of the Criteo file readers (:class:`CriteoTSV`, ``CriteoParquet``): files, table sizes,
    the row window, and categorical ids hashed into the tables or kept raw (``raw_ids``).

    Subclasses index their files in ``_index_files`` (returning the total row count) and read rows in
    ``read_rows``, passing each read's raw uint64 ids through :meth:`_ids`.
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
        shuffle: bool = False,
        shuffle_block: int = 65536,
        seed: int = 0,
        raw_ids: bool = False,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        self.paths = resolve_paths(path)
        self.cardinalities = _check_cardinalities(cardinalities, name)
        self._cards = np.asarray(self.cardinalities, dtype=np.uint64)
        self.feature_names = list(FEATURE_NAMES)
        self.start = int(start)
        self.raw_ids = bool(raw_ids)
        what = f"{name}({self.paths[0]!r}{' ...' if len(self.paths) > 1 else ''})"
        self.num_rows_total = self._index_files()
        n = _window(self.num_rows_total, self.start, num_rows, what)
        self._init_stream(n, batch_size, rank, world_size, drop_last, shuffle, shuffle_block, seed, what)

    def _index_files(self) -> int:
        raise NotImplementedError

    def _ids(self, raw: np.ndarray, lengths: np.ndarray, where: str) -> np.ndarray:
        """Key-major raw uint64 ids -> int64 ids: hashed per feature into ``[0, cardinality)``, or raw."""
        return raw_id_values(raw, lengths, where) if self.raw_ids else hash_ids(raw, lengths, self._cards)

    def describe(self) -> dict:
        return {**super().describe(), "start": self.start, "raw_ids": self.raw_ids}


class CriteoTSV(_CriteoFiles):
    """Criteo Kaggle / Terabyte click logs as tab-separated lines.

    Each line: ``label \\t 13 integers \\t 26 hex ids``; integers and ids may be empty (a missing integer
    is 0; a missing id is an empty bag for that feature). Hex ids are hashed into ``[0, cardinality)`` per
    feature, or, with ``raw_ids=True``, passed on as their raw 64-bit values (for managed-collision tables,
    which map any id to a row; ``cardinalities`` then only size the tables). Several files (a list, a
    directory, or a glob such as ``day_*``) read as one stream of rows; ``start`` / ``num_rows`` pick a
    window of it (``None``: to the end).

    Files are indexed once at construction (line count and the byte offset of every 256th line; speed in
    ``benchmarks/results/data.md``), so each rank (and each DataLoader worker) reads and parses only the bytes
    of its own rows, with pyarrow's CSV reader and vectorised hex parsing. A bad line raises a ValueError naming
    the file, the line and the column; under :class:`ClickLoader` every rank raises it at the same step.
    ``shuffle`` reads blocks of ``shuffle_block`` lines in an order drawn from ``(seed, epoch)``. For repeated
    epochs over large data prefer Parquet (``lightning-rec convert``, :class:`CriteoParquet`).
    """

    def _index_files(self) -> int:
        self._index = [LineIndex.build(p) for p in self.paths]
        self._first_row = np.cumsum([0] + [ix.lines for ix in self._index])
        return int(self._first_row[-1])

    def read_rows(self, start: int, stop: int) -> Arrays:
        start, stop = start + self.start, stop + self.start
        parts = []
        f = int(np.searchsorted(self._first_row, start, side="right")) - 1
        while start < stop:
            ix, base = self._index[f], int(self._first_row[f])
            a, b = start - base, min(stop - base, ix.lines)
            labels, ints, lengths, raw = parse_raw(ix.read(a, b), ix.path, a + 1)
            ids = self._ids(raw, lengths, f"CriteoTSV: {ix.path} lines {a + 1}-{b}")
            parts.append((dense_of(ints), lengths, ids, labels.astype(np.float32)))
            start, f = base + b, f + 1
        return concat_rows(parts)


class CriteoNpy(ClickStream):
    """The preprocessed Criteo layout: arrays ``X_int`` ``[N, 13]``, ``X_cat`` ``[N, 26]`` and ``y`` ``[N]``.

    ``path`` is either a directory holding ``X_int.npy``, ``X_cat.npy`` and ``y.npy`` (memory-mapped, so any
    size streams and each rank touches only its own rows), or an ``.npz`` file with arrays ``X_int``,
    ``X_cat``, ``y`` (as DLRM's ``*_processed.npz``; loaded whole). Integer ``X_int`` are raw counts and
    become ``log1p(max(x, 0))``; floating ``X_int`` are taken as already transformed. ``X_cat`` holds
    non-negative integer ids; ids at or above a table's cardinality are folded in by modulo (DLRM's
    ``--max-ind-range``), unless ``raw_ids=True`` keeps them as they are (for managed-collision tables).
    ``y`` must be 0/1. Bad values raise an error naming the file, row and feature
    (on every rank at the same step under :class:`ClickLoader`). ``shuffle``: as :class:`CriteoTSV`.
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
        shuffle: bool = False,
        shuffle_block: int = 65536,
        seed: int = 0,
        raw_ids: bool = False,
    ) -> None:
        super().__init__()
        self.path = path
        self.raw_ids = bool(raw_ids)
        self.cardinalities = _check_cardinalities(cardinalities, "CriteoNpy")
        self._cards = np.asarray(self.cardinalities, dtype=np.int64)
        self.feature_names = list(FEATURE_NAMES)
        self.start = int(start)
        arrays, self._names = self._open(path)
        x_int, x_cat, y = arrays
        n = y.shape[0] if y.ndim else -1
        for arr, name, want in ((x_int, "X_int", (n, NUM_DENSE)), (x_cat, "X_cat", (n, NUM_CAT))):
            if arr.shape != want:
                raise ValueError(
                    f"CriteoNpy: {self._names[name]} has shape {arr.shape}, expected {want} "
                    f"({want[1]} columns, one row per label in {self._names['y']})"
                )
        if y.ndim == 2 and y.shape[1] == 1:
            y = y.reshape(-1)
        if y.ndim != 1:
            raise ValueError(f"CriteoNpy: {self._names['y']} has shape {y.shape}, expected [N] or [N, 1]")
        if not np.issubdtype(x_cat.dtype, np.integer):
            raise ValueError(f"CriteoNpy: {self._names['X_cat']} must hold integer ids, got dtype {x_cat.dtype}")
        self._x_int, self._x_cat, self._y = x_int, x_cat, y
        what = f"CriteoNpy({path!r})"
        self.num_rows_total = int(y.shape[0])
        rows = _window(self.num_rows_total, self.start, num_rows, what)
        self._init_stream(rows, batch_size, rank, world_size, drop_last, shuffle, shuffle_block, seed, what)

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
                raise ValueError(
                    f"CriteoNpy: {path!r} lacks arrays {missing} (has {z.files}); expected X_int, X_cat, y"
                )
            return [z[k] for k in cls.FILES], {k: f"{path}[{k}]" for k in cls.FILES}

    def read_rows(self, start: int, stop: int) -> Arrays:
        a, b = start + self.start, stop + self.start
        cat, y, x_int = np.asarray(self._x_cat[a:b]), np.asarray(self._y[a:b]), np.asarray(self._x_int[a:b])
        bad: np.ndarray = np.argwhere(cat < 0)
        if bad.size:
            r, j = bad[0]
            raise ValueError(
                f"CriteoNpy: {self._names['X_cat']} row {a + r} (0-based), feature {FEATURE_NAMES[j]}: "
                f"id {cat[r, j]} is negative"
            )
        bad = np.flatnonzero((y != 0) & (y != 1))
        if bad.size:
            raise ValueError(
                f"CriteoNpy: {self._names['y']} row {a + bad[0]} (0-based): label {y[bad[0]]} is not 0 or 1"
            )
        if np.issubdtype(x_int.dtype, np.floating):
            if not np.isfinite(x_int).all():
                r = int(np.argwhere(~np.isfinite(x_int))[0][0])
                raise ValueError(f"CriteoNpy: {self._names['X_int']} row {a + r} (0-based) is not finite")
            dense = x_int.astype(np.float32)
        else:
            dense = _dense_transform(x_int)
        ids = cat.astype(np.int64)  # [B, F]
        if not self.raw_ids:
            ids = ids % self._cards
        return dense, np.ones((NUM_CAT, b - a), dtype=np.int64), ids.T.reshape(-1), y.astype(np.float32)

    def describe(self) -> dict:
        return {**super().describe(), "start": self.start, "raw_ids": self.raw_ids}
