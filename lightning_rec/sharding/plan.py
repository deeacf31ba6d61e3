"""Sharding plans: what each table's placement is, the helpers that build one, and their validation.

A plan is checked against the tables and the group size before any memory is allocated. Ranks in a
plan are ranks of the model-parallel group (DESIGN.md rule 4).
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn

from lightning_rec.configs import BaseEmbeddingConfig, ShardingType
from lightning_rec.sharding.layout import ShardMeta, block_shards, even_split, host_ranks


@dataclass
class ParameterSharding:
    """How one table is placed.

    Args:
        sharding_type: a ``ShardingType`` (or its string value).
        ranks: TABLE_WISE: ``[rank]``; COLUMN_WISE: one rank per column shard. Filled in for other types
            when the plan is resolved.
        row_sizes: ROW_WISE only: rows per rank of the group (uneven placement); default even blocks.
        col_sizes: COLUMN_WISE / GRID_SHARD: width of each column shard; default even widths.
        host_indexes: TABLE_ROW_WISE: ``[host]``; GRID_SHARD: one host per column shard.
        compute_kernel: lookup kernel for the local shards (``"auto"``, ``"torch"`` or ``"fbgemm"``).
    """

    sharding_type: ShardingType | str
    ranks: list[int] | None = None
    row_sizes: list[int] | None = None
    col_sizes: list[int] | None = None
    host_indexes: list[int] | None = None
    compute_kernel: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.sharding_type, ShardingType):
            try:
                self.sharding_type = ShardingType(str(self.sharding_type).lower())
            except ValueError:
                raise ValueError(
                    f"unknown sharding type {self.sharding_type!r}; choose one of {[s.value for s in ShardingType]}"
                ) from None


def _as_ints(table: str, field_name: str, values: object) -> list[int] | None:
    # numpy and other integral types are fine; bools, floats and strings are mistakes
    if values is None:
        return None
    out = []
    for v in values:  # type: ignore[union-attr]
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise ValueError(f"table {table!r}: {field_name} must hold integers, got {v!r} in {list(values)}")
        out.append(int(v))
    return out


_FIELDS = {
    ShardingType.DATA_PARALLEL: (),
    ShardingType.TABLE_WISE: ("ranks",),
    ShardingType.ROW_WISE: ("row_sizes",),
    ShardingType.COLUMN_WISE: ("ranks", "col_sizes"),
    ShardingType.TABLE_ROW_WISE: ("host_indexes",),
    ShardingType.GRID_SHARD: ("host_indexes", "col_sizes"),
}


# -- helpers (TorchRec names) -------------------------------------------------------------------------
def data_parallel() -> ParameterSharding:
    """Full replica on every rank; gradients of the touched rows are summed across ranks."""
    return ParameterSharding(ShardingType.DATA_PARALLEL)


def table_wise(rank: int) -> ParameterSharding:
    """The whole table on one rank of the model-parallel group."""
    return ParameterSharding(ShardingType.TABLE_WISE, ranks=[rank])


def row_wise(sizes_placement: list[int] | tuple[list[int], str] | None = None) -> ParameterSharding:
    """Rows split over every rank of the group, in even blocks unless ``sizes_placement`` gives rows per rank."""
    if isinstance(sizes_placement, tuple):
        sizes_placement = sizes_placement[0]
    return ParameterSharding(ShardingType.ROW_WISE, row_sizes=None if sizes_placement is None else list(sizes_placement))


def column_wise(ranks: list[int], size_per_rank: list[int] | None = None) -> ParameterSharding:
    """Columns split into ``len(ranks)`` shards (even widths unless ``size_per_rank``), shard i on ``ranks[i]``."""
    return ParameterSharding(
        ShardingType.COLUMN_WISE, ranks=list(ranks), col_sizes=None if size_per_rank is None else list(size_per_rank)
    )


def table_row_wise(host_index: int) -> ParameterSharding:
    """Rows split over the ranks of one host (``local_size`` consecutive ranks)."""
    return ParameterSharding(ShardingType.TABLE_ROW_WISE, host_indexes=[host_index])


def grid_shard(host_indexes: list[int], size_per_shard: list[int] | None = None) -> ParameterSharding:
    """Columns split into ``len(host_indexes)`` shards, each row-split over the ranks of its host."""
    return ParameterSharding(
        ShardingType.GRID_SHARD,
        host_indexes=list(host_indexes),
        col_sizes=None if size_per_shard is None else list(size_per_shard),
    )


EmbeddingModuleShardingPlan = dict  # table name -> ParameterSharding


@dataclass
class ShardingPlan:
    """``{module_path: {table_name: ParameterSharding}}``; the path of a model that is itself a collection is ``""``."""

    plan: dict[str, dict[str, ParameterSharding]] = field(default_factory=dict)

    def get_plan_for_module(self, module_path: str) -> dict[str, ParameterSharding] | None:
        return self.plan.get(module_path)

    def __str__(self) -> str:
        lines = []
        for path, tables in self.plan.items():
            lines.append(f"module {path or '<root>'!r}:")
            for t, ps in tables.items():
                extra = {k: v for k, v in (("ranks", ps.ranks), ("row_sizes", ps.row_sizes),
                                           ("col_sizes", ps.col_sizes), ("host_indexes", ps.host_indexes)) if v is not None}
                lines.append(f"  {t!r}: {ps.sharding_type.value} {extra if extra else ''}".rstrip())
        return "\n".join(lines)


# -- resolution and validation ----------------------------------------------------------------------
def default_local_size(group_size: int) -> int:
    """Ranks per host: LOCAL_WORLD_SIZE when it divides the group, else the whole group."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", group_size))
    except ValueError:
        local = group_size
    return local if local > 0 and group_size % local == 0 else group_size


def _check_rank(table: str, rank: object, group_size: int, what: str) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < group_size:
        raise ValueError(
            f"table {table!r}: {what} {rank!r} is outside the model-parallel group (valid ranks: 0..{group_size - 1})"
        )


def _check_host(table: str, host: object, group_size: int, local_size: int) -> None:
    num_hosts = group_size // local_size
    if isinstance(host, bool) or not isinstance(host, int) or not 0 <= host < num_hosts:
        raise ValueError(
            f"table {table!r}: host index {host!r} has no ranks; with {group_size} ranks and local_size={local_size} "
            f"the valid host indexes are 0..{num_hosts - 1}"
        )


def _col_sizes(table: BaseEmbeddingConfig, ps: ParameterSharding, n: int) -> list[int]:
    dim = table.embedding_dim
    if n == 0:
        raise ValueError(f"table {table.name!r}: {ps.sharding_type.value} needs at least one column shard")
    if ps.col_sizes is not None:
        sizes = ps.col_sizes
        if len(sizes) != n or any(not isinstance(s, int) or s <= 0 for s in sizes) or sum(sizes) != dim:
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


def resolve_table(
    table: BaseEmbeddingConfig, ps: ParameterSharding, group_size: int, local_size: int
) -> list[ShardMeta] | None:
    """Validate one table's placement and return its shards (None for a data-parallel replica)."""
    if not isinstance(ps, ParameterSharding):
        raise TypeError(f"table {table.name!r}: expected a ParameterSharding, got {type(ps).__name__}")
    st, name, rows, dim = ps.sharding_type, table.name, table.num_embeddings, table.embedding_dim
    if st not in _FIELDS:
        raise ValueError(f"table {name!r}: unsupported sharding type {st!r}")
    for field_name in ("ranks", "row_sizes", "col_sizes", "host_indexes"):
        if getattr(ps, field_name) is not None and field_name not in _FIELDS[st]:
            raise ValueError(
                f"table {name!r}: {field_name} does not apply to {st.value} (it takes {list(_FIELDS[st]) or 'no options'})"
            )
    ps = ParameterSharding(
        st, ranks=_as_ints(name, "ranks", ps.ranks), row_sizes=_as_ints(name, "row_sizes", ps.row_sizes),
        col_sizes=_as_ints(name, "col_sizes", ps.col_sizes), host_indexes=_as_ints(name, "host_indexes", ps.host_indexes),
        compute_kernel=ps.compute_kernel,
    )
    if st == ShardingType.DATA_PARALLEL:
        return None
    if st == ShardingType.TABLE_WISE:
        if not ps.ranks or len(ps.ranks) != 1:
            raise ValueError(f"table {name!r}: table_wise needs exactly one rank, e.g. table_wise(rank=0)")
        _check_rank(name, ps.ranks[0], group_size, "rank")
        return [ShardMeta(0, rows, 0, dim, ps.ranks[0])]
    if st == ShardingType.ROW_WISE:
        sizes = ps.row_sizes
        if sizes is None:
            sizes = even_split(rows, group_size)
        elif len(sizes) != group_size or any(not isinstance(s, int) or s < 0 for s in sizes) or sum(sizes) != rows:
            raise ValueError(
                f"table {name!r}: row_wise sizes {sizes} must give {group_size} non-negative row counts (one per rank) "
                f"summing to num_embeddings={rows}"
            )
        return block_shards(rows, dim, [list(sizes)], [dim], [list(range(group_size))])
    if group_size % local_size:
        raise ValueError(
            f"table {name!r}: local_size={local_size} does not divide the group size {group_size}, so hosts are undefined"
        )
    if st == ShardingType.COLUMN_WISE:
        ranks = ps.ranks or []
        for r in ranks:
            _check_rank(name, r, group_size, "column shard rank")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"table {name!r}: column_wise ranks {ranks} repeat a rank; give each shard its own rank")
        cols = _col_sizes(table, ps, len(ranks))
        return block_shards(rows, dim, [[rows]] * len(ranks), cols, [[r] for r in ranks])
    if st == ShardingType.TABLE_ROW_WISE:
        if not ps.host_indexes or len(ps.host_indexes) != 1:
            raise ValueError(f"table {name!r}: table_row_wise needs one host index, e.g. table_row_wise(host_index=0)")
        _check_host(name, ps.host_indexes[0], group_size, local_size)
        ranks = host_ranks(ps.host_indexes[0], local_size)
        return block_shards(rows, dim, [even_split(rows, local_size)], [dim], [ranks])
    if st == ShardingType.GRID_SHARD:
        hosts = ps.host_indexes or []
        for h in hosts:
            _check_host(name, h, group_size, local_size)
        if len(set(hosts)) != len(hosts):
            raise ValueError(f"table {name!r}: grid_shard host_indexes {hosts} repeat a host; give each column shard its own host")
        cols = _col_sizes(table, ps, len(hosts))
        return block_shards(
            rows, dim, [even_split(rows, local_size)] * len(hosts), cols, [host_ranks(h, local_size) for h in hosts]
        )
    raise ValueError(f"table {name!r}: unsupported sharding type {st}")


def resolve_module_plan(
    tables: list[BaseEmbeddingConfig],
    module_plan: Mapping[str, ParameterSharding],
    group_size: int,
    local_size: int,
    module_path: str = "",
) -> dict[str, list[ShardMeta] | None]:
    """Validate a module's plan against its tables; return ``{table: shards or None (data-parallel)}``."""
    where = f"module {module_path!r}" if module_path else "the collection"
    names = [t.name for t in tables]
    unknown = [k for k in module_plan if k not in set(names)]
    if unknown:
        raise ValueError(f"the plan for {where} names unknown tables {unknown}; its tables are {names}")
    missing = [n for n in names if n not in module_plan]
    if missing:
        raise ValueError(
            f"tables {missing} of {where} have no entry in the plan; every table needs one, "
            f"e.g. {{{missing[0]!r}: table_wise(rank=0)}}"
        )
    if group_size <= 0 or local_size <= 0 or group_size % local_size:
        raise ValueError(
            f"local_size={local_size} must be positive and divide the model-parallel group size {group_size}"
        )
    return {t.name: resolve_table(t, module_plan[t.name], group_size, local_size) for t in tables}


def embedding_tables(module: nn.Module) -> list[BaseEmbeddingConfig]:
    """The table configs of an (unsharded or sharded) collection."""
    if hasattr(module, "embedding_bag_configs"):
        return module.embedding_bag_configs()
    if hasattr(module, "embedding_configs"):
        return module.embedding_configs()
    raise TypeError(f"{type(module).__name__} is not an EmbeddingBagCollection or EmbeddingCollection")


def construct_module_sharding_plan(
    module: nn.Module,
    per_param_sharding: Mapping[str, ParameterSharding],
    local_size: int | None = None,
    world_size: int | None = None,
) -> dict[str, ParameterSharding]:
    """Check ``{table: placement}`` against ``module``'s tables and return it as a module plan.

    ``world_size`` is the model-parallel group size (default: the initialised world, else 1) and
    ``local_size`` the ranks per host (default: LOCAL_WORLD_SIZE, else the whole group).
    """
    import torch.distributed as dist

    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if local_size is None:
        local_size = default_local_size(world_size)
    resolve_module_plan(embedding_tables(module), per_param_sharding, world_size, local_size)
    return dict(per_param_sharding)
