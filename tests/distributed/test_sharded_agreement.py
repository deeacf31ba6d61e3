"""Ranks that disagree on what to shard, or send payloads of different dtypes, never hang or mis-train."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from lightning_rec.sharding import (
    ShardingPlan,
    column_wise,
    data_parallel,
    full_state_dict,
    grid_shard,
    row_wise,
    shard_modules,
    table_wise,
)
from lightning_rec.testing import run_distributed


def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="big t", num_embeddings=10, embedding_dim=4, feature_names=["f"]),
        EmbeddingBagConfig(name="small", num_embeddings=4, embedding_dim=4, feature_names=["g"]),
    ]


def _plans(kind: str, rank: int) -> dict:
    if kind == "row_sizes":
        return {"big t": row_wise([3, 7] if rank == 0 else [5, 5]), "small": data_parallel()}
    if kind == "swapped":
        return {"big t": table_wise(rank), "small": table_wise(1 - rank)}
    if kind == "row_vs_dp":
        return {"big t": row_wise() if rank == 0 else data_parallel(), "small": data_parallel()}
    if kind == "bad_plan_on_one_rank":
        return {"big t": row_wise([3, 3] if rank == 1 else [5, 5]), "small": data_parallel()}  # 6 != 10 rows
    return {"big t": row_wise(), "small": table_wise(0)}


def _disagree_job(rank: int, ws: int, kind: str) -> str:
    try:
        shard_modules(EmbeddingBagCollection(_tables()), ShardingPlan({"": _plans(kind, rank)}))
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("kind", ["row_sizes", "swapped", "row_vs_dp"])
def test_ranks_with_different_plans_raise_on_every_rank_naming_table_and_ranks(kind: str) -> None:
    for msg in run_distributed(_disagree_job, 2, kind, timeout_s=60):
        assert "disagree" in msg, msg
        assert "table 'big t'" in msg and "rank 0:" in msg and "rank 1:" in msg
        if kind == "swapped":
            assert "table 'small'" in msg
        else:
            assert "'small'" not in msg  # it agrees


def test_a_plan_that_fails_on_one_rank_stops_the_others_too() -> None:
    msgs = run_distributed(_disagree_job, 2, "bad_plan_on_one_rank", timeout_s=60)
    assert "big t" in msgs[1] and "could not resolve" not in msgs[1]
    assert "rank 1 could not resolve the sharding plan" in msgs[0]


def _agree_job(rank: int, ws: int) -> list[str]:
    sharded = shard_modules(EmbeddingBagCollection(_tables()), ShardingPlan({"": _plans("same", rank)}))
    return [str(d) for d in sharded.peer_devices]


def test_ranks_that_agree_learn_each_others_devices() -> None:
    for devices in run_distributed(_agree_job, 2):
        assert devices == ["cpu", "cpu"]


# -- environment variables that choose the collectives ---------------------------------------------------
def _env_job(rank: int, ws: int, kind: str) -> str:
    from lightning_rec import transport

    read = transport._PAIRWISE_SET
    if kind == "output_dist":
        os.environ["LIGHTNING_REC_OUTPUT_DIST"] = "flat" if rank == 0 else "auto"
    elif kind == "bogus" and rank == 1:
        os.environ["LIGHTNING_REC_OUTPUT_DIST"] = "bogus"
    elif kind == "pairwise" and rank == 1:
        transport._PAIRWISE_SET = "0"  # as if this rank had started with LIGHTNING_REC_PAIRWISE=0
    try:
        return _disagree_job(rank, ws, "same")
    finally:
        transport._PAIRWISE_SET = read  # the pooled process serves later tests


def test_ranks_with_different_output_dist_settings_raise_on_every_rank() -> None:
    for msg in run_distributed(_env_job, 2, "output_dist", timeout_s=60):
        assert "LIGHTNING_REC_OUTPUT_DIST: rank 0 has 'flat', rank 1 has 'auto': set it alike on every rank" in msg
        assert "table '" not in msg and "LIGHTNING_REC_PAIRWISE" not in msg, msg


def test_ranks_with_different_pairwise_settings_raise_on_every_rank() -> None:
    for msg in run_distributed(_env_job, 2, "pairwise", timeout_s=60):
        assert "LIGHTNING_REC_PAIRWISE: rank 0 has 'auto', rank 1 has '0': set it alike on every rank" in msg, msg


def test_an_unknown_output_dist_on_one_rank_stops_every_rank() -> None:
    msgs = run_distributed(_env_job, 2, "bogus", timeout_s=60)
    assert "LIGHTNING_REC_OUTPUT_DIST='bogus': expected one of auto, flat, hierarchical" in msgs[1], msgs[1]
    assert "rank 1 could not resolve the sharding plan or its environment settings" in msgs[0], msgs[0]


# -- per-sample weights of different float dtypes on different ranks ----------------------------------
def _weights_job(rank: int, ws: int, kind: str) -> dict:
    torch.manual_seed(0)
    tables = _tables()
    model = EmbeddingBagCollection(tables, is_weighted=True, kernel="torch")
    ref = copy.deepcopy(model)
    plan = {
        "row_wise": {"big t": row_wise(), "small": table_wise(1)},
        # only the fp16 rank (1) sends to the table's owner (0)
        "table_wise": {"big t": table_wise(0), "small": table_wise(0)},
        "data_parallel": {"big t": data_parallel(), "small": data_parallel()},
    }[kind]
    sharded = shard_modules(model, ShardingPlan({"": plan}))
    opt = torch.optim.SGD(sharded.parameters(), lr=0.5) if list(sharded.parameters()) else None
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    dtypes = [torch.float32, torch.float16]

    def batch(r: int) -> KeyedJaggedTensor:
        g = torch.Generator().manual_seed(r)
        ids = torch.cat([torch.randint(0, 10, (5,), generator=g), torch.randint(0, 4, (3,), generator=g)])
        w = (torch.rand(8, generator=g) * 4).to(dtypes[r])
        lengths = torch.tensor([2, 3, 1, 2]) if r == 0 else torch.tensor([5, 0, 3, 0])
        return KeyedJaggedTensor(["f", "g"], ids, weights=w, lengths=lengths)

    out = sharded(batch(rank))
    want = ref(batch(rank)).values()
    err = float((out.values() - want).abs().max())
    out.values().sum().backward()
    if opt is not None:
        opt.step()
    sum(ref(batch(r)).values().sum() for r in range(ws)).backward()
    ref_opt.step()
    got = full_state_dict(sharded)
    state_err = max(float((got[k] - v).abs().max()) for k, v in ref.state_dict().items())
    return {"forward": err, "state": state_err, "dtype": str(out.values().dtype)}


@pytest.mark.parametrize("kind", ["row_wise", "table_wise", "data_parallel"])
def test_per_sample_weights_of_different_dtypes_on_different_ranks(kind: str) -> None:
    # rank 0 passes fp32 weights, rank 1 fp16 ones; both equal the unsharded module on one process
    for res in run_distributed(_weights_job, 2, kind, timeout_s=90):
        assert res["dtype"] == "torch.float32"
        assert res["forward"] <= 1e-5 and res["state"] <= 1e-5, res


# -- a per-row optimizer statistic over a column shard would change the math ---------------------------------------
def _rowwise_column_split_job(rank: int, ws: int, kind: str, plan_name: str) -> str:
    tables = [EmbeddingBagConfig(num_embeddings=12, embedding_dim=8, name="wide t", feature_names=["f"])]
    plans = {"column_wise": column_wise([0, 1]), "grid_shard": grid_shard([0, 1]), "row_wise": row_wise()}
    model = torch.nn.Sequential()
    model.add_module("ebc", EmbeddingBagCollection(tables))
    try:
        # one rank per host: grid_shard's two column blocks sit on hosts 0 and 1
        shard_modules(
            model,
            ShardingPlan({"ebc": {"wide t": plans[plan_name]}}),
            local_size=1,
            embedding_optimizer={"kind": kind, "lr": 0.1},
        )
    except ValueError as e:
        return str(e)
    return "sharded"


@pytest.mark.parametrize("plan_name", ["column_wise", "grid_shard"])
def test_fused_rowwise_state_refuses_column_splits_on_every_rank(plan_name: str) -> None:
    for msg in run_distributed(_rowwise_column_split_job, 2, "rowwise_adagrad", plan_name):
        assert "table 'wide t'" in msg and "one statistic per row" in msg and "row_wise" in msg, msg
    # element-wise state is exact over column shards, and row shards keep whole rows
    assert run_distributed(_rowwise_column_split_job, 2, "adagrad", plan_name) == ["sharded", "sharded"]
    assert run_distributed(_rowwise_column_split_job, 2, "rowwise_adagrad", "row_wise") == ["sharded", "sharded"]
