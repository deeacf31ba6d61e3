"""TorchRec's names for plans, data and optimizers (issue 17 items 4 and 5), checked without processes."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from lightning_rec.configs import ShardingType
from lightning_rec.data import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES, Batch, RandomRecDataset
from lightning_rec.distributed import (
    DistributedModelParallel,
    EmbeddingBagCollectionSharder,
    KeyedOptimizerWrapper,
    RowWiseAdagrad,
    TrainPipelineSparseDist,
    apply_optimizer_in_backward,
    in_backward_optimizer_filter,
    spec_from_fused_params,
    spec_from_optimizer,
)
from lightning_rec.fused_kinds import FusedOptimizerSpec
from lightning_rec.models.dlrm import DLRM, DLRMTrain
from lightning_rec.plans.plan import resolve_table
from lightning_rec.sharding import (
    ParameterSharding,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    grid_shard,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)


def _ebc(*shapes: tuple[int, int]) -> EmbeddingBagCollection:
    return EmbeddingBagCollection([EmbeddingBagConfig(r, d, f"t{i}", [f"f{i}"]) for i, (r, d) in enumerate(shapes)])


# -- plans ------------------------------------------------------------------------------------------------
def test_sharding_type_compares_equal_to_torchrec_strings() -> None:
    assert table_wise(0).sharding_type == "table_wise"
    assert row_wise().sharding_type == ShardingType.ROW_WISE == "row_wise"
    assert {"column_wise": 1}[column_wise([0]).sharding_type] == 1  # hashes like the string
    assert ShardingType.TABLE_COLUMN_WISE.value == "table_column_wise"


def test_ranks_are_filled_in_for_every_type() -> None:
    ebc = _ebc((12, 8), (12, 8), (12, 8), (12, 8), (12, 8), (12, 8), (12, 8))
    plan = construct_module_sharding_plan(
        ebc,
        {
            "t0": data_parallel(),
            "t1": table_wise(rank=3),
            "t2": row_wise(),
            "t3": column_wise(ranks=[2, 0]),
            "t4": table_row_wise(host_index=1),
            "t5": grid_shard(host_indexes=[1, 0]),
            "t6": table_column_wise([2, 3]),
        },
        local_size=2,
        world_size=4,
        device_type="cpu",
    )
    assert {k: ps.ranks for k, ps in plan.items()} == {
        "t0": [0, 1, 2, 3],
        "t1": [3],
        "t2": [0, 1, 2, 3],
        "t3": [2, 0],
        "t4": [2, 3],
        "t5": [2, 3, 0, 1],
        "t6": [2, 3],
    }
    # a resolved plan resolves again to the same shards; wrong ranks are refused, naming the right ones
    t = ebc.embedding_bag_configs()[2]
    assert resolve_table(t, plan["t2"], 4, 2) == resolve_table(t, row_wise(), 4, 2)
    with pytest.raises(ValueError, match=r"table 't2': ranks does not apply to row_wise .*\[0, 1, 2, 3\]; got \[0\]"):
        resolve_table(t, ParameterSharding("row_wise", ranks=[0]), 4, 2)


def test_column_wise_size_per_rank_without_ranks() -> None:
    ps = column_wise(size_per_rank=[2, 6])
    assert ps.ranks == [0, 1] and ps.col_sizes == [2, 6]
    shards = resolve_table(_ebc((5, 8)).embedding_bag_configs()[0], ps, 2, 2)
    assert [(s.col_offset, s.cols, s.rank) for s in shards] == [(0, 2, 0), (2, 6, 1)]
    with pytest.raises(ValueError, match="column_wise needs ranks, or size_per_rank"):
        column_wise()


def test_helpers_accept_and_check_torchrec_options() -> None:
    assert table_wise(1, device="cpu", compute_kernel="fused").compute_kernel == "fused"
    assert row_wise(compute_kernel="dense").compute_kernel == "dense"
    assert column_wise([0, 1], device_types=["cpu", "cpu"]).ranks == [0, 1]
    assert row_wise(([3, 2], "cpu")).row_sizes == [3, 2]
    with pytest.raises(ValueError, match="unknown compute_kernel 'warp'"):
        table_wise(0, compute_kernel="warp")
    with pytest.raises(ValueError, match="device 'gpu0' is not a torch device"):
        table_wise(0, device="gpu0")
    with pytest.raises(ValueError, match="2 device_types for 3 column shards"):
        column_wise([0, 1, 2], device_types=["cpu", "cpu"])
    with pytest.raises(ValueError, match="mix devices"):
        column_wise([0, 1], device_types=["cpu", "cuda"])
    with pytest.raises(ValueError, match="device_type 'tpu9'"):
        construct_module_sharding_plan(_ebc((4, 4)), {"t0": table_wise(0)}, device_type="tpu9")


def test_num_buckets_follows_torchrec() -> None:
    t = _ebc((10, 4)).embedding_bag_configs()[0]
    # TorchRec's docstring: hash_size 10, 4 devices, 5 buckets -> rows [4, 2, 2, 2]
    assert [s.rows for s in resolve_table(t, row_wise(num_buckets=5), 4, 4)] == [4, 2, 2, 2]
    with pytest.raises(ValueError, match="num_buckets=3 does not divide num_embeddings=10"):
        resolve_table(t, row_wise(num_buckets=3), 4, 4)
    with pytest.raises(ValueError, match="num_buckets applies to row_wise only"):
        ParameterSharding("table_wise", ranks=[0], num_buckets=2)
    with pytest.raises(ValueError, match="positive integer"):
        row_wise(num_buckets=0)


def test_table_column_wise_stays_on_one_host() -> None:
    t = _ebc((6, 8)).embedding_bag_configs()[0]
    shards = resolve_table(t, table_column_wise([3, 2]), 4, 2)
    assert [(s.col_offset, s.rank) for s in shards] == [(0, 3), (4, 2)]
    with pytest.raises(ValueError, match=r"table 't0': table_column_wise ranks \[1, 2\] span hosts \[0, 1\]"):
        resolve_table(t, table_column_wise([1, 2]), 4, 2)


def test_construct_module_sharding_plan_argument_order_and_generators() -> None:
    ebc = _ebc((8, 4), (8, 4))
    with pytest.raises(TypeError, match="third argument is the sharder"):
        construct_module_sharding_plan(ebc, {"t0": table_wise(0), "t1": table_wise(0)}, 1)  # type: ignore[arg-type]
    sharder = EmbeddingBagCollectionSharder()
    seen = []

    def generator(param, local_size, world_size, device_type, sharder_):
        seen.append((tuple(param.shape), local_size, world_size, device_type, sharder_))
        return table_wise(world_size - 1)

    plan = construct_module_sharding_plan(
        ebc, {"t0": generator, "t1": row_wise()}, sharder, local_size=2, world_size=2, device_type="cpu"
    )
    assert list(sharder.shardable_parameters(ebc)) == ["t0", "t1"]
    assert plan["t0"].ranks == [1] and seen == [((8, 4), 2, 2, "cpu", sharder)]
    with pytest.raises(ValueError, match="does not shard a Linear"):
        construct_module_sharding_plan(torch.nn.Linear(2, 2), {}, sharder)


# -- data -------------------------------------------------------------------------------------------------
def _kjt(b: int = 2) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(["f"], torch.arange(b), lengths=torch.ones(b, dtype=torch.long))


def test_batch_takes_both_field_names() -> None:
    dense, labels = torch.zeros(2, 3), torch.ones(2)
    a, b = Batch(dense, _kjt(), labels), Batch(dense_features=dense, sparse_features=_kjt(), labels=labels)
    for x in (a, b):
        assert x.dense_features is x.dense is dense and x.sparse_features is x.sparse and len(x) == 2
    assert Batch(dense=dense, sparse=_kjt(), labels=labels).to("cpu").dense_features.shape == (2, 3)
    with pytest.raises(TypeError, match="give dense= or dense_features=, not both"):
        Batch(dense, _kjt(), labels, dense_features=dense)
    with pytest.raises(TypeError, match="missing sparse="):
        Batch(dense=dense, labels=labels)
    with pytest.raises(ValueError, match="same batch size"):
        Batch(dense_features=torch.zeros(3, 3), sparse_features=_kjt(), labels=labels)


def test_random_rec_dataset() -> None:
    assert [f"int_{i}" for i in range(13)] == DEFAULT_INT_NAMES and DEFAULT_CAT_NAMES[25] == "cat_25"
    kw = dict(
        keys=["a", "b"],
        batch_size=4,
        hash_sizes=[5, 7],
        ids_per_features=[1, 3],
        num_dense=2,
        manual_seed=1,
        num_batches=12,
        num_generated_batches=3,
    )
    first, again = list(RandomRecDataset(**kw)), list(RandomRecDataset(**kw))
    assert len(first) == 12 and len(RandomRecDataset(**kw)) == 12
    assert first[3] is first[0]  # the 3 generated batches cycle
    for x, y in zip(first, again):
        assert torch.equal(x.sparse_features.values(), y.sparse_features.values())
    d = first[1].sparse_features.to_dict()
    assert (
        d["a"].lengths().max() <= 1
        and d["b"].lengths().max() <= 3
        and d["b"].values().max() < 7
        and d["a"].values().max() < 5
    )
    assert first[1].dense_features.shape == (4, 2) and set(first[1].labels.tolist()) <= {0, 1}
    one = next(iter(RandomRecDataset(["a"], 5, ids_per_feature=2)))  # a scalar count: exactly that many ids
    assert one.sparse_features.lengths().tolist() == [2] * 5
    fresh = RandomRecDataset(["a"], 2, num_generated_batches=-1, num_batches=2)
    x, y = list(fresh)
    assert x is not y
    with pytest.raises(TypeError, match="endless"):
        len(RandomRecDataset(["a"], 2))
    with pytest.raises(ValueError, match="hash_sizes has 1 entries for 2 keys"):
        RandomRecDataset(["a", "b"], 2, hash_sizes=[3])


# -- optimizers -------------------------------------------------------------------------------------------
def test_row_wise_adagrad_formula() -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 4))
    w0 = w.detach().clone()
    opt = RowWiseAdagrad([w], lr=0.1, eps=1e-10)
    g = torch.randn(3, 4)
    w.grad = g.clone()
    opt.step()
    m = (g**2).mean(1)
    torch.testing.assert_close(w.detach(), w0 - 0.1 * g / (m.sqrt() + 1e-10)[:, None])
    torch.testing.assert_close(opt.state[w]["sum"], m)
    with pytest.raises(ValueError, match="lr must be >= 0"):
        RowWiseAdagrad([w], lr=-1)


def test_apply_optimizer_in_backward_steps_in_backward() -> None:
    torch.manual_seed(0)
    a = torch.nn.Linear(3, 2)
    b = copy.deepcopy(a)
    apply_optimizer_in_backward(torch.optim.SGD, a.parameters(), {"lr": 0.1})
    x = torch.randn(5, 3)
    a(x).sum().backward()
    opt = torch.optim.SGD(b.parameters(), lr=0.1)
    b(x).sum().backward()
    opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q)
        assert p.grad is None
    names = dict(in_backward_optimizer_filter([("w", a.weight), ("v", torch.nn.Parameter(torch.zeros(1)))]))
    assert list(names) == ["v"]
    assert [n for n, _ in in_backward_optimizer_filter([("w", a.weight)], include=True)] == ["w"]


def test_optimizer_classes_map_to_fused_specs() -> None:
    assert spec_from_optimizer(RowWiseAdagrad, {"lr": 0.2}) == FusedOptimizerSpec("rowwise_adagrad", 0.2, eps=1e-10)
    assert spec_from_optimizer(torch.optim.Adagrad, {"lr": 0.3}) == FusedOptimizerSpec("adagrad", 0.3, eps=1e-10)
    assert spec_from_optimizer(torch.optim.SGD, {"lr": 0.4}) == FusedOptimizerSpec("sgd", 0.4)
    with pytest.raises(ValueError, match="momentum=0.9 is not supported by the fused sgd kernel"):
        spec_from_optimizer(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    with pytest.raises(ValueError, match="RMSprop has no fused embedding kernel"):
        spec_from_optimizer(torch.optim.RMSprop, {"lr": 0.1})
    assert spec_from_fused_params({"optimizer": "EXACT_ROWWISE_ADAGRAD", "learning_rate": 0.5}) == FusedOptimizerSpec(
        "rowwise_adagrad", 0.5
    )
    assert spec_from_fused_params({"optimizer": "sgd", "learning_rate": 0.5}).kind == "sgd"
    assert spec_from_fused_params({}) is None
    with pytest.raises(ValueError, match=r"fused_params \['cache_load_factor'\] are not supported"):
        spec_from_fused_params({"optimizer": "sgd", "cache_load_factor": 0.2})
    with pytest.raises(ValueError, match="not a fused kind"):
        spec_from_fused_params({"optimizer": "LARS"})
    with pytest.raises(ValueError, match=r"unknown collectives \['x'\]"):
        EmbeddingBagCollectionSharder(qcomm_codecs_registry={"x": 1})
    with pytest.raises(TypeError, match="pooled_embeddings_all_to_all.*get_qcomm_codecs_registry"):
        EmbeddingBagCollectionSharder(qcomm_codecs_registry={"pooled_embeddings_all_to_all": "fp16"})


def test_keyed_optimizer_wrapper_state_by_name() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(2, 2)
    opt = KeyedOptimizerWrapper(dict(lin.named_parameters()), lambda ps: torch.optim.Adagrad(ps, lr=0.1))
    lin(torch.randn(3, 2)).sum().backward()
    opt.step()
    state = opt.state_dict()
    assert set(state["state"]) == {"weight", "bias"} and state["param_groups"][0]["params"] == ["weight", "bias"]
    other = KeyedOptimizerWrapper(dict(lin.named_parameters()), lambda ps: torch.optim.Adagrad(ps, lr=0.1))
    other.load_state_dict(state)
    torch.testing.assert_close(other.state_dict()["state"]["weight"]["sum"], state["state"]["weight"]["sum"])
    with pytest.raises(ValueError, match=r"\['nope'\]"):
        other.load_state_dict({"state": {"nope": {}}, "param_groups": state["param_groups"]})
    opt.zero_grad()
    assert lin.weight.grad is None


def test_pipeline_on_an_unsharded_model() -> None:
    torch.manual_seed(0)
    ebc = _ebc((10, 4), (10, 4))
    model = DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc, dense_in_features=3, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[3, 1]
        )
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    pipeline = TrainPipelineSparseDist(model, opt, torch.device("cpu"))
    data = iter(
        RandomRecDataset(
            ["f0", "f1"], 8, hash_size=10, num_dense=3, manual_seed=0, num_batches=30, num_generated_batches=2
        )
    )
    losses = [float(pipeline.progress(data)[0]) for _ in range(30)]
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])
    with pytest.raises(StopIteration):
        pipeline.progress(data)
    with pytest.raises(ValueError, match="TorchScript"):
        TrainPipelineSparseDist(model, opt, torch.device("cpu"), apply_jit=True)


def test_dmp_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedModelParallel(_ebc((4, 4)))


def test_torch_and_fbgemm_spellings_of_the_optimizer() -> None:
    # TorchRec's golden example calls torch's own _apply_optimizer_in_backward: DMP reads what it marks
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torch.distributed.optim import _apply_optimizer_in_backward

    from lightning_rec.distributed.optimizers import in_backward_specs

    ebc = _ebc((6, 4), (5, 4))
    assert in_backward_specs(ebc) == {"t0": None, "t1": None}
    _apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.3})
    rowwise = FusedOptimizerSpec("rowwise_adagrad", 0.3, eps=1e-10)
    assert in_backward_specs(ebc) == {"t0": rowwise, "t1": rowwise}
    assert spec_from_fused_params(
        {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.2}
    ) == FusedOptimizerSpec("rowwise_adagrad", 0.2)
    # tables of one collection may carry different optimizers (each becomes its own fused kernel)
    mixed = _ebc((6, 4), (5, 4))
    apply_optimizer_in_backward(torch.optim.SGD, [next(mixed.parameters())], {"lr": 0.1})
    assert in_backward_specs(mixed) == {"t0": FusedOptimizerSpec("sgd", 0.1), "t1": None}
