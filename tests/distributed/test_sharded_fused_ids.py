"""A bad id never reaches fbgemm on the fused sharded path (its own bounds check is off; F14: -1 passes it)."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from lightning_rec.sharding import ShardingPlan, row_wise, shard_modules, table_wise
from lightning_rec.testing import run_distributed


def _bad_id_job(rank: int, ws: int, plan_kind: str, bad: int, shm: str = "1") -> list[str]:
    os.environ["LIGHTNING_REC_SHM"] = shm  # "0": through gloo, where ids travel as int32 when they fit
    tables = [EmbeddingBagConfig(8, 4, "t0", ["a"]), EmbeddingBagConfig(6, 4, "t1", ["b"])]
    plans = {"table_wise": lambda i: table_wise(i % ws), "row_wise": lambda i: row_wise()}
    plan = ShardingPlan({"": {t.name: plans[plan_kind](i) for i, t in enumerate(tables)}})
    model = shard_modules(EmbeddingBagCollection(tables), plan, embedding_optimizer={"kind": "sgd", "lr": 0.1})
    good = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 7, 0, 5]), lengths=torch.tensor([2, 0, 1, 1]))
    model(good).values().sum().backward()  # a valid batch goes through
    msgs = []
    ids = torch.tensor([1, 7, 0, bad]) if rank == 0 else torch.tensor([1, 7, 0, 5])
    with pytest.raises(ValueError) as err:
        model(KeyedJaggedTensor(["a", "b"], ids, lengths=torch.tensor([2, 0, 1, 1])))
    msgs.append(str(err.value))
    return msgs


@pytest.mark.parametrize("ws, shm", [(1, "1"), (2, "1"), (2, "0")], ids=["1proc", "2procs", "2procs-gloo"])
@pytest.mark.parametrize("plan_kind", ["table_wise", "row_wise"])
@pytest.mark.parametrize("bad", [-1, 6, 2**32 + 5])  # 2**32 + 5 would be 5 if cut to int32
def test_fused_sharded_refuses_bad_ids(ws: int, shm: str, plan_kind: str, bad: int) -> None:
    out = run_distributed(_bad_id_job, ws, plan_kind, bad, shm)
    assert f"feature 'b' (table 't1') has id {bad}, outside the valid range [0, 5]" in out[0][0]
    if bad == -1:
        assert "padding" in out[0][0]
    for msgs in out[1:]:
        assert "ranks [0] rejected their input" in msgs[0]
