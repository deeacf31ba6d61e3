"""Criteo click logs as Parquet: the scalable format (columnar, compressed, random access by row group).

The layout (written by ``lightning-rec convert``): ``label`` int8, ``i0`` .. ``i12`` int64 (raw counts, a
missing value is 0), ``c0`` .. ``c25`` uint64 (the raw 64-bit id; null for a missing id). Ids are hashed into
the tables at read time, so one file serves any table sizes.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lightning_rec.data._stream import Arrays, concat_rows
from lightning_rec.data._tsv import NUM_CAT, dense_of
from lightning_rec.data.criteo import _CriteoFiles
from lightning_rec.data.synthetic import NUM_DENSE

LABEL = "label"
INT_COLUMNS = [f"i{j}" for j in range(NUM_DENSE)]
CAT_COLUMNS = [f"c{j}" for j in range(NUM_CAT)]
SCHEMA = pa.schema(
    [(LABEL, pa.int8()), *[(c, pa.int64()) for c in INT_COLUMNS], *[(c, pa.uint64()) for c in CAT_COLUMNS]]
)


def table_of(labels: np.ndarray, ints: np.ndarray, lengths: np.ndarray, raw: np.ndarray) -> pa.Table:
    """A Parquet-layout table from parsed rows (``_tsv.parse_raw``'s arrays)."""
    n = labels.shape[0]
    cols = [pa.array(labels.astype(np.int8))] + [pa.array(ints[:, j]) for j in range(NUM_DENSE)]
    ends = np.cumsum(lengths.sum(1))
    for j in range(NUM_CAT):
        present = lengths[j] > 0
        full = np.zeros(n, dtype=np.uint64)
        full[present] = raw[ends[j] - present.sum() : ends[j]]
        cols.append(pa.array(full, mask=~present))
    return pa.Table.from_arrays(cols, schema=SCHEMA)


def _column(t: pa.Table, name: str) -> pa.Array:
    col = t.column(name)
    return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()


def _values(arr: pa.Array) -> np.ndarray:
    """A fixed-width array's values, zero-copy (whatever sits under null slots)."""
    dtype = arr.type.to_pandas_dtype()
    return np.frombuffer(arr.buffers()[1], dtype=dtype)[arr.offset : arr.offset + len(arr)]


def _filled(arr: pa.Array) -> pa.Array:
    return arr if arr.null_count == 0 else arr.fill_null(0)


def _valid(arr: pa.Array) -> np.ndarray:
    if arr.null_count == 0:
        return np.ones(len(arr), dtype=bool)
    first, skip = divmod(arr.offset, 8)  # unpack only the bytes under this slice of the row group
    raw = np.frombuffer(arr.buffers()[0], dtype=np.uint8)[first : (arr.offset + len(arr) + 7) // 8]
    return np.unpackbits(raw, bitorder="little")[skip : skip + len(arr)].astype(bool)


class CriteoParquet(_CriteoFiles):
    """Criteo rows from Parquet files in the layout above (a file, a directory, a glob, or a list of them).

    Reads whole row groups (the one under a batch is cached, so consecutive batches decode it once) and
    only the rows of this rank; ``start`` / ``num_rows`` / ``shuffle`` / ``raw_ids`` / sharding as
    :class:`CriteoTSV`. Missing ids are empty bags; ids are hashed per feature into ``[0, cardinality)``
    exactly as the TSV reader hashes the same hex id, so a converted file yields the same batches as its TSV.
    """

    def _index_files(self) -> int:
        groups = []  # (file index, row group, first row)
        row = 0
        for f, p in enumerate(self.paths):
            try:
                meta = pq.read_metadata(p)
            except (pa.ArrowInvalid, OSError) as e:
                raise ValueError(f"CriteoParquet: {p} is not a Parquet file: {e}") from None
            names = set(meta.schema.to_arrow_schema().names)
            missing = [c for c in SCHEMA.names if c not in names]
            if missing:
                raise ValueError(f"CriteoParquet: {p} lacks columns {missing}; write it with `lightning-rec convert`")
            for g in range(meta.num_row_groups):
                groups.append((f, g, row))
                row += meta.row_group(g).num_rows
        self._groups = groups
        self._group_starts = np.asarray([g[2] for g in groups] + [row], dtype=np.int64)
        self._cache: tuple[int, pa.Table] | None = None
        return row

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_cache": None}  # workers decode their own row groups

    def _group(self, k: int) -> pa.Table:
        if self._cache is None or self._cache[0] != k:
            f, g, _ = self._groups[k]
            self._cache = (k, pq.ParquetFile(self.paths[f]).read_row_group(g, columns=SCHEMA.names))
        return self._cache[1]

    def read_rows(self, start: int, stop: int) -> Arrays:
        start, stop = start + self.start, stop + self.start
        parts = []
        k = int(np.searchsorted(self._group_starts, start, side="right")) - 1
        while start < stop:
            base, end = int(self._group_starts[k]), int(self._group_starts[k + 1])
            take = min(stop, end) - start
            parts.append(self._convert(self._group(k).slice(start - base, take), k))
            start, k = start + take, k + 1
        return concat_rows(parts)

    def _convert(self, t: pa.Table, k: int) -> Arrays:
        labels = _column(t, LABEL)
        if labels.null_count or not np.all((_values(labels) == 0) | (_values(labels) == 1)):
            f, g, _ = self._groups[k]
            raise ValueError(f"CriteoParquet: {self.paths[f]} row group {g}: a label is null or not 0 or 1")
        ints = np.stack([_values(_filled(_column(t, c))) for c in INT_COLUMNS], axis=1)
        cols = [_column(t, c) for c in CAT_COLUMNS]
        present = np.stack([_valid(c) for c in cols])
        raw = np.concatenate([_values(c)[m] for c, m in zip(cols, present)])
        lengths = present.astype(np.int64)
        f, g, _ = self._groups[k]
        ids = self._ids(raw, lengths, f"CriteoParquet: {self.paths[f]} row group {g}")
        return dense_of(ints), lengths, ids, _values(labels).astype(np.float32)
