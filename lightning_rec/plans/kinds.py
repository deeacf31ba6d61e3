"""One class per sharding type: the fields it accepts, its tiling, the placements the planner tries, its label.

Every model-parallel sharding type is a tiling of a table into ``ShardMeta`` rectangles (``shard_geometry.Tiling``);
one pipeline serves them all, so this module is the only place that knows what each type means.
``plan.py`` resolves placements through :func:`kind_of`, the planner asks each kind for candidates and
labels, and the CLI checks a placement's fields against :attr:`ShardingKind.fields`.

Ranks are ranks of the model-parallel group; a host is ``local_size`` consecutive ranks of it.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np

from lightning_rec.configs import BaseEmbeddingConfig, ShardingType
from lightning_rec.plans.shard_geometry import (
    COMPUTE_KERNELS,
    PLACEMENT_FIELDS,
    EnumerableShardingSpec,
    ParameterSharding,
    ShardMeta,
    ShardMetadata,
    ShardPlacement,
    Tiling,
    even_blocks,
)

# TorchRec's placement descriptions (``shard_geometry.py``) are re-exported: plans and the CLI import them from here
# as well
__all__ = [
    "COMPUTE_KERNELS",
    "KINDS",
    "PLACEMENT_FIELDS",
    "CandidateSpace",
    "ColumnWise",
    "DataParallel",
    "EnumerableShardingSpec",
    "GridShard",
    "ParameterSharding",
    "RowWise",
    "ShardMetadata",
    "ShardPlacement",
    "ShardingKind",
    "TableColumnWise",
    "TableRowWise",
    "TableWise",
    "kind_of",
    "placement_of",
    "resolved_ranks",
]


def _as_ints(table: str, field_name: str, values: Iterable[object] | None) -> list[int] | None:
    # numpy and other integral types are fine; bools, floats and strings are mistakes
    if values is None:
        return None
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise ValueError(f"table {table!r}: {field_name} must hold integers, got {v!r} in {list(values)}")
        out.append(int(v))
    return out


def _check_rank(table: str, rank: int, group_size: int, what: str) -> None:
    if not 0 <= rank < group_size:
        raise ValueError(
            f"table {table!r}: {what} {rank!r} is outside the model-parallel group (valid ranks: 0..{group_size - 1})"
        )


def _check_host(table: str, host: int, group_size: int, local_size: int) -> None:
    num_hosts = group_size // local_size
    if not 0 <= host < num_hosts:
        raise ValueError(
            f"table {table!r}: host index {host!r} has no ranks; with {group_size} ranks and local_size={local_size} "
            f"the valid host indexes are 0..{num_hosts - 1}"
        )


def _col_sizes(table: BaseEmbeddingConfig, ps: ParameterSharding, n: int) -> list[int]:
    dim = table.embedding_dim
    if n == 0:
        raise ValueError(f"table {table.name!r}: {ps.sharding_type.value} needs at least one column shard")  # type: ignore[union-attr]
    if ps.col_sizes is not None:
        sizes = ps.col_sizes
        if len(sizes) != n or any(s <= 0 for s in sizes) or sum(sizes) != dim:
            raise ValueError(
                f"table {table.name!r}: column sizes {sizes} must be {n} positive widths summing to embedding_dim={dim}"
            )
        return list(sizes)
    if n > dim or dim % n:
        raise ValueError(
            f"table {table.name!r}: {n} column shards do not divide embedding_dim={dim}; use a number of shards "
            f"that divides {dim}, or give explicit column sizes"
        )
    return [dim // n] * n


def _bucket_rows(table: BaseEmbeddingConfig, num_buckets: int, group_size: int) -> list[int]:
    """TorchRec's bucketized row-wise sizes: equal buckets, the first ``num_buckets % group_size`` ranks one more."""
    if table.num_embeddings % num_buckets:
        raise ValueError(
            f"table {table.name!r}: num_buckets={num_buckets} does not divide num_embeddings={table.num_embeddings}"
        )
    size, per_rank, extra = table.num_embeddings // num_buckets, num_buckets // group_size, num_buckets % group_size
    return [size * (per_rank + (r < extra)) for r in range(group_size)]


def resolved_ranks(tiling: Tiling | None, group_size: int) -> list[int]:
    """The ranks of a placement in TorchRec's order: every rank for a replica, else its shards' ranks (column
    shards in order, row blocks within each)."""
    return list(range(group_size)) if tiling is None else [int(r) for r in tiling.rank]


class CandidateSpace(Protocol):
    """What a kind needs from the planner to propose placements for one table (or group kept together)."""

    group_size: int
    local_size: int
    num_hosts: int
    #: numbers of column shards (> 1) the tables' widths allow
    column_shards: Sequence[int]

    def best_ranks(self, k: int, probe: ParameterSharding) -> list[int]:
        """The ``k`` ranks where a placement shaped like ``probe`` (on ranks ``0..k-1``) is best put."""
        ...

    def best_hosts(self, k: int, probe: ParameterSharding) -> list[int]:
        """The ``k`` hosts where a placement shaped like ``probe`` (on hosts ``0..k-1``) is best put."""
        ...


class ShardingKind:
    """One sharding type. Subclasses set the type, its fields, and implement the tiling."""

    sharding_type: ClassVar[ShardingType]
    #: the ParameterSharding fields (besides ``compute_kernel``) this type accepts
    fields: ClassVar[tuple[str, ...]] = ()
    #: whether hosts (``local_size``) must be well defined to resolve it
    needs_hosts: ClassVar[bool] = False

    def normalized(self, name: str, ps: ParameterSharding) -> ParameterSharding:
        """``ps`` with its fields checked against this type and converted to plain ints."""
        for field_name in PLACEMENT_FIELDS:
            if field_name == "ranks" and "ranks" not in self.fields:
                continue  # ranks that follow from the placement: checked against it in tiling()
            if getattr(ps, field_name) is not None and field_name not in self.fields:
                raise ValueError(
                    f"table {name!r}: {field_name} does not apply to {self.sharding_type.value} "
                    f"(it takes {list(self.fields) or 'no options'})"
                )
        placement: dict[str, Any] = {f: _as_ints(name, f, getattr(ps, f)) for f in PLACEMENT_FIELDS}
        return ParameterSharding(
            self.sharding_type,
            **placement,
            compute_kernel=ps.compute_kernel,
            num_buckets=ps.num_buckets,
        )

    def tiling(
        self, table: BaseEmbeddingConfig, ps: ParameterSharding, group_size: int, local_size: int
    ) -> Tiling | None:
        """Validate ``ps`` for ``table`` and return its rectangles (None: a full replica on every rank)."""
        ps = self.normalized(table.name, ps)
        if self.needs_hosts and group_size % local_size:
            raise ValueError(
                f"table {table.name!r}: local_size={local_size} does not divide the group size "
                f"{group_size}, so hosts are undefined"
            )
        given = ps.ranks if "ranks" not in self.fields else None
        if given is not None:
            ps = ParameterSharding(
                ps.sharding_type, None, ps.row_sizes, ps.col_sizes, ps.host_indexes, ps.compute_kernel, ps.num_buckets
            )
        tiling = self._tile(table, ps, group_size, local_size)
        if given is not None:
            derived = resolved_ranks(tiling, group_size)
            if given != derived:
                raise ValueError(
                    f"table {table.name!r}: ranks does not apply to {self.sharding_type.value} (it takes "
                    f"{list(self.fields) or 'no options'}) unless it equals the ranks the placement resolves to, "
                    f"{derived}; got {given}"
                )
        return tiling

    def layout(
        self, table: BaseEmbeddingConfig, ps: ParameterSharding, group_size: int, local_size: int
    ) -> Tiling | None:
        """:meth:`tiling` of a placement already checked (the planner's own candidates; resolved plans)."""
        return self._tile(table, ps, group_size, local_size)

    def _tile(
        self, table: BaseEmbeddingConfig, ps: ParameterSharding, group_size: int, local_size: int
    ) -> Tiling | None:
        raise NotImplementedError

    def candidates(self, space: CandidateSpace) -> list[ParameterSharding]:
        """Placements of this type the planner compares (best ranks / hosts chosen by ``space``)."""
        raise NotImplementedError

    def label(self, ps: ParameterSharding) -> str:
        """A short description of a placement for reports, e.g. ``table_wise ranks [3]``."""
        return f"{self.sharding_type.value} ranks {ps.ranks}"


class DataParallel(ShardingKind):
    """Full replica on every rank; the touched rows' gradients are summed across ranks."""

    sharding_type = ShardingType.DATA_PARALLEL

    def _tile(
        self, table: BaseEmbeddingConfig, ps: ParameterSharding, group_size: int, local_size: int
    ) -> Tiling | None:
        return None

    def candidates(self, space: CandidateSpace) -> list[ParameterSharding]:
        return [ParameterSharding(self.sharding_type)]

    def label(self, ps: ParameterSharding) -> str:
        return "data_parallel (every rank)"


class TableWise(ShardingKind):
    """The whole table on one rank: ``ranks=[rank]``."""

    sharding_type = ShardingType.TABLE_WISE
    fields = ("ranks",)

    def _tile(
        self, table: BaseEmbeddingConfig, ps: ParameterSharding, group_size: int, local_size: int
    ) -> Tiling | None:
        if not ps.ranks or len(ps.ranks) != 1:
            raise ValueError(f"table {table.name!r}: table_wise needs exactly one rank, e.g. table_wise(rank=0)")
        _check_rank(table.name, ps.ranks[0], group_size, "rank")
        return Tiling.grid([table.num_embeddings], [table.embedding_dim], [ps.ranks])

    def candidates(self, space: CandidateSpace) -> list[ParameterSharding]:
        probe = ParameterSharding(self.sharding_type, ranks=[0])
        return [ParameterSharding(self.sharding_type, ranks=space.best_ranks(1, probe))]


class RowWise(ShardingKind):
    """Rows split over every rank of the group: even blocks, or ``row_sizes`` rows per rank."""

    sharding_type = ShardingType.ROW_WISE
    fields = ("row_sizes",)

    def _tile(
        self, table: BaseEmbeddingConfig, ps: ParameterSharding, group_size: int, local_size: int
    ) -> Tiling | None:
        rows = table.num_embeddings
        sizes: Sequence[int] | np.ndarray | None = ps.row_sizes
        if sizes is None and ps.num_buckets is not None:
            sizes = _bucket_rows(table, ps.num_buckets, group_size)
        elif sizes is None:
            sizes = even_blocks(rows, group_size)
        elif len(sizes) != group_size or any(s < 0 for s in sizes) or sum(sizes) != rows:
            raise ValueError(
                f"table {table.name!r}: row_wise sizes {sizes} must give {group_size} non-negative row counts (one per "
                f"rank) summing to num_embeddings={rows}"
            )
        return Tiling.grid(sizes, [table.embedding_dim], np.arange(group_size))

    def candidates(self, space: CandidateSpace) -> list[ParameterSharding]:
        return [ParameterSharding(self.sharding_type)]

    def label(self, ps: ParameterSharding) -> str:
        return "row_wise (all ranks)"


class ColumnWise(ShardingKind):
    """Columns split into ``len(ranks)`` shards (even widths unless ``col_sizes``), shard i on ``ranks[i]``."""

    sharding_type = ShardingType.COLUMN_WISE
    fields = ("ranks", "col_sizes")
    needs_hosts = True  # not for its tiling: resolution has always checked hosts for every type but row_wise

    def _tile(
        self, table: BaseEmbeddingConfig, ps: ParameterSharding, group_size: int, local_size: int
    ) -> Tiling | None:
        ranks = ps.ranks or []
        for r in ranks:
            _check_rank(table.name, r, group_size, "column shard rank")
        if len(set(ranks)) != len(ranks):
            raise ValueError(
                f"table {table.name!r}: column_wise ranks {ranks} repeat a rank; give each shard its own rank"
            )
        cols = _col_sizes(table, ps, len(ranks))
        return Tiling.grid([table.num_embeddings], cols, ranks)

    def candidates(self, space: CandidateSpace) -> list[ParameterSharding]:
        out = []
        for k in (k for k in space.column_shards if k <= space.group_size):
            probe = ParameterSharding(self.sharding_type, ranks=list(range(k)))
            out.append(ParameterSharding(self.sharding_type, ranks=space.best_ranks(k, probe)))
        return out


class TableColumnWise(ColumnWise):
    """TorchRec's table-column-wise: column shards as ``column_wise``, on ranks that all belong to one host."""

    sharding_type = ShardingType.TABLE_COLUMN_WISE

    def _tile(
        self, table: BaseEmbeddingConfig, ps: ParameterSharding, group_size: int, local_size: int
    ) -> Tiling | None:
        tiling = super()._tile(table, ps, group_size, local_size)
        hosts = sorted({r // local_size for r in ps.ranks or []})
        if len(hosts) > 1:
            raise ValueError(
                f"table {table.name!r}: table_column_wise ranks {ps.ranks} span hosts {hosts} "
                f"(local_size={local_size}); keep them on one host, or use column_wise"
            )
        return tiling

    def candidates(self, space: CandidateSpace) -> list[ParameterSharding]:
        return []  # the same placements as column_wise candidates on one host


class TableRowWise(ShardingKind):
    """Rows split over the ranks of one host: ``host_indexes=[host]``."""

    sharding_type = ShardingType.TABLE_ROW_WISE
    fields = ("host_indexes",)
    needs_hosts = True

    def _tile(
        self, table: BaseEmbeddingConfig, ps: ParameterSharding, group_size: int, local_size: int
    ) -> Tiling | None:
        if not ps.host_indexes or len(ps.host_indexes) != 1:
            raise ValueError(
                f"table {table.name!r}: table_row_wise needs one host index, e.g. table_row_wise(host_index=0)"
            )
        host = ps.host_indexes[0]
        _check_host(table.name, host, group_size, local_size)
        return Tiling.grid(
            even_blocks(table.num_embeddings, local_size),
            [table.embedding_dim],
            host * local_size + np.arange(local_size),
        )

    def candidates(self, space: CandidateSpace) -> list[ParameterSharding]:
        if space.local_size == 1 or space.num_hosts == 1:  # the same as table_wise / row_wise then
            return []
        probe = ParameterSharding(self.sharding_type, host_indexes=[0])
        return [ParameterSharding(self.sharding_type, host_indexes=space.best_hosts(1, probe))]

    def label(self, ps: ParameterSharding) -> str:
        return f"{self.sharding_type.value} hosts {ps.host_indexes}"


class GridShard(ShardingKind):
    """Columns split into ``len(host_indexes)`` shards, each row-split over the ranks of its host."""

    sharding_type = ShardingType.GRID_SHARD
    fields = ("host_indexes", "col_sizes")
    needs_hosts = True

    def _tile(
        self, table: BaseEmbeddingConfig, ps: ParameterSharding, group_size: int, local_size: int
    ) -> Tiling | None:
        hosts = ps.host_indexes or []
        for h in hosts:
            _check_host(table.name, h, group_size, local_size)
        if len(set(hosts)) != len(hosts):
            raise ValueError(
                f"table {table.name!r}: grid_shard host_indexes {hosts} repeat a host; give each column "
                "shard its own host"
            )
        cols = _col_sizes(table, ps, len(hosts))
        rows = even_blocks(table.num_embeddings, local_size)
        return Tiling.grid(rows, cols, np.asarray(hosts)[:, None] * local_size + np.arange(local_size))

    def candidates(self, space: CandidateSpace) -> list[ParameterSharding]:
        if space.local_size == 1 or space.num_hosts == 1:  # the same as column_wise then
            return []
        out = []
        for k in (k for k in space.column_shards if k <= space.num_hosts):
            probe = ParameterSharding(self.sharding_type, host_indexes=list(range(k)))
            out.append(ParameterSharding(self.sharding_type, host_indexes=space.best_hosts(k, probe)))
        return out

    def label(self, ps: ParameterSharding) -> str:
        return f"{self.sharding_type.value} hosts {ps.host_indexes}"


#: every sharding type's kind, in ``ShardingType`` order (the planner's candidate order)
KINDS: dict[ShardingType, ShardingKind] = {
    k.sharding_type: k
    for k in (DataParallel(), TableWise(), RowWise(), ColumnWise(), TableRowWise(), GridShard(), TableColumnWise())
}


def kind_of(sharding_type: ShardingType | str) -> ShardingKind:
    """The kind of a sharding type (or of its string value)."""
    return KINDS[ParameterSharding(sharding_type).sharding_type]  # type: ignore[index]


def placement_of(shards: list[ShardMeta] | None, group_size: int, local_size: int) -> ParameterSharding:
    """A ParameterSharding describing resolved shards (for reports of already-sharded modules)."""
    if shards is None:
        return ParameterSharding(ShardingType.DATA_PARALLEL)
    by_col = sorted({(s.col_offset, s.cols) for s in shards})
    ranks = sorted({s.rank for s in shards})
    sizes = [c for _, c in by_col]
    if len(shards) == 1:
        return ParameterSharding(ShardingType.TABLE_WISE, ranks=[shards[0].rank])
    if len(by_col) == len(shards):
        return ParameterSharding(
            ShardingType.COLUMN_WISE,
            ranks=[s.rank for s in sorted(shards, key=lambda s: s.col_offset)],
            col_sizes=sizes,
        )
    if len(by_col) == 1:
        if len(ranks) == group_size:
            return ParameterSharding(
                ShardingType.ROW_WISE, row_sizes=[s.rows for s in sorted(shards, key=lambda s: s.rank)]
            )
        return ParameterSharding(ShardingType.TABLE_ROW_WISE, host_indexes=[ranks[0] // local_size])
    # grid: the host of each column block, in column order
    host_of_col = {s.col_offset: s.rank // local_size for s in shards}
    return ParameterSharding(ShardingType.GRID_SHARD, host_indexes=[host_of_col[o] for o, _ in by_col], col_sizes=sizes)
