"""TorchRec's plan surface: ``ParameterSharding.sharding_spec``, its equality, TorchRec's row-wise size helpers
and ``get_module_to_default_sharders``. The shards are checked against the tiling our own resolution gives
(``resolve_table``) and against plain ``torch.chunk`` sizes, not against TorchRec."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_rec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    ParameterSharding,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    grid_shard,
    row_wise,
    table_row_wise,
    table_wise,
)
from lightning_rec.distributed import (
    EmbeddingBagCollectionSharder,
    EmbeddingCollectionSharder,
    apply_optimizer_in_backward,
    get_module_to_default_sharders,
)
from lightning_rec.plans.plan import (
    _calculate_rw_shard_sizes_and_offsets,
    _calculate_uneven_rw_shard_sizes_and_offsets,
    resolve_table,
    shard_placement,
)
from lightning_rec.sharding import EnumerableShardingSpec, ShardMetadata, ShardPlacement


def _ebc(*shapes: tuple[int, int]) -> EmbeddingBagCollection:
    return EmbeddingBagCollection([EmbeddingBagConfig(r, d, f"t{i}", [f"f{i}"]) for i, (r, d) in enumerate(shapes)])


def _chunk(rows: int, parts: int) -> list[int]:
    sizes = [c.numel() for c in torch.arange(rows).chunk(parts)]
    return sizes + [0] * (parts - len(sizes))


def test_spec_objects() -> None:
    # the fields and equality of torch's ShardMetadata / EnumerableShardingSpec (TorchRec's sharding_spec)
    m = ShardMetadata(shard_offsets=[0, 4], shard_sizes=[10, 4], placement="rank:3/cuda:1")
    assert (m.placement.rank(), m.placement.device()) == (3, torch.device("cuda", 1))
    assert str(m.placement) == "rank:3/cuda:1" and m.placement == "rank:3/cuda:1"
    assert m == ShardMetadata([0, 4], [10, 4], ShardPlacement("rank:3/cuda:1"))
    assert m != ShardMetadata([0, 4], [10, 4], "rank:3/cuda:0") and m != ShardMetadata([0, 0], [10, 4], "rank:3/cuda:1")
    assert ShardMetadata([0, 0], [1, 1], "rank:0/cpu").placement.device() == torch.device("cpu")
    assert EnumerableShardingSpec([m]) == EnumerableShardingSpec([replace(m)])
    assert EnumerableShardingSpec([m]) != EnumerableShardingSpec([m, m])
    for bad in ("cuda:1", "rank:x/cpu", "rank:1/warpdrive"):
        with pytest.raises(ValueError, match=r"placement .* 'rank:N/<device>'"):
            ShardMetadata([0, 0], [1, 1], bad)
    with pytest.raises(ValueError, match="differ in rank"):
        ShardMetadata([0], [1, 1])


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_spec_matches_resolved_shards_for_every_type(device_type: str) -> None:
    ebc = _ebc(*[(10, 8)] * 7)
    per_table = {
        "t0": data_parallel(),
        "t1": table_wise(3),
        "t2": row_wise(),
        "t3": column_wise([2, 0]),
        "t4": table_row_wise(1),
        "t5": grid_shard([1, 0]),
        "t6": row_wise(num_buckets=5),
    }
    out = construct_module_sharding_plan(ebc, per_table, world_size=4, local_size=2, device_type=device_type)
    for t in ebc.embedding_bag_configs():
        ps = out[t.name]
        shards = resolve_table(t, per_table[t.name], 4, 2)
        if shards is None:
            assert ps.sharding_spec is None and ps.ranks == [0, 1, 2, 3]
            continue
        got = [(m.shard_offsets, m.shard_sizes, str(m.placement)) for m in ps.sharding_spec.shards]
        dev = (lambda r: f"cuda:{r % 2}") if device_type == "cuda" else (lambda r: "cpu")
        assert got == [([s.row_offset, s.col_offset], [s.rows, s.cols], f"rank:{s.rank}/{dev(s.rank)}") for s in shards]
        assert ps.ranks == [s.rank for s in shards]
    assert out["t3"].sharding_spec.shards[0].placement.rank() == 2


def test_placement_strings() -> None:
    assert shard_placement(9, "cuda", 8) == "rank:9/cuda:1"
    assert shard_placement(3, "cpu", 2) == "rank:3/cpu"


def test_equality_by_resolved_shards() -> None:
    ebc = _ebc((100, 8))
    uneven = construct_module_sharding_plan(
        ebc, {"t0": column_wise(size_per_rank=[4, 4])}, world_size=2, local_size=2, device_type="cpu"
    )["t0"]
    even = construct_module_sharding_plan(
        ebc, {"t0": column_wise([0, 1])}, world_size=2, local_size=2, device_type="cpu"
    )["t0"]
    # different fields (col_sizes given or not) produced the same shards: equal, as in TorchRec
    assert uneven.col_sizes == [4, 4] and even.col_sizes is None and uneven == even
    other = construct_module_sharding_plan(
        ebc, {"t0": column_wise(size_per_rank=[2, 6])}, world_size=2, local_size=2, device_type="cpu"
    )["t0"]
    assert other != even  # same type and ranks, other shards
    assert replace(even, compute_kernel="fused") != even
    # without a spec on one side every field counts
    assert replace(even, sharding_spec=None) != uneven
    assert column_wise([0, 1]) == column_wise([0, 1]) != column_wise([0, 1], [2, 6])


def test_sharding_spec_type_checked() -> None:
    with pytest.raises(TypeError, match="EnumerableShardingSpec"):
        ParameterSharding("table_wise", ranks=[0], sharding_spec=[(0, 0)])  # type: ignore[arg-type]


def test_given_spec_must_match_the_placement() -> None:
    ebc = _ebc((10, 4))
    t = ebc.embedding_bag_configs()[0]
    good = construct_module_sharding_plan(ebc, {"t0": row_wise([6, 4])}, world_size=2, local_size=2, device_type="cpu")[
        "t0"
    ]
    assert resolve_table(t, good, 2, 2) == resolve_table(t, row_wise([6, 4]), 2, 2)
    # TorchRec-style entry: type, ranks and a spec of uneven rows, but no row_sizes: refused, not re-split evenly
    bad = ParameterSharding("row_wise", ranks=[0, 1], compute_kernel="dense", sharding_spec=good.sharding_spec)
    with pytest.raises(ValueError, match=r"table 't0': sharding_spec gives shards .*\[6, 4\].*resolve to .*\[5, 4\]"):
        resolve_table(t, bad, 2, 2)


def test_default_kernel_names() -> None:
    ebc = _ebc((10, 4), (10, 4))
    apply_optimizer_in_backward(torch.optim.SGD, [ebc.embedding_bags["t1"].weight], {"lr": 0.1})
    out = construct_module_sharding_plan(ebc, {"t0": row_wise(), "t1": row_wise()}, world_size=2, device_type="cpu")
    assert (out["t0"].compute_kernel, out["t1"].compute_kernel) == ("dense", "fused")
    out = construct_module_sharding_plan(ebc, {"t0": data_parallel(), "t1": data_parallel()}, world_size=2)
    assert (out["t0"].compute_kernel, out["t1"].compute_kernel) == ("dense", "dense")
    out = construct_module_sharding_plan(ebc, {"t0": row_wise(compute_kernel="torch"), "t1": row_wise()}, world_size=2)
    assert out["t0"].compute_kernel == "torch"  # a kernel asked for is kept


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 200), devices=st.integers(1, 9), cols=st.integers(1, 64))
def test_rw_sizes_are_torch_chunk(rows: int, devices: int, cols: int) -> None:
    sizes, offsets = _calculate_rw_shard_sizes_and_offsets(rows, devices, cols)
    expect = _chunk(rows, devices)
    assert sizes == [[r, cols] for r in expect]
    assert offsets == [[sum(expect[:i]), 0] for i in range(devices)]


@settings(max_examples=60, deadline=None)
@given(bucket=st.integers(1, 7), buckets=st.integers(1, 20), devices=st.integers(1, 9))
def test_rw_bucket_sizes_match_row_wise_num_buckets(bucket: int, buckets: int, devices: int) -> None:
    rows = bucket * buckets
    sizes, _ = _calculate_rw_shard_sizes_and_offsets(rows, devices, 4, num_buckets=buckets)
    t = _ebc((rows, 4)).embedding_bag_configs()[0]
    shards = resolve_table(t, row_wise(num_buckets=buckets), devices, devices)
    assert [s for s, _ in sizes] == [s.rows for s in shards]
    # whole buckets per rank, the first ranks one more
    per = [s // bucket for s, _ in sizes]
    assert sum(per) == buckets and max(per) - min(per) <= 1 and per == sorted(per, reverse=True)


def test_rw_helpers_refuse_indivisible_buckets() -> None:
    with pytest.raises(AssertionError, match="divisible"):
        _calculate_rw_shard_sizes_and_offsets(10, 4, 8, num_buckets=3)
    with pytest.raises(AssertionError, match="divisible"):
        _calculate_uneven_rw_shard_sizes_and_offsets(10, 3, 8, [2, 1, 1], num_buckets=3)
    with pytest.raises(AssertionError, match="memory size"):
        _calculate_uneven_rw_shard_sizes_and_offsets(10, 3, 8, [2, 1])


def test_uneven_rw_sizes_follow_memory() -> None:
    assert _calculate_uneven_rw_shard_sizes_and_offsets(40, 3, 64, [2, 1, 1], num_buckets=8) == (
        [[20, 64], [10, 64], [10, 64]],
        [[0, 0], [20, 0], [30, 0]],
    )
    # rounding down in whole buckets; the last rank takes the rest
    sizes, offsets = _calculate_uneven_rw_shard_sizes_and_offsets(30, 3, 2, [1, 1, 1], num_buckets=10)
    assert [s for s, _ in sizes] == [9, 9, 12] and offsets == [[0, 0], [9, 0], [18, 0]]


def test_module_to_default_sharders() -> None:
    m = get_module_to_default_sharders()
    assert set(m) == {EmbeddingBagCollection, EmbeddingCollection}
    assert isinstance(m[EmbeddingBagCollection], EmbeddingBagCollectionSharder)
    assert isinstance(m[EmbeddingCollection], EmbeddingCollectionSharder)
    assert all(s.module_type is t for t, s in m.items())
