"""Several backward passes, one step, with fused optimizers outside Lightning (issue 33): 2 processes == one
process whose torch optimizer steps the gradient accumulated over the same losses."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from lightning_rec.sharding import (
    ShardingPlan,
    column_wise,
    data_parallel,
    full_state_dict,
    fused_optimizer,
    grid_shard,
    row_wise,
    shard_modules,
    table_row_wise,
    table_wise,
)
from lightning_rec.testing import run_distributed
from tests.distributed.test_sharded_equivalence import _RowwiseAdagrad

LR, EPS = 0.5, 1e-8
TABLES = [
    EmbeddingBagConfig(name="u", num_embeddings=9, embedding_dim=8, feature_names=["u1", "u2"]),
    EmbeddingBagConfig(name="v", num_embeddings=7, embedding_dim=8, feature_names=["v1"], pooling="mean"),
]
KEYS = ["u1", "u2", "v1"]
PLANS = {  # (plan of every table, local_size)
    "table_wise": (lambda t: table_wise(rank=int(t == "v")), 2),
    "row_wise": (lambda t: row_wise(), 2),
    "column_wise": (lambda t: column_wise([1, 0]), 2),
    "table_row_wise": (lambda t: table_row_wise(host_index=0), 2),
    "grid_shard": (lambda t: grid_shard(host_indexes=[1, 0]), 1),  # 2 hosts of 1 rank
    "data_parallel": (lambda t: data_parallel(), 2),
}


def _batch(rank: int, step: int, part: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * part + rank)
    b = 2 + rank + part
    lengths = torch.randint(0, 4, (len(KEYS) * b,), generator=g)
    rows = [9, 9, 7]
    values = torch.cat(
        [
            torch.randint(0, rows[f], (int(n),), generator=g)
            for f in range(len(KEYS))
            for n in lengths[f * b : (f + 1) * b]
        ]
    )
    return KeyedJaggedTensor(KEYS, values, lengths=lengths)


def _coef(rank: int, step: int, part: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(7 + 1000 * step + 10 * part + rank))


def _losses(model, rank: int, step: int) -> list[tuple[torch.Tensor, bool]]:
    """(loss, retain_graph) in backward order: step 0 two losses through one lookup, step 1 two lookups."""
    if step == 0:
        out = model(_batch(rank, 0, 0)).values()
        return [
            ((out * _coef(rank, 0, 0, out.shape)).sum(), True),
            ((out.pow(2) * _coef(rank, 0, 1, out.shape)).sum(), False),
        ]
    outs = [model(_batch(rank, step, p)).values() for p in (0, 1)]
    return [((o * _coef(rank, step, p, o.shape)).sum(), False) for p, o in enumerate(outs)]


def _reference_optimizer(params, kind: str) -> torch.optim.Optimizer:
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=LR, eps=EPS, initial_accumulator_value=0.0)
    if kind == "rowwise_adagrad":
        return _RowwiseAdagrad(params, lr=LR, eps=EPS)
    return torch.optim.SGD(params, lr=LR)


def _job(rank: int, ws: int, kind: str, types: list[str]) -> dict:
    got = {}
    for sharding in types:
        torch.manual_seed(0)
        model = EmbeddingBagCollection(TABLES, kernel="torch")
        ref = copy.deepcopy(model)
        each, local = PLANS[sharding]
        sharded = shard_modules(
            model,
            ShardingPlan({"": {t.name: each(t.name) for t in TABLES}}),
            local_size=local,
            embedding_optimizer={"kind": kind, "lr": LR, "eps": EPS},
        )
        opt = fused_optimizer(sharded)
        opt.accumulate = True
        ref_opt = _reference_optimizer(ref.parameters(), kind)
        for step in range(3):
            before = {n: p.detach().clone() for n, p in sharded.named_parameters()}
            for loss, retain in _losses(sharded, rank, step):
                loss.backward(retain_graph=retain)
                assert all(torch.equal(p, before[n]) for n, p in sharded.named_parameters()), "moved before step"
            opt.step()
            # one process: every rank's losses (embedding_grad="sum"), gradients accumulated, one step
            ref_opt.zero_grad()
            for r in range(ws):
                for loss, retain in _losses(ref, r, step):
                    loss.backward(retain_graph=retain)
            ref_opt.step()
        state, want = full_state_dict(sharded), ref.state_dict()
        for key in want:
            torch.testing.assert_close(
                state[key], want[key], atol=1e-6, rtol=0, msg=lambda m: f"{kind} {sharding} {key}: {m}"
            )
        got[sharding] = True
    return got


@pytest.mark.parametrize(
    "kind, types",
    [
        ("sgd", list(PLANS)),
        ("adagrad", list(PLANS)),
        ("rowwise_adagrad", ["table_wise", "row_wise", "table_row_wise", "data_parallel"]),
    ],
)
def test_several_backward_passes_then_one_step_match_one_process(kind: str, types: list[str]) -> None:
    for r in run_distributed(_job, 2, kind, types, timeout_s=300):
        assert list(r) == types
