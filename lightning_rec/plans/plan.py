"""Sharding plans: what each table's placement is, the helpers that build one, and their validation.

A plan is checked against the tables and the group size before any memory is allocated. Ranks in a
plan are ranks of the model-parallel group (ARCHITECTURE.md#c4-plans-speak-in-ranks-of-the-model-parallel-group).
What each sharding type accepts and how it tiles a table lives in ``types.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from lightning_rec.configs import BaseEmbeddingConfig, ShardingType
from lightning_rec.plans.kinds import (
    KINDS,
    PLACEMENT_FIELDS,
    EnumerableShardingSpec,
    ParameterSharding,
    ShardMetadata,
)
from lightning_rec.plans.mesh import default_local_size
from lightning_rec.plans.shard_geometry import ShardMeta, even_split, offsets_of


# -- helpers (TorchRec names and argument orders) ------------------------------------------------------
def _check_device(device: str | None, what: str = "device") -> None:
    # a shard lives where its collection does; the helpers take TorchRec's device names and check them
    if device is None:
        return
    try:
        torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{what} {device!r} is not a torch device type such as 'cpu' or 'cuda'") from None


# the helpers pass compute_kernel=None through: ParameterSharding.__post_init__ reads it as "auto"
def data_parallel(compute_kernel: str | None = None) -> ParameterSharding:
    """Full replica on every rank; gradients of the touched rows are summed across ranks."""
    return ParameterSharding(ShardingType.DATA_PARALLEL, compute_kernel=cast(str, compute_kernel))


def table_wise(rank: int, device: str | None = None, compute_kernel: str | None = None) -> ParameterSharding:
    """The whole table on one rank of the model-parallel group (``device``: checked, the shard lives where the
    collection does)."""
    _check_device(device)
    return ParameterSharding(ShardingType.TABLE_WISE, ranks=[rank], compute_kernel=cast(str, compute_kernel))


def row_wise(
    sizes_placement: list[int] | tuple[list[int], str | list[str]] | None = None,
    compute_kernel: str | None = None,
    num_buckets: int | None = None,
) -> ParameterSharding:
    """Rows split over every rank of the group, in even blocks unless ``sizes_placement`` gives rows per rank
    (TorchRec's ``(sizes, device)`` tuple is accepted), or in ``num_buckets`` equal buckets (TorchRec's
    bucketized row-wise)."""
    if isinstance(sizes_placement, tuple):
        sizes_placement, devices = sizes_placement
        for d in [devices] if isinstance(devices, str) else devices:
            _check_device(d, "sizes_placement device")
    if sizes_placement is not None and num_buckets is not None:
        raise ValueError("row_wise: give sizes_placement or num_buckets, not both")
    sizes = None if sizes_placement is None else list(sizes_placement)
    return ParameterSharding(
        ShardingType.ROW_WISE, row_sizes=sizes, compute_kernel=cast(str, compute_kernel), num_buckets=num_buckets
    )


def column_wise(
    ranks: list[int] | None = None,
    size_per_rank: list[int] | None = None,
    compute_kernel: str | None = None,
    device_types: list[str] | None = None,
) -> ParameterSharding:
    """Columns split into shards (even widths unless ``size_per_rank``), shard i on ``ranks[i]``.

    Without ``ranks``, ``size_per_rank`` puts shard i on rank i (as TorchRec does). ``device_types`` (one per
    shard) are checked; every shard lives where the collection does, so they must all be one type.
    """
    if ranks is None:
        if size_per_rank is None:
            raise ValueError("column_wise needs ranks, or size_per_rank (shard i then goes to rank i)")
        ranks = list(range(len(size_per_rank)))
    if device_types is not None:
        if len(device_types) != len(ranks):
            raise ValueError(f"column_wise: {len(device_types)} device_types for {len(ranks)} column shards")
        for d in device_types:
            _check_device(d, "device type")
        if len(set(device_types)) > 1:
            raise ValueError(
                f"column_wise: device_types {list(device_types)} mix devices; the shards of a "
                "collection all live on its device"
            )
    return ParameterSharding(
        ShardingType.COLUMN_WISE,
        ranks=list(ranks),
        col_sizes=None if size_per_rank is None else list(size_per_rank),
        compute_kernel=cast(str, compute_kernel),
    )


def table_row_wise(host_index: int, compute_kernel: str | None = None) -> ParameterSharding:
    """Rows split over the ranks of one host (``local_size`` consecutive ranks)."""
    return ParameterSharding(
        ShardingType.TABLE_ROW_WISE, host_indexes=[host_index], compute_kernel=cast(str, compute_kernel)
    )


def table_column_wise(
    ranks: list[int], size_per_rank: list[int] | None = None, compute_kernel: str | None = None
) -> ParameterSharding:
    """TorchRec's table-column-wise: column shards as :func:`column_wise`, on ranks of one host."""
    return ParameterSharding(
        ShardingType.TABLE_COLUMN_WISE,
        ranks=list(ranks),
        col_sizes=None if size_per_rank is None else list(size_per_rank),
        compute_kernel=cast(str, compute_kernel),
    )


def grid_shard(
    host_indexes: list[int], size_per_shard: list[int] | None = None, compute_kernel: str | None = None
) -> ParameterSharding:
    """Columns split into ``len(host_indexes)`` shards, each row-split over the ranks of its host."""
    return ParameterSharding(
        ShardingType.GRID_SHARD,
        host_indexes=list(host_indexes),
        col_sizes=None if size_per_shard is None else list(size_per_shard),
        compute_kernel=cast(str, compute_kernel),
    )


def _tabulate(rows: list[list[object]], headers: list[str]) -> str:
    # TorchRec's plain-text table: centred headers, left-aligned cells, " | " between columns
    widths = [max([len(h), *(len(str(r[i])) for r in rows)]) for i, h in enumerate(headers)]
    lines = [" | ".join(h.center(w) for h, w in zip(headers, widths)), " | ".join("-" * w for w in widths)]
    lines += [" | ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


class EmbeddingModuleShardingPlan(dict):
    """``{table name: ParameterSharding}`` of one collection; prints as TorchRec's tables (placements, then
    shards), followed by the placement fields of entries not resolved yet (no ``sharding_spec``)."""

    def __str__(self) -> str:
        params, shards, fields = [], [], []
        for name, ps in self.items():
            kind = getattr(ps.sharding_type, "value", ps.sharding_type)
            params.append([name, kind, ps.compute_kernel, ps.ranks])
            spec = ps.sharding_spec
            shards += [[name, m.shard_offsets, m.shard_sizes, m.placement] for m in (spec.shards if spec else [])]
            extra = {k: getattr(ps, k) for k in (*PLACEMENT_FIELDS, "num_buckets") if getattr(ps, k) is not None}
            if spec is None and set(extra) - {"ranks"}:
                fields.append([name, ", ".join(f"{k}={v}" for k, v in extra.items())])
        out = "\n\n" + _tabulate(params, ["param", "sharding type", "compute kernel", "ranks"])
        out += "\n\n" + _tabulate(shards, ["param", "shard offsets", "shard sizes", "placement"])
        if fields:
            out += "\n\n" + _tabulate(fields, ["param", "placement fields"])
        return out


@dataclass
class ShardingPlan:
    """``{module_path: {table_name: ParameterSharding}}``; the path of a model that is itself a collection is ``""``."""

    plan: dict[str, dict[str, ParameterSharding]] = field(default_factory=dict)

    def get_plan_for_module(self, module_path: str) -> dict[str, ParameterSharding] | None:
        return self.plan.get(module_path)

    def __str__(self) -> str:
        # TorchRec's format: "module: <path>" then the module plan's tables, modules separated by a blank line
        return "\n\n".join(f"module: {path}{EmbeddingModuleShardingPlan(tables)}" for path, tables in self.plan.items())


# -- TorchRec's shard descriptions ----------------------------------------------------------------------
def shard_placement(rank: int, device_type: str, local_size: int) -> str:
    """TorchRec's placement string of a shard: ``"rank:5/cuda:1"`` (device index ``rank % local_size``) for an
    accelerator, ``"rank:5/cpu"`` for the CPU."""
    if device_type in ("cuda", "mtia"):
        return f"rank:{rank}/{torch.device(device_type, rank % local_size)}"
    return f"rank:{rank}/{device_type}"


def sharding_spec_of(
    shards: list[ShardMeta] | None, device_type: str, local_size: int
) -> EnumerableShardingSpec | None:
    """TorchRec's ``sharding_spec`` of resolved shards (None for a data-parallel table), in the shards' order."""
    if shards is None:
        return None
    return EnumerableShardingSpec(
        [
            ShardMetadata(
                shard_offsets=[s.row_offset, s.col_offset],
                shard_sizes=[s.rows, s.cols],
                placement=shard_placement(s.rank, device_type, local_size),
            )
            for s in shards
        ]
    )


def _rw_sizes_offsets(row_sizes: list[int], columns: int) -> tuple[list[list[int]], list[list[int]]]:
    return [[r, columns] for r in row_sizes], [[o, 0] for o in offsets_of(row_sizes)[:-1]]


def _calculate_rw_shard_sizes_and_offsets(
    hash_size: int, num_devices: int, columns: int, num_buckets: int | None = None
) -> tuple[list[list[int]], list[list[int]]]:
    """TorchRec's row-wise shard ``[rows, columns]`` sizes and ``[row, 0]`` offsets per rank: ``ceil(hash_size /
    num_devices)`` rows each, the tail short or empty; with ``num_buckets``, equal buckets, the first
    ``num_buckets % num_devices`` ranks one more (the tiling ``row_wise()`` / ``row_wise(num_buckets=)`` give)."""
    if num_buckets:
        assert hash_size % num_buckets == 0, "hash_size must be divisible by num_buckets"
        size, per_rank, extra = hash_size // num_buckets, num_buckets // num_devices, num_buckets % num_devices
        rows = [size * (per_rank + (r < extra)) for r in range(num_devices)]
    else:
        rows = even_split(hash_size, num_devices)
    return _rw_sizes_offsets(rows, columns)


def _calculate_uneven_rw_shard_sizes_and_offsets(
    hash_size: int, num_devices: int, columns: int, device_memory_sizes: list[int], num_buckets: int | None = None
) -> tuple[list[list[int]], list[list[int]]]:
    """TorchRec's row-wise split in proportion to ``device_memory_sizes`` (whole buckets of ``hash_size //
    num_buckets`` rows, rounded down; the last rank takes the rest)."""
    assert num_devices == len(device_memory_sizes), "must provide all the memory size"
    if num_buckets is None:
        num_buckets, bucket = hash_size, 1
    else:
        assert hash_size % num_buckets == 0, "hash_size must be divisible by num_buckets"
        bucket = hash_size // num_buckets
    total = sum(device_memory_sizes)
    rows = [int(num_buckets * (m / total)) * bucket for m in device_memory_sizes[:-1]]
    return _rw_sizes_offsets([*rows, hash_size - sum(rows)], columns)


# -- resolution and validation ----------------------------------------------------------------------
def resolve_table(
    table: BaseEmbeddingConfig, ps: ParameterSharding, group_size: int, local_size: int
) -> list[ShardMeta] | None:
    """Validate one table's placement and return its shards (None for a data-parallel replica)."""
    if not isinstance(ps, ParameterSharding):
        raise TypeError(f"table {table.name!r}: expected a ParameterSharding, got {type(ps).__name__}")
    kind = KINDS.get(ps.sharding_type) if isinstance(ps.sharding_type, ShardingType) else None
    if kind is None:  # a sharding_type overwritten after construction
        raise ValueError(f"table {table.name!r}: unsupported sharding type {ps.sharding_type!r}")
    tiling = kind.tiling(table, ps, group_size, local_size)
    shards = None if tiling is None else tiling.shards()
    if ps.sharding_spec is not None:
        _check_spec(table, ps.sharding_spec, shards)
    return shards


def _check_spec(table: BaseEmbeddingConfig, spec: EnumerableShardingSpec, shards: list[ShardMeta] | None) -> None:
    # a TorchRec plan carries the shards it means; ours are computed from the fields, so they must agree
    given = [(list(m.shard_offsets), list(m.shard_sizes)) for m in spec.shards]
    derived = [([s.row_offset, s.col_offset], [s.rows, s.cols]) for s in shards or []]
    if given != derived:
        raise ValueError(
            f"table {table.name!r}: sharding_spec gives shards (offsets, sizes) {given}, but the placement's "
            f"fields resolve to {derived}; give row_sizes / col_sizes that produce the spec's shards, or drop the spec"
        )


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


class _BagTables(Protocol):
    def embedding_bag_configs(self) -> list[BaseEmbeddingConfig]: ...


class _SequenceTables(Protocol):
    def embedding_configs(self) -> list[BaseEmbeddingConfig]: ...


def embedding_tables(module: nn.Module) -> list[BaseEmbeddingConfig]:
    """The table configs of an (unsharded or sharded) collection."""
    if hasattr(module, "embedding_bag_configs"):
        return cast(_BagTables, module).embedding_bag_configs()
    if hasattr(module, "embedding_configs"):
        return cast(_SequenceTables, module).embedding_configs()
    raise TypeError(f"{type(module).__name__} is not an EmbeddingBagCollection or EmbeddingCollection")


def with_resolved_ranks(
    table: BaseEmbeddingConfig, ps: ParameterSharding, group_size: int, local_size: int, device_type: str = "cpu"
) -> ParameterSharding:
    """A copy of ``ps`` (checked) with ``ranks`` filled in, in TorchRec's order (see ``types.resolved_ranks``),
    and TorchRec's ``sharding_spec`` of its shards on ``device_type``."""
    shards = resolve_table(table, ps, group_size, local_size)
    ranks = list(range(group_size)) if shards is None else [s.rank for s in shards]
    return replace(ps, ranks=ranks, sharding_spec=sharding_spec_of(shards, device_type, local_size))


def construct_module_sharding_plan(
    module: nn.Module,
    per_param_sharding: Mapping[str, ParameterSharding | Callable[..., ParameterSharding]],
    sharder: object | None = None,
    local_size: int | None = None,
    world_size: int | None = None,
    device_type: str | None = None,
) -> EmbeddingModuleShardingPlan:
    """Check ``{table: placement}`` against ``module``'s tables; return the module plan with ranks filled in.

    TorchRec's argument order. ``world_size`` is the model-parallel group size (default: the initialised
    world, else 1) and ``local_size`` the ranks per host (default: LOCAL_WORLD_SIZE, else the whole group).
    A placement may also be TorchRec-style generator ``(param, local_size, world_size, device_type, sharder)
    -> ParameterSharding``. ``sharder`` (optional) must be a sharder of ``module``'s type. ``device_type``
    (default ``"cuda"`` where CUDA is available, else ``"cpu"``) names the device in each shard's
    ``sharding_spec`` placement. A placement's ``compute_kernel="auto"`` becomes TorchRec's default name:
    ``"fused"`` for a sharded table whose weight has an optimizer applied in backward, else ``"dense"`` (both
    run the collection's own kernel choice here).
    """
    if isinstance(sharder, int) and not isinstance(sharder, bool):
        raise TypeError(
            "construct_module_sharding_plan(module, per_param_sharding, sharder, local_size, "
            "world_size, device_type): the third argument is the sharder (TorchRec's order); pass "
            "local_size= by keyword"
        )
    module_type = getattr(sharder, "module_type", None)
    if sharder is not None and (module_type is None or not isinstance(module, module_type)):
        raise ValueError(f"sharder {type(sharder).__name__} does not shard a {type(module).__name__}")
    _check_device(device_type, "device_type")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if local_size is None:
        local_size = default_local_size(world_size)
    tables = embedding_tables(module)
    by_name = {t.name: t for t in tables}
    container = getattr(module, "embedding_bags", None) or getattr(module, "embeddings", None)
    modules = dict(container.named_children()) if container is not None else {}
    plan = {}
    for name, ps in per_param_sharding.items():
        if callable(ps) and not isinstance(ps, ParameterSharding):  # TorchRec's generator form
            weight = getattr(modules.get(name), "weight", None)
            ps = ps(weight, local_size, world_size, device_type, sharder)
        if isinstance(ps, ParameterSharding) and ps.compute_kernel == "auto":
            fused = ps.sharding_type != ShardingType.DATA_PARALLEL and hasattr(
                getattr(modules.get(name), "weight", None), "_in_backward_optimizers"
            )
            ps = replace(ps, compute_kernel="fused" if fused else "dense")
        plan[name] = ps
    resolve_module_plan(tables, plan, world_size, local_size)
    return EmbeddingModuleShardingPlan(
        {n: with_resolved_ranks(by_name[n], ps, world_size, local_size, device_type) for n, ps in plan.items()}
    )
