"""``lightning-rec convert``: Criteo TSV -> Parquet (for :class:`CriteoParquet`) or npy (for :class:`CriteoNpy`).

Streamed: lines are parsed in chunks (``chunk_rows``) with the same vectorised parser as
:class:`CriteoTSV` and written as they come (a Parquet row group per chunk; npy arrays memory-mapped), so
memory stays bounded for any input size. A bad line stops the conversion with its file, line and column,
and no partial output is left under the final name.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import pyarrow.parquet as pq

from lightning_rec.data._tsv import NUM_CAT, LineIndex, hash_ids, parse_raw
from lightning_rec.data.criteo import _check_cardinalities, resolve_paths
from lightning_rec.data.parquet import INT_COLUMNS, LABEL, SCHEMA, table_of
from lightning_rec.data.synthetic import NUM_DENSE, scaled_cardinalities

FORMATS = ("parquet", "npy")


def convert(
    src: str | Sequence[str],
    out: str,
    fmt: str = "parquet",
    chunk_rows: int = 262144,
    cardinalities: Sequence[int] | None = None,
    progress: Callable[[int, int, float], None] | None = None,
) -> int:
    """Convert Criteo TSV files ``src`` into ``out``; returns the number of rows written.

    ``fmt="parquet"``: ``out`` is a directory with one ``.parquet`` file per input file (raw ids, hashed at
    read time). ``fmt="npy"``: ``out`` is a directory with ``X_int.npy`` (int32), ``X_cat.npy`` (int64 ids
    hashed into ``cardinalities``, a missing id becoming the hash of 0, since the layout has no empty bags)
    and ``y.npy`` (int8). ``progress(rows_done, rows_total, seconds)`` is called after each chunk.
    """
    if fmt not in FORMATS:
        raise ValueError(f"convert: format must be one of {list(FORMATS)}, got {fmt!r}")
    if chunk_rows < 1:
        raise ValueError(f"convert: chunk_rows must be >= 1, got {chunk_rows}")
    cards = np.asarray(_check_cardinalities(cardinalities, "convert"), dtype=np.uint64)
    indexes = [LineIndex.build(p) for p in resolve_paths(src)]
    total = sum(ix.lines for ix in indexes)
    if os.path.exists(out):
        raise FileExistsError(f"convert: {out!r} exists; give a new directory")
    tmp = out.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    start, done = time.perf_counter(), 0
    try:
        if fmt == "npy":
            arrays = {
                name: np.lib.format.open_memmap(os.path.join(tmp, f"{name}.npy"), mode="w+", dtype=dt, shape=shape)
                for name, dt, shape in (
                    ("X_int", np.int32, (total, NUM_DENSE)),
                    ("X_cat", np.int64, (total, NUM_CAT)),
                    ("y", np.int8, (total,)),
                )
            }
        for ix in indexes:
            writer = None
            if fmt == "parquet":
                # ids are nearly all distinct: dictionary-encoding them costs time and saves nothing
                writer = pq.ParquetWriter(
                    os.path.join(tmp, os.path.basename(ix.path) + ".parquet"),
                    SCHEMA,
                    use_dictionary=[LABEL, *INT_COLUMNS],
                )
            try:
                for a in range(0, ix.lines, chunk_rows):
                    b = min(ix.lines, a + chunk_rows)
                    labels, ints, lengths, raw = parse_raw(ix.read(a, b), ix.path, a + 1)
                    if writer is not None:
                        writer.write_table(table_of(labels, ints, lengths, raw), row_group_size=b - a)
                    else:
                        _write_npy(arrays, done, labels, ints, lengths, raw, cards, ix.path, a)
                    done += b - a
                    if progress is not None:
                        progress(done, total, time.perf_counter() - start)
            finally:
                if writer is not None:
                    writer.close()
        if fmt == "npy":
            for arr in arrays.values():
                arr.flush()
            del arrays
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return done


def _write_npy(
    arrays: Mapping[str, np.ndarray],
    row: int,
    labels: np.ndarray,
    ints: np.ndarray,
    lengths: np.ndarray,
    raw: np.ndarray,
    cards: np.ndarray,
    path: str,
    first: int,
) -> None:
    n = labels.shape[0]
    big = np.flatnonzero(np.abs(ints).max(1) > np.iinfo(np.int32).max)
    if big.size:
        raise ValueError(
            f"convert: {path}:{first + 1 + big[0]}: an integer feature does not fit the npy layout's int32"
        )
    full = np.zeros((NUM_CAT, n), dtype=np.uint64)
    full[lengths > 0] = raw  # key-major, row order within a key: the same order as the boolean mask
    ids = hash_ids(full.reshape(-1), np.ones((NUM_CAT, n), dtype=np.int64), cards).reshape(NUM_CAT, n)
    arrays["X_int"][row : row + n] = ints.astype(np.int32)
    arrays["X_cat"][row : row + n] = ids.T
    arrays["y"][row : row + n] = labels


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``convert`` subcommand on the ``lightning-rec`` parser."""
    p = sub.add_parser("convert", help="convert Criteo TSV files to Parquet or npy (streamed)")
    p.add_argument("src", nargs="+", help="TSV files, directories or glob patterns (read in order as one stream)")
    p.add_argument("--out", required=True, help="output directory (must not exist)")
    p.add_argument("--format", choices=FORMATS, default="parquet")
    p.add_argument("--chunk-rows", type=int, default=262144, help="lines parsed per chunk (a Parquet row group)")
    p.add_argument("--size", type=float, help="npy only: table sizes as CRITEO_CARDINALITIES scaled by SIZE")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def command(args: argparse.Namespace) -> int:
    """Run ``lightning-rec convert``."""

    def report(done: int, total: int, seconds: float) -> None:
        print(
            f"convert: {done:,}/{total:,} rows ({100 * done / max(total, 1):.0f}%), "
            f"{done / max(seconds, 1e-9):,.0f} rows/s",
            file=sys.stderr,
            flush=True,
        )

    cards = scaled_cardinalities(args.size) if args.size else None
    n = convert(args.src, args.out, args.format, args.chunk_rows, cards, None if args.quiet else report)
    print(f"convert: wrote {n:,} rows to {args.out} ({args.format})")
    return 0
