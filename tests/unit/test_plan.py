"""Sharding plans: validation messages and the shard tiling of every placement type.

Nothing here starts processes: ``resolve_module_plan`` and ``construct_module_sharding_plan`` validate a
plan from the tables, the group size and the local size alone.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_rec.configs import ShardingType
from lightning_rec.plans.kinds import KINDS, PLACEMENT_FIELDS, kind_of, placement_of
from lightning_rec.plans.plan import resolve_module_plan, resolve_table
from lightning_rec.plans.shard_geometry import ShardMeta, even_split
from lightning_rec.sharding import (
    ParameterSharding,
    ShardingPlan,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    grid_shard,
    row_wise,
    table_row_wise,
    table_wise,
)

DIMS = (1, 2, 3, 4, 6, 8, 12)
ALL_TYPES = tuple(s.value for s in ShardingType)


def _tables(*shapes: tuple[int, int], dtype: torch.dtype = torch.float32) -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(r, d, f"t{i}", [f"f{i}"], dtype=dtype) for i, (r, d) in enumerate(shapes)]


def _chunk_sizes(rows: int, parts: int) -> list[int]:
    """Rows per part as ``torch.chunk`` gives them, padded with empty parts to ``parts``."""
    sizes = [c.numel() for c in torch.arange(rows).chunk(parts)]
    return sizes + [0] * (parts - len(sizes))


# -- invalid plans --------------------------------------------------------------------------------------
# (shapes, plan for t0 (t1 is table_wise(0) when present), world, local, substrings the message must hold)
INVALID = {
    "table_wise rank negative": ([(10, 8)], table_wise(-1), 4, 4, ["'t0'", "-1", "outside", "0..3"]),
    "table_wise rank == world": ([(10, 8)], table_wise(4), 4, 4, ["'t0'", "4", "outside", "0..3"]),
    "table_wise rank not int": ([(10, 8)], table_wise("0"), 4, 4, ["'t0'", "must hold integers"]),  # type: ignore[arg-type]
    "table_wise rank bool": ([(10, 8)], table_wise(True), 4, 4, ["'t0'", "must hold integers"]),  # type: ignore[arg-type]
    "table_wise no rank": ([(10, 8)], ParameterSharding("table_wise"), 4, 4, ["'t0'", "exactly one rank"]),
    "table_wise two ranks": (
        [(10, 8)],
        ParameterSharding("table_wise", ranks=[0, 1]),
        4,
        4,
        ["'t0'", "exactly one rank"],
    ),
    "column_wise rank == world": ([(10, 8)], column_wise([0, 4]), 4, 4, ["'t0'", "column shard rank 4", "0..3"]),
    "column_wise rank negative": ([(10, 8)], column_wise([-1, 0]), 4, 4, ["'t0'", "column shard rank -1", "0..3"]),
    "column_wise repeated rank": ([(10, 8)], column_wise([1, 1]), 4, 4, ["'t0'", "[1, 1]", "repeat"]),
    "column_wise no ranks": ([(10, 8)], column_wise([]), 4, 4, ["'t0'", "at least one column shard"]),
    "column_wise not dividing": (
        [(10, 8)],
        column_wise([0, 1, 2]),
        4,
        4,
        ["'t0'", "3 column shards", "embedding_dim=8"],
    ),
    "column_wise more shards than dim": (
        [(10, 2)],
        column_wise([0, 1, 2, 3]),
        4,
        4,
        ["'t0'", "4 column shards", "embedding_dim=2"],
    ),
    "column sizes wrong count": (
        [(10, 8)],
        column_wise([0, 1], [8]),
        4,
        4,
        ["'t0'", "column sizes [8]", "2 positive widths", "embedding_dim=8"],
    ),
    "column sizes wrong sum": (
        [(10, 8)],
        column_wise([0, 1], [4, 3]),
        4,
        4,
        ["'t0'", "column sizes [4, 3]", "embedding_dim=8"],
    ),
    "column sizes zero width": ([(10, 8)], column_wise([0, 1], [8, 0]), 4, 4, ["'t0'", "positive widths"]),
    "column sizes negative": ([(10, 8)], column_wise([0, 1], [10, -2]), 4, 4, ["'t0'", "positive widths"]),
    "column sizes bool": ([(10, 8)], column_wise([0, 1], [True, 7]), 4, 4, ["'t0'", "must hold integers"]),
    "row_wise given ranks": (
        [(10, 8)],
        ParameterSharding("row_wise", ranks=[0]),
        4,
        4,
        ["'t0'", "ranks does not apply"],
    ),
    "local_size zero": ([(10, 8)], row_wise(), 4, 0, ["local_size=0", "must be positive"]),
    "column sizes not int": (
        [(10, 8)],
        column_wise([0, 1], [4.0, 4.0]),
        4,
        4,  # type: ignore[list-item]
        ["'t0'", "must hold integers"],
    ),
    "row_wise sizes too short": (
        [(10, 8)],
        row_wise([5, 5]),
        4,
        4,
        ["'t0'", "[5, 5]", "4 non-negative row counts", "num_embeddings=10"],
    ),
    "row_wise sizes too long": ([(10, 8)], row_wise([5, 5, 0, 0, 0]), 4, 4, ["'t0'", "4 non-negative row counts"]),
    "row_wise sizes wrong sum": ([(10, 8)], row_wise([3, 3, 3, 3]), 4, 4, ["'t0'", "num_embeddings=10"]),
    "row_wise sizes negative": ([(10, 8)], row_wise([12, -2, 0, 0]), 4, 4, ["'t0'", "non-negative"]),
    "row_wise sizes not int": (
        [(10, 8)],
        row_wise([2.5, 2.5, 5, 0]),
        4,
        4,  # type: ignore[list-item]
        ["'t0'", "must hold integers"],
    ),
    "table_row_wise host == hosts": (
        [(10, 8)],
        table_row_wise(2),
        4,
        2,
        ["'t0'", "host index 2", "no ranks", "local_size=2", "0..1"],
    ),
    "table_row_wise host negative": ([(10, 8)], table_row_wise(-1), 4, 2, ["'t0'", "host index -1", "0..1"]),
    "table_row_wise no host": ([(10, 8)], ParameterSharding("table_row_wise"), 4, 2, ["'t0'", "one host index"]),
    "grid_shard host out of range": ([(10, 8)], grid_shard([0, 2]), 4, 2, ["'t0'", "host index 2", "0..1"]),
    "grid_shard host negative": ([(10, 8)], grid_shard([-1]), 4, 2, ["'t0'", "host index -1"]),
    "grid_shard repeated host": ([(10, 8)], grid_shard([1, 1]), 8, 2, ["'t0'", "[1, 1]", "repeat"]),
    "grid_shard not dividing": ([(10, 3)], grid_shard([0, 1]), 4, 2, ["'t0'", "2 column shards", "embedding_dim=3"]),
    "grid_shard no hosts": ([(10, 8)], grid_shard([]), 4, 2, ["'t0'", "at least one column shard"]),
    "grid_shard bad sizes": ([(10, 8)], grid_shard([0, 1], [2, 2]), 4, 2, ["'t0'", "column sizes [2, 2]"]),
    "local_size not dividing": ([(10, 8)], table_wise(0), 4, 3, ["local_size=3", "divide", "4"]),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_plan_message(case: str) -> None:
    shapes, ps, world, local, expected = INVALID[case]
    tables = _tables(*shapes)
    with pytest.raises(ValueError) as info:
        resolve_module_plan(tables, {"t0": ps}, world, local)
    for s in expected:
        assert s in str(info.value), f"{s!r} not in {str(info.value)!r}"
    # the module-level entry point reports the same error
    ebc = EmbeddingBagCollection(tables)
    with pytest.raises(ValueError) as info2:
        construct_module_sharding_plan(ebc, {"t0": ps}, local_size=local, world_size=world)
    assert str(info2.value) == str(info.value)


def test_unknown_table_in_plan() -> None:
    tables = _tables((10, 8), (10, 8))
    with pytest.raises(ValueError, match=r"unknown tables \['nope'\].*\['t0', 't1'\]"):
        resolve_module_plan(tables, {"t0": table_wise(0), "t1": table_wise(0), "nope": table_wise(0)}, 2, 2)


def test_table_missing_from_plan() -> None:
    tables = _tables((10, 8), (10, 8), (10, 8))
    with pytest.raises(ValueError, match=r"tables \['t1', 't2'\].*no entry in the plan.*'t1': table_wise") as info:
        construct_module_sharding_plan(EmbeddingBagCollection(tables), {"t0": table_wise(0)}, world_size=2)
    assert "the collection" in str(info.value)
    with pytest.raises(ValueError, match=r"module 'sparse.ebc'"):
        resolve_module_plan(tables, {"t0": table_wise(0)}, 2, 2, module_path="sparse.ebc")


def test_unknown_sharding_type_string() -> None:
    with pytest.raises(ValueError, match=r"unknown sharding type 'diagonal'.*table_wise") as info:
        ParameterSharding("diagonal")
    for s in ShardingType:
        assert s.value in str(info.value)
    # strings are case-insensitive
    assert ParameterSharding("TABLE_WISE", ranks=[0]).sharding_type == ShardingType.TABLE_WISE


def test_sharding_type_corrupted_after_construction() -> None:
    ps = table_wise(0)
    ps.sharding_type = "diagonal"  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"table 't0': unsupported sharding type"):
        resolve_module_plan(_tables((10, 8)), {"t0": ps}, 2, 2)


def test_plan_entry_of_wrong_type() -> None:
    with pytest.raises(TypeError, match=r"table 't0': expected a ParameterSharding, got str"):
        resolve_module_plan(_tables((10, 8)), {"t0": "table_wise"}, 2, 2)  # type: ignore[dict-item]


def test_local_size_checked_even_for_rank_only_types() -> None:
    # hosts are a property of the group; an inconsistent local_size is rejected whatever the plan uses
    with pytest.raises(ValueError, match="local_size=3"):
        resolve_module_plan(_tables((10, 8)), {"t0": row_wise()}, 4, 3)


def test_construct_defaults_to_single_process() -> None:
    tables = _tables((10, 8), (7, 4))
    ebc = EmbeddingBagCollection(tables)
    plan = {"t0": table_wise(0), "t1": row_wise()}
    out = construct_module_sharding_plan(ebc, plan, device_type="cpu")
    # ranks, TorchRec's default kernel name and the shards filled in
    assert [(k, ps.sharding_type, ps.ranks, ps.compute_kernel) for k, ps in out.items()] == [
        ("t0", "table_wise", [0], "dense"),
        ("t1", "row_wise", [0], "dense"),
    ]
    assert [(m.shard_offsets, m.shard_sizes, str(m.placement)) for m in out["t1"].sharding_spec.shards] == [
        ([0, 0], [7, 4], "rank:0/cpu")
    ]
    with pytest.raises(ValueError, match=r"table 't0': rank 1 is outside .*0\.\.0"):
        construct_module_sharding_plan(ebc, {"t0": table_wise(1), "t1": row_wise()})


def test_examples_from_the_docstrings() -> None:
    assert even_split(10, 4) == [3, 3, 3, 1] == _chunk_sizes(10, 4)
    assert even_split(5, 4) == [2, 2, 1, 0] == _chunk_sizes(5, 4)
    shards = resolve_module_plan(_tables((10, 4)), {"t0": row_wise()}, 4, 4)["t0"]
    assert [(s.row_offset, s.rows, s.rank) for s in shards] == [(0, 3, 0), (3, 3, 1), (6, 3, 2), (9, 1, 3)]
    shards = resolve_module_plan(_tables((5, 4)), {"t0": row_wise()}, 4, 4)["t0"]
    assert [(s.row_offset, s.rows) for s in shards] == [(0, 2), (2, 2), (4, 1), (5, 0)]
    # row_wise accepts TorchRec's (sizes, device) tuple
    shards = resolve_module_plan(_tables((10, 4)), {"t0": row_wise(([6, 4], "cpu"))}, 2, 2)["t0"]
    assert [(s.row_offset, s.rows) for s in shards] == [(0, 6), (6, 4)]


def test_sharding_plan_container() -> None:
    plan = ShardingPlan({"": {"t0": table_wise(1)}, "a.b": {"t1": column_wise([0, 1], [3, 5])}})
    assert plan.get_plan_for_module("a.b") == {"t1": column_wise([0, 1], [3, 5])}
    assert plan.get_plan_for_module("zzz") is None
    text = str(plan)
    assert text.startswith("module: \n\nparam |") and "\n\nmodule: a.b\n\n" in text
    assert "t0    | table_wise    | auto           | [1]" in text  # TorchRec's table
    assert "t1    | ranks=[0, 1], col_sizes=[3, 5]" in text  # fields of a placement not resolved yet


def test_sharding_plan_str_shows_resolved_shards() -> None:
    ebc = EmbeddingBagCollection(_tables((10, 8), (6, 4)))
    module_plan = construct_module_sharding_plan(
        ebc, {"t0": row_wise([4, 6]), "t1": column_wise([1, 0])}, world_size=2, local_size=2, device_type="cuda"
    )
    lines = [ln.strip() for ln in str(ShardingPlan({"ebc": module_plan})).splitlines()]
    assert lines == [
        "module: ebc",
        "",
        "param | sharding type | compute kernel | ranks",
        "----- | ------------- | -------------- | ------",
        "t0    | row_wise      | dense          | [0, 1]",
        "t1    | column_wise   | dense          | [1, 0]",
        "",
        "param | shard offsets | shard sizes |   placement",
        "----- | ------------- | ----------- | -------------",
        "t0    | [0, 0]        | [4, 8]      | rank:0/cuda:0",
        "t0    | [4, 0]        | [6, 8]      | rank:1/cuda:1",
        "t1    | [0, 0]        | [6, 2]      | rank:1/cuda:1",
        "t1    | [0, 2]        | [6, 2]      | rank:0/cuda:0",
    ]


# -- valid plans: shards tile the table -----------------------------------------------------------------
def _composition(draw, total: int, parts: int, positive: bool) -> list[int]:
    """A random split of ``total`` into ``parts`` ints (each >= 1 when ``positive``)."""
    if parts == 1:
        return [total]
    if positive:
        cuts = sorted(draw(st.lists(st.integers(1, total - 1), min_size=parts - 1, max_size=parts - 1, unique=True)))
    else:
        cuts = sorted(draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


@st.composite
def placements(draw) -> tuple[int, int, list[EmbeddingBagConfig], dict[str, ParameterSharding]]:
    world = draw(st.integers(1, 8))
    local = draw(st.sampled_from(_divisors(world, world)))
    hosts = world // local
    n_tables = draw(st.integers(1, 6))
    tables = [
        EmbeddingBagConfig(draw(st.integers(1, 50)), draw(st.sampled_from(DIMS)), f"t{i}", [f"f{i}"])
        for i in range(n_tables)
    ]
    plan = {}
    for t in tables:
        rows, dim = t.num_embeddings, t.embedding_dim
        kind = draw(st.sampled_from(ALL_TYPES))
        explicit = draw(st.booleans())
        if kind == "data_parallel":
            ps = data_parallel()
        elif kind == "table_wise":
            ps = table_wise(draw(st.integers(0, world - 1)))
        elif kind == "row_wise":
            ps = row_wise(_composition(draw, rows, world, positive=False) if explicit else None)
        elif kind == "column_wise":
            if explicit:
                n = draw(st.integers(1, min(dim, world)))
                sizes = _composition(draw, dim, n, positive=True)
            else:
                n, sizes = draw(st.sampled_from(_divisors(dim, world))), None
            ps = column_wise(draw(st.permutations(range(world)))[:n], sizes)
        elif kind == "table_row_wise":
            ps = table_row_wise(draw(st.integers(0, hosts - 1)))
        else:
            if explicit:
                n = draw(st.integers(1, min(dim, hosts)))
                sizes = _composition(draw, dim, n, positive=True)
            else:
                n, sizes = draw(st.sampled_from(_divisors(dim, hosts))), None
            ps = grid_shard(draw(st.permutations(range(hosts)))[:n], sizes)
        plan[t.name] = ps
    return world, local, tables, plan


def _col_blocks(dim: int, ps: ParameterSharding, n: int) -> list[tuple[int, int]]:
    sizes = ps.col_sizes if ps.col_sizes is not None else [dim // n] * n
    offs = [sum(sizes[:i]) for i in range(n)]
    return list(zip(offs, sizes))


def _expected_shards(t: EmbeddingBagConfig, ps: ParameterSharding, world: int, local: int) -> list[ShardMeta]:
    """Shards written out independently of ``layout.block_shards``."""
    rows, dim, kind = t.num_embeddings, t.embedding_dim, ps.sharding_type

    def row_blocks(sizes: list[int], ranks: list[int], col_off: int, cols: int) -> list[ShardMeta]:
        return [ShardMeta(sum(sizes[:i]), sizes[i], col_off, cols, r) for i, r in enumerate(ranks)]

    if kind == ShardingType.TABLE_WISE:
        return [ShardMeta(0, rows, 0, dim, ps.ranks[0])]
    if kind == ShardingType.ROW_WISE:
        sizes = ps.row_sizes if ps.row_sizes is not None else _chunk_sizes(rows, world)
        return row_blocks(sizes, list(range(world)), 0, dim)
    if kind == ShardingType.COLUMN_WISE:
        return [ShardMeta(0, rows, o, c, r) for (o, c), r in zip(_col_blocks(dim, ps, len(ps.ranks)), ps.ranks)]
    if kind == ShardingType.TABLE_ROW_WISE:
        h = ps.host_indexes[0]
        return row_blocks(_chunk_sizes(rows, local), list(range(h * local, (h + 1) * local)), 0, dim)
    assert kind == ShardingType.GRID_SHARD
    out = []
    for (o, c), h in zip(_col_blocks(dim, ps, len(ps.host_indexes)), ps.host_indexes):
        out += row_blocks(_chunk_sizes(rows, local), list(range(h * local, (h + 1) * local)), o, c)
    return out


@settings(max_examples=50, deadline=None)
@given(placements())
def test_valid_plans_tile_every_table(case) -> None:
    world, local, tables, plan = case
    resolved = resolve_module_plan(tables, plan, world, local)
    assert list(resolved) == [t.name for t in tables]
    for t in tables:
        ps, shards = plan[t.name], resolved[t.name]
        if ps.sharding_type == ShardingType.DATA_PARALLEL:
            assert shards is None
            continue
        assert all(isinstance(s, ShardMeta) for s in shards)
        ranks = [s.rank for s in shards]
        assert all(isinstance(r, int) and 0 <= r < world for r in ranks), ranks
        assert len(set(ranks)) == len(ranks), f"{t.name}: two shards on one rank: {shards}"
        cover = torch.zeros(t.num_embeddings, t.embedding_dim, dtype=torch.int32)
        for s in shards:
            assert s.rows >= 0 and s.cols > 0
            assert s.row_offset >= 0 and s.row_offset + s.rows <= t.num_embeddings
            assert s.col_offset >= 0 and s.col_offset + s.cols <= t.embedding_dim
            cover[s.row_offset : s.row_offset + s.rows, s.col_offset : s.col_offset + s.cols] += 1
        assert bool((cover == 1).all()), f"{t.name}: {ps} -> {shards} does not tile the table exactly"
        assert shards == _expected_shards(t, ps, world, local)
        if ps.sharding_type == ShardingType.ROW_WISE and ps.row_sizes is None:
            assert (
                [s.rows for s in shards] == _chunk_sizes(t.num_embeddings, world) == even_split(t.num_embeddings, world)
            )


@settings(max_examples=20, deadline=None)
@given(placements())
def test_construct_module_sharding_plan_accepts_valid_plans(case) -> None:
    world, local, tables, plan = case
    ebc = EmbeddingBagCollection(tables)
    out = construct_module_sharding_plan(ebc, plan, local_size=local, world_size=world)
    assert out is not plan and out.keys() == plan.keys()
    for name, ps in plan.items():  # the same placement with its ranks filled in, and it resolves the same
        assert out[name].ranks is not None
        assert replace(out[name], ranks=ps.ranks, sharding_spec=None, compute_kernel=ps.compute_kernel) == ps
        table = next(t for t in tables if t.name == name)
        assert resolve_table(table, out[name], world, local) == resolve_table(table, ps, world, local)


@pytest.mark.parametrize("rows", range(1, 30))
@pytest.mark.parametrize("world", range(1, 9))
def test_row_wise_default_is_torch_chunk(rows: int, world: int) -> None:
    shards = resolve_module_plan(_tables((rows, 4)), {"t0": row_wise()}, world, world)["t0"]
    assert [s.rows for s in shards] == _chunk_sizes(rows, world)
    assert [s.rank for s in shards] == list(range(world))


# -- the default planner --------------------------------------------------------------------------------
def test_numpy_integers_are_accepted() -> None:
    import numpy as np

    tables = _tables((10, 8))
    shards = resolve_module_plan(tables, {"t0": table_wise(np.int64(1))}, 4, 4)["t0"]
    assert [s.rank for s in shards] == [1]
    shards = resolve_module_plan(tables, {"t0": row_wise(list(np.array([4, 0, 6, 0])))}, 4, 4)["t0"]
    assert [s.rows for s in shards] == [4, 0, 6, 0]


# -- one kind per sharding type (plans/kinds.py) -------------------------------------------------------
def test_every_sharding_type_has_exactly_one_kind() -> None:
    assert list(KINDS) == list(ShardingType)
    assert [k.sharding_type for k in KINDS.values()] == list(ShardingType)
    assert len({type(k) for k in KINDS.values()}) == len(ShardingType)
    for sharding_type in ShardingType:
        assert kind_of(sharding_type) is KINDS[sharding_type] is kind_of(sharding_type.value.upper())
        assert set(KINDS[sharding_type].fields) <= set(PLACEMENT_FIELDS)


@pytest.mark.parametrize("st", list(ShardingType), ids=lambda s: s.value)
def test_a_kind_refuses_every_field_it_does_not_list(st: ShardingType) -> None:
    t = _tables((12, 8))[0]
    for f in PLACEMENT_FIELDS:
        if f in KINDS[st].fields or f == "ranks":  # ranks: accepted when they are the resolved ones (test_porting_plan)
            continue
        with pytest.raises(ValueError, match=rf"table 't0': {f} does not apply to {st.value}"):
            KINDS[st].tiling(t, ParameterSharding(st, **{f: [0]}), 4, 2)


@settings(max_examples=50, deadline=None)
@given(placements())
def test_kind_tiling_is_plan_resolution_and_placement_of_inverts_it(case) -> None:
    world, local, tables, plan = case
    resolved = resolve_module_plan(tables, plan, world, local)
    for t in tables:
        ps = plan[t.name]
        tiling = kind_of(ps.sharding_type).tiling(t, ps, world, local)
        assert (tiling is None) == (resolved[t.name] is None)
        if tiling is None:
            continue
        assert tiling.shards() == resolved[t.name] == _expected_shards(t, ps, world, local)
        assert tiling.col_blocks == len({s.col_offset for s in resolved[t.name]})
        # the description of resolved shards resolves to the same shards (reports of sharded modules use it)
        again = placement_of(resolved[t.name], world, local)
        assert resolve_table(t, again, world, local) == resolved[t.name], (ps, again)


class _Space:
    def __init__(self, group_size: int, local_size: int, column_shards: list[int]) -> None:
        self.group_size, self.local_size, self.num_hosts = group_size, local_size, group_size // local_size
        self.column_shards = column_shards
        self.asked: list[tuple[str, int, ParameterSharding]] = []

    def best_ranks(self, k, probe):
        self.asked.append(("ranks", k, probe))
        return list(range(self.group_size - k, self.group_size))

    def best_hosts(self, k, probe):
        self.asked.append(("hosts", k, probe))
        return list(range(self.num_hosts - k, self.num_hosts))


@pytest.mark.parametrize("world, local", [(1, 1), (4, 4), (4, 1), (8, 2), (8, 4)])
def test_kind_candidates_are_valid_placements_of_their_type(world: int, local: int) -> None:
    t = _tables((50, 12))[0]
    for sharding_type, kind in KINDS.items():
        space = _Space(world, local, [2, 3, 4, 6])
        cands = kind.candidates(space)
        for ps in cands:
            assert ps.sharding_type == sharding_type
            resolve_table(t, ps, world, local)  # raises if the kind proposed something invalid
            assert kind.label(ps).startswith(sharding_type.value)
        for _, _k, probe in space.asked:  # probes sit on the first ranks / hosts and resolve too
            assert probe.sharding_type == sharding_type
            resolve_table(t, probe, world, local)
        if sharding_type in (ShardingType.TABLE_ROW_WISE, ShardingType.GRID_SHARD) and (local == 1 or local == world):
            assert cands == [], "with one rank per host or one host, host-based types repeat other types"
        if sharding_type == ShardingType.COLUMN_WISE:
            assert sorted(len(ps.ranks) for ps in cands) == [k for k in (2, 3, 4, 6) if k <= world]
