"""The cost model's numbers in the form the search compares them: fast, and the same bit for bit.

The search scores a few placements of every table against the per-rank totals placed so far; on a group of
thousands of ranks most of a placement's per-rank arrays are repeats. Here a placement of one table is
:class:`Terms`: sums over the time and memory parts given on its shards' ranks, and per host for the ranks
without a shard (they differ only by their host). Per-shard values that do not depend on where the shards go
(a :class:`_Shape`) are computed once per tiling shape and table, on the distinct (rows, columns) pairs only.

Every number is computed by the same floating-point operations, in the same order, as
:meth:`CostModel.sharded` (the reference): elementwise operations on fewer or reordered elements give the same
elements, and every sum or bincount runs over the same array as there. So :func:`load_of` rebuilds exactly the
reference's :class:`Load`, and the search's keys are exactly those the reference's arrays give.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, overload

import numpy as np

from lightning_rec.configs import ShardingType
from lightning_rec.plans.kinds import KINDS, ParameterSharding
from lightning_rec.plans.planner.cost import MEMORY_PARTS, CostModel, Load, TableStats
from lightning_rec.plans.shard_geometry import Tiling

_CACHED_SHARDS = 64  # shapes with at most this many shards are kept per table (probe, candidate and base reuse)


@dataclass
class Terms:
    """A placement of one table (or of tables kept together) as the search scores it."""

    ranks: slice | np.ndarray  # where its shards are: distinct ranks (a slice when consecutive)
    time: np.ndarray  # per shard: seconds, summed over TIME_PARTS
    idle: np.ndarray | None  # per host: seconds of a rank without a shard; None: every rank has one
    mem: np.ndarray  # per shard: device bytes, summed over MEMORY_PARTS (0 on ranks without a shard)
    host: np.ndarray | None  # per host: host-memory bytes (None: none)
    parts: Load | _Parts  # what load_of rebuilds the per-part load from (a Load, or the placement's pieces)

    def time_after(self, tot: np.ndarray, local_size: int) -> np.ndarray:
        """``tot +`` this placement's per-rank time, every rank (a host is ``local_size`` consecutive ranks)."""
        new = np.empty_like(tot) if self.idle is None else tot + self.idle.repeat(local_size)
        new[self.ranks] = tot[self.ranks] + self.time
        return new

    def host_on(self, H: int) -> np.ndarray:
        """Host memory per host, every host."""
        return np.zeros(H) if self.host is None else self.host

    def mem_on(self, M: int) -> np.ndarray:
        """Device memory per rank, every rank."""
        out = np.zeros(M)
        out[self.ranks] = self.mem
        return out


def whole(load: Load) -> Terms:
    """A load given on every rank (a replica, or the summed load of tables kept together) as terms."""
    return Terms(slice(0, load.time.shape[1]), load.time.sum(0), None, load.mem.sum(0), load.host, load)


@dataclass
class _Shape:
    """Per-shard values of one table's tiling that do not depend on which ranks hold the shards.

    Arrays are per run of equal (rows, cols) in shard order; ``runs`` holds the runs' lengths (None: one per shard).
    """

    runs: np.ndarray | None
    a: np.ndarray  # input-dist bytes per shard (every shard: sums and bincounts run over these)
    o: np.ndarray  # output-dist bytes per shard
    a_sum: float
    o_sum: float
    t4: float
    a_k: np.ndarray
    a_i: np.ndarray
    o_k: np.ndarray
    o_i: np.ndarray
    t0: tuple[np.ndarray, np.ndarray]  # lookup, in device memory and in host memory
    t1: np.ndarray
    t01: tuple[np.ndarray, np.ndarray]
    t6: np.ndarray | float
    per_shard: tuple[np.ndarray, ...]  # MEMORY_PARTS
    mem: tuple[np.ndarray, np.ndarray]  # summed memory on the device: tables in device memory, in host memory
    kept: np.ndarray  # weights, state and gradients, summed: what host memory holds when offloaded

    @overload
    def full(self, x: np.ndarray) -> np.ndarray: ...
    @overload
    def full(self, x: float) -> float: ...
    def full(self, x: np.ndarray | float) -> np.ndarray | float:
        return x if self.runs is None or isinstance(x, float) else x.repeat(self.runs)


#: a sharded placement's pieces: (shape, in host memory, (t2, expand), (t3, expand), idle2, idle3)
_Parts = tuple[
    _Shape,
    bool,
    tuple[np.ndarray, Callable[[np.ndarray], np.ndarray]],
    tuple[np.ndarray, Callable[[np.ndarray], np.ndarray]],
    np.ndarray,
    np.ndarray,
]


class _Fields:
    """The fields of many tables, one value per shard of theirs: what the cost model reads of ``TableStats``."""

    def __init__(self, stats: list[TableStats], of: np.ndarray) -> None:
        col = lambda f, dt: np.array([f(s) for s in stats], dtype=dt)[of]  # noqa: E731 - one field per shard
        self.rows, self.ids = col(lambda s: s.rows, np.int64), col(lambda s: s.ids, np.float64)
        self.elem, self.wire = col(lambda s: s.elem, np.int64), col(lambda s: s.wire, np.int64)
        self.features = col(lambda s: s.features, np.int64)
        self.st0, self.st1 = col(lambda s: s.state[0], np.int64), col(lambda s: s.state[1], np.int64)
        self.lookup_bw, self.update_bw = col(lambda s: s.lookup_bw, np.float64), col(lambda s: s.update_bw, np.float64)
        self.host_lookup_bw = col(lambda s: s.host_lookup_bw, np.float64)
        self.grads, self.pooled = stats[0].grads, stats[0].pooled

    def state_bytes(self, cols: np.ndarray) -> np.ndarray:
        return 4 * (self.st0 * cols + self.st1)  # TableStats.state_bytes


def _distinct(rows: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """Runs of equal (rows, cols) in shard order: (run lengths, run rows, run cols); no runs when they are many."""
    if len(rows) <= _CACHED_SHARDS:
        return None, rows, cols
    change = (rows[1:] != rows[:-1]) | (cols[1:] != cols[:-1])
    starts = np.flatnonzero(change) + 1
    if len(starts) * 4 > len(rows):
        return None, rows, cols
    first = np.concatenate(([0], starts))
    return np.diff(np.append(first, len(rows))), rows[first], cols[first]


def _values(model: CostModel, s: TableStats | _Fields, rows: np.ndarray, cols: np.ndarray) -> tuple:
    """Per-shard values; ``s`` is one table's stats, or :class:`_Fields` of many (the same expressions, operand for
    operand, as the reference: CostModel.sharded, _a2a and shard_memory)."""
    hw, M, B, R = model.hw, model.M, model.B, model.R
    live = rows > 0
    frac = rows / s.rows
    ids = M * B * s.ids * frac
    row_bytes = 2 * cols * s.elem + s.state_bytes(cols)
    if s.grads == "dense":
        t1 = rows * (row_bytes + cols * s.elem) / s.update_bw
    else:
        t1 = ids * row_bytes / s.update_bw
    a = np.where(live, B * (8 * s.ids * frac + 8 * s.features), 0.0)
    out_per = B * (s.features if s.pooled else s.ids * frac)
    o = np.where(live, out_per * cols * s.wire, 0.0)
    if R > 1:
        uniq = rows * -np.expm1(-ids / np.maximum(rows, 1))
        union = rows * -np.expm1(-R * ids / np.maximum(rows, 1))
        t6 = (R * uniq * 8 + 2 * (R - 1) / R * union * cols * s.wire) / model.replica_bw
    else:
        t6 = np.zeros(len(rows))
    t0 = [ids * (cols * s.elem + hw.lookup_overhead_bytes) / bw for bw in (s.lookup_bw, s.host_lookup_bw)]
    w, st, g, buf = model.shard_memory(s, rows, cols)  # type: ignore[arg-type]  # _Fields has what it reads
    return (
        a,
        o,
        a * model.k_in,
        a / hw.intra_host_bandwidth,
        o * model.k_in,
        o / hw.intra_host_bandwidth,
        t0[0],
        t0[1],
        t1,
        t0[0] + t1,
        t0[1] + t1,
        t6,
        w,
        st,
        g,
        buf,
        ((w + st) + g) + buf,
        ((0.0 + 0.0) + 0.0) + buf,
        (w + st) + g,
    )


def _make(model: CostModel, s: TableStats, tiling: Tiling, runs: np.ndarray | None, v: tuple) -> _Shape:
    """A :class:`_Shape` from the values of :func:`_values` for one table's runs."""
    a, o = (v[0], v[1]) if runs is None else (v[0].repeat(runs), v[1].repeat(runs))
    live = int(np.count_nonzero(tiling.row_sizes > 0)) * tiling.col_blocks
    t4 = model.B * s.ids / model.hw.bucketize_rate if live > tiling.col_blocks else 0.0
    t6 = v[11] if model.R > 1 else 0.0
    return _Shape(
        runs,
        a,
        o,
        a.sum(),
        o.sum(),
        t4,
        v[2],
        v[3],
        v[4],
        v[5],
        (v[6], v[7]),
        v[8],
        (v[9], v[10]),
        t6,
        (v[12], v[13], v[14], v[15]),
        (v[16], v[17]),
        v[18],
    )


def _layout(model: CostModel, s: TableStats, ps: ParameterSharding) -> Tiling | None:
    """The kind's tiling of a placement; small ones are kept per table (probes and bases recur)."""
    key = (
        "layout",
        ps.sharding_type,
        *(None if x is None else tuple(x) for x in (ps.ranks, ps.row_sizes, ps.col_sizes, ps.host_indexes)),
        ps.num_buckets,
    )
    tiling = s.shapes.get(key, False)
    if tiling is False:
        tiling = KINDS[ps.sharding_type].layout(s.config, ps, model.M, model.local)  # type: ignore[index]
        if tiling is None or len(tiling.rank) <= _CACHED_SHARDS:
            s.shapes[key] = tiling
    return tiling


def _key(tiling: Tiling) -> tuple:
    return tiling.row_sizes.tobytes(), tiling.col_sizes.tobytes()


def _shape(model: CostModel, s: TableStats, tiling: Tiling) -> _Shape:
    key = _key(tiling)
    shape = s.shapes.get(key)
    if shape is None:
        runs, rows, cols = _distinct(tiling.rows, tiling.cols)
        shape = _make(model, s, tiling, runs, _values(model, s, rows, cols))
        if len(tiling.rank) <= _CACHED_SHARDS:
            s.shapes[key] = shape
    return shape


def prepare(model: CostModel, items: list[tuple[TableStats, ParameterSharding]]) -> None:
    """Compute the shapes of the small placements of many tables at once (numpy over all their shards rather
    than a few operations per table), into each table's cache; :func:`placement_terms` then finds them."""
    groups: dict[tuple, dict] = {}
    for s, ps in items:
        if ps.sharding_type == ShardingType.ROW_WISE and model.M > _CACHED_SHARDS:
            continue  # a shard on every rank: too many to keep
        tiling = _layout(model, s, ps)
        if tiling is None or len(tiling.rank) > _CACHED_SHARDS or _key(tiling) in s.shapes:
            continue
        groups.setdefault((s.grads, s.pooled), {}).setdefault((id(s), _key(tiling)), (s, tiling))
    for unique in groups.values():
        group = list(unique.values())
        stats = [s for s, _ in group]
        sizes = np.array([len(t.rank) for _, t in group])
        ends = np.cumsum(sizes)
        of = np.repeat(np.arange(len(group)), sizes)
        rows = np.concatenate([t.rows for _, t in group])
        cols = np.concatenate([t.cols for _, t in group])
        values = _values(model, _Fields(stats, of), rows, cols)
        for j, (s, tiling) in enumerate(group):
            part = slice(ends[j] - sizes[j], ends[j])
            s.shapes.setdefault(_key(tiling), _make(model, s, tiling, None, tuple(x[part] for x in values)))


def _plus(x: np.ndarray, y: np.ndarray | float) -> np.ndarray:
    """``x + y``, skipped where ``y`` is the float 0 (the same numbers: no part here is -0)."""
    return x if isinstance(y, float) and y == 0.0 else x + y


def _index(ranks: np.ndarray) -> slice | np.ndarray:
    """Consecutive increasing ranks as a slice (cheaper to gather and scatter), else the ranks."""
    n = len(ranks)
    first = int(ranks[0]) if n else 0
    if n and int(ranks[-1]) - first == n - 1 and (n == 1 or bool((ranks[1:] > ranks[:-1]).all())):
        return slice(first, first + n)
    return ranks


@overload
def placement_terms(
    model: CostModel, s: TableStats, ps: ParameterSharding, both: Literal[False] = ..., host_only: bool = ...
) -> Terms: ...
@overload
def placement_terms(
    model: CostModel, s: TableStats, ps: ParameterSharding, both: Literal[True], host_only: bool = ...
) -> tuple[Terms, Terms]: ...
def placement_terms(
    model: CostModel, s: TableStats, ps: ParameterSharding, both: bool = False, host_only: bool = False
) -> Terms | tuple[Terms, Terms]:
    """A valid placement of one table as :class:`Terms`, the table in device memory; ``host_only``: in host memory;
    ``both``: the pair. Its sums, and :func:`load_of`, equal :meth:`CostModel.of_placement`'s bit for bit."""
    tiling = _layout(model, s, ps)
    if tiling is None:
        t = whole(model.replicated(s))
        return (t, t) if both else t
    hw, H, L = model.hw, model.H, model.local
    sh = _shape(model, s, tiling)
    ranks = tiling.rank
    where = _index(ranks)
    hosts = model.host_of[where] if isinstance(where, slice) else ranks // L
    c = 1 / hw.inter_host_bandwidth - 1 / hw.intra_host_bandwidth
    base_a = sh.a_sum / hw.inter_host_bandwidth - np.bincount(hosts, sh.a, minlength=H) * c
    base_o = sh.o_sum / hw.inter_host_bandwidth - np.bincount(hosts, sh.o, minlength=H) * c
    # per-shard values depend on the shard's run and host only: computed once per (run, host) segment of
    # consecutive ranks where there are few, then repeated over the segment's ranks
    if sh.runs is not None and isinstance(where, slice):
        run, host_of, seg = _segments(sh.runs, where.start, L)
        per_run = lambda x: x if isinstance(x, float) else x[run]  # noqa: E731 - per run -> per segment
        expand = lambda x: x.repeat(seg)  # noqa: E731 - per segment -> per shard
    else:
        host_of = hosts
        per_run, expand = sh.full, lambda x: x
    t2 = (per_run(sh.a_k) + np.maximum(base_a[host_of] - per_run(sh.a_i), 0.0)) / 2
    t3 = per_run(sh.o_k) + np.maximum(base_o[host_of] - per_run(sh.o_i), 0.0)
    # ranks without a shard: the senders' all-to-all terms and bucketizing only (their own share is 0)
    idle2, idle3 = (0.0 + np.maximum(base_a, 0.0)) / 2, 0.0 + np.maximum(base_o, 0.0)
    idle = _plus(idle2 + idle3, sh.t4) if len(ranks) < model.M else None  # the parts in order, 0 for the rest
    t6 = per_run(sh.t6)
    out = []
    for host in (False, True) if both else (True,) if host_only else (False,):
        time = expand(_plus(_plus((per_run(sh.t01[host]) + t2) + t3, sh.t4), t6))
        parts = (sh, host, (t2, expand), (t3, expand), idle2, idle3)
        mem = sh.full(sh.mem[host])
        if host:
            h, kept = hosts, sh.full(sh.kept)
            if not isinstance(where, slice) and not (ranks[1:] > ranks[:-1]).all():
                order = np.argsort(ranks, kind="stable")  # the reference adds a host's ranks in rank order
                h, kept = hosts[order], kept[order]
            out.append(Terms(where, time, idle, mem, np.bincount(h, kept, minlength=H), parts))
        else:
            out.append(Terms(where, time, idle, mem, None, parts))
    return (out[0], out[1]) if both else out[0]


def _segments(runs: np.ndarray, first: int, local: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Shards on consecutive ranks from ``first``, in runs of ``runs``: the maximal stretches of one run on one
    host, as (run, host, length) per stretch."""
    run_starts = np.concatenate(([0], np.cumsum(runs)[:-1]))
    n = int(run_starts[-1] + runs[-1])
    begins = np.zeros(n, dtype=bool)
    begins[run_starts] = True
    begins[(-first) % local :: local] = True  # the first shard on each host
    starts = np.flatnonzero(begins)
    return (
        np.searchsorted(run_starts, starts, side="right") - 1,
        (first + starts) // local,
        np.diff(np.append(starts, n)),
    )


def load_of(model: CostModel, terms: Terms, out: Load | None = None) -> Load:
    """The per-part :class:`Load` of ``terms``: the same arrays as :meth:`CostModel.of_placement`; written into
    ``out`` when given (a scratch load: fresh arrays this size cost more to fault in than to fill)."""
    if isinstance(terms.parts, Load):
        return terms.parts
    sh, host, t2, t3, idle2, idle3 = terms.parts
    where = terms.ranks
    if out is None:
        out = model.empty()
    else:
        out.time.fill(0.0)
        out.mem.fill(0.0)
    time, mem = out.time, out.mem
    time[0, where], time[1, where] = sh.full(sh.t0[host]), sh.full(sh.t1)
    if terms.idle is not None:
        time[2], time[3] = idle2.repeat(model.local), idle3.repeat(model.local)  # per host -> per rank
    time[2, where], time[3, where] = t2[1](t2[0]), t3[1](t3[0])
    time[4] = sh.t4
    time[6, where] = sh.full(sh.t6)
    if host:
        mem[3, where] = sh.full(sh.per_shard[3])
        out.host[:] = terms.host_on(model.H)
        return out
    for i, part in enumerate(sh.per_shard):
        mem[i, where] = sh.full(part)
    out.host.fill(0.0)
    return out


def probe_memory(model: CostModel, s: TableStats, ps: ParameterSharding, upto: int) -> np.ndarray:
    """Device memory ``[len(MEMORY_PARTS), upto]`` of ranks ``0..upto-1`` under a placement (no offload)."""
    tiling = _layout(model, s, ps)
    out = np.zeros((len(MEMORY_PARTS), upto))
    if tiling is None:
        out += model.replicated(s).mem[:, :upto]
        return out
    sh = _shape(model, s, tiling)
    mine = tiling.rank < upto
    where = tiling.rank[mine]
    for i, part in enumerate(sh.per_shard):
        out[i, where] = sh.full(part)[mine]
    return out


def probe_need(model: CostModel, s: TableStats, ps: ParameterSharding, upto: int) -> np.ndarray:
    """``probe_memory(...).sum(0)``: device memory of ranks ``0..upto-1`` summed over MEMORY_PARTS."""
    tiling = _layout(model, s, ps)
    if tiling is None:
        return probe_memory(model, s, ps, upto).sum(0)
    sh = _shape(model, s, tiling)
    mine = tiling.rank < upto
    out = np.zeros(upto)
    out[tiling.rank[mine]] = sh.full(sh.mem[0])[mine]  # 0 + each part, added in order: the parts' sum
    return out
