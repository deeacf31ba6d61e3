"""accumulate_grad_batches with fused embedding optimizers (issue 33): 2 processes == one process with the same
accumulation and the same optimizer as a torch optimizer, for every fused CPU kind and sharding type."""

from __future__ import annotations

import dataclasses

import lightning as L
import pytest
import torch

from lightning_rec import (
    CombinedOptimizer,
    EmbeddingBagCollection,
    RecShardedStrategy,
    ShardingPlan,
    column_wise,
    data_parallel,
    full_state_dict,
    grid_shard,
    row_wise,
    table_row_wise,
    table_wise,
)
from lightning_rec.testing import run_distributed
from tests.distributed.test_sharded_equivalence import _RowwiseAdagrad
from tests.lightning.models import KEYS, QUIET_TRAINER, TABLES, ClickModule

STEPS = 3
LR = 0.2
EPS = 1e-8
WIDE = [dataclasses.replace(t, embedding_dim=8) for t in TABLES]  # column shards of 4: fbgemm's F6


def _plan(kind: str) -> ShardingPlan:
    each = {
        "table_wise": lambda t: table_wise(rank=int(t == "item")),
        "row_wise": lambda t: row_wise(),
        "column_wise": lambda t: column_wise([0, 1] if t != "item" else [1, 0]),
        "table_row_wise": lambda t: table_row_wise(host_index=0),
        "grid_shard": lambda t: grid_shard(host_indexes=[0, 1]),  # run on 2 hosts of 1 rank
        "data_parallel": lambda t: data_parallel(),
    }[kind]
    return ShardingPlan({"ebc": {t.name: each(t.name) for t in WIDE}})


def _table_optimizer(params, kind: str) -> torch.optim.Optimizer:
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=LR, eps=EPS, initial_accumulator_value=0.0)
    if kind == "rowwise_adagrad":
        return _RowwiseAdagrad(params, lr=LR, eps=EPS)
    return torch.optim.SGD(params, lr=LR)


class WideClicks(ClickModule):
    """ClickModule with 8-wide tables; the head always takes SGD, the tables ``kind`` (torch or fused)."""

    def __init__(self, batch_size: int, kind: str, plan: ShardingPlan | None = None) -> None:
        super().__init__(batch_size=batch_size, lr=LR, plan=plan)
        torch.manual_seed(0)
        self.ebc = EmbeddingBagCollection(WIDE)
        self.head = torch.nn.Linear(8 * len(KEYS), 1)
        self.kind = kind

    def configure_optimizers(self):
        head = torch.optim.SGD(self.head.parameters(), lr=LR)
        tables = [p for p in self.ebc.parameters() if p.requires_grad]
        return CombinedOptimizer([head, _table_optimizer(tables, self.kind)]) if tables else head


def _trainer(k: int, **kw) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        **QUIET_TRAINER,
        limit_val_batches=0,
        accumulate_grad_batches=k,
        **kw,
    )


def _fused_fits(
    rank: int, ws: int, kind: str, types: list[str], ks: list[int], mp: int | None = None, nodes: int = 1
) -> dict:
    out = {}
    for sharding in types:
        for k in ks:
            model = WideClicks(4, kind, _plan(sharding))
            strategy = RecShardedStrategy(
                model_parallel_size=mp or ws,
                embedding_grad="mean",
                embedding_optimizer={"kind": kind, "lr": LR, "eps": EPS},
            )
            _trainer(k, devices=ws // nodes, num_nodes=nodes, strategy=strategy, use_distributed_sampler=False).fit(
                model
            )
            fused = model.fused_optimizer()
            assert fused.accumulate and fused.pending_bytes() == 0, "the last batch's step applied everything"
            state = full_state_dict(model)
            out[(sharding, k)] = state if rank == 0 else None
    return out


def _reference(kind: str, k: int, ws: int) -> dict:
    model = WideClicks(4 * ws, kind)
    _trainer(k, devices=1, strategy="auto").fit(model)
    return model.state_dict()


def _check(results: list[dict], kind: str, ws: int) -> None:
    refs: dict[int, dict] = {}
    for (sharding, k), got in results[0].items():
        want = refs.setdefault(k, _reference(kind, k, ws))
        assert set(got) == set(want)
        for name in want:
            torch.testing.assert_close(
                got[name], want[name], atol=1e-6, rtol=0, msg=lambda m: f"{kind} {sharding} k={k} {name}: {m}"
            )


ONE_HOST = ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"]
ROW_WHOLE = ["table_wise", "row_wise", "table_row_wise", "data_parallel"]  # row-wise Adagrad refuses column splits


@pytest.mark.parametrize("kind, types", [("sgd", ONE_HOST), ("adagrad", ONE_HOST), ("rowwise_adagrad", ROW_WHOLE)])
def test_accumulated_fused_fit_matches_one_process(kind: str, types: list[str]) -> None:
    results = run_distributed(_fused_fits, 2, kind, types, [2, 4], init_process_group=False, timeout_s=600)
    _check(results, kind, 2)


@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
def test_accumulated_fused_fit_grid_shard(kind: str) -> None:
    # grid_shard gives each column shard its own host: 2 hosts of 1 rank
    results = run_distributed(
        _fused_fits, 2, kind, ["grid_shard"], [2, 4], None, 2, init_process_group=False, ranks_per_node=1, timeout_s=600
    )
    _check(results, kind, 2)


def test_accumulated_fused_fit_with_2d_replicas() -> None:
    # 2 replica groups of 2: shards and the data-parallel table look up the union batch of their copies
    results = run_distributed(
        _fused_fits,
        4,
        "rowwise_adagrad",
        ["row_wise", "data_parallel"],
        [2],
        2,
        init_process_group=False,
        timeout_s=600,
    )
    _check(results, "rowwise_adagrad", 4)
