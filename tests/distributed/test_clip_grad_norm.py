"""clip_grad_norm_ on a sharded model: the total norm and the clipped gradients of one process, for every plan.

A 2-process gloo job against one process of plain ``F.embedding_bag`` and ``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from lightning_rec.sharding import (
    ShardingPlan,
    clip_grad_norm_,
    column_wise,
    data_parallel,
    full_state_dict,
    row_wise,
    shard_modules,
    table_wise,
)
from lightning_rec.testing import run_distributed

ROWS, DIM = 12, 4
PLANS = {
    "row_table_dp": {"a": row_wise(), "b": table_wise(rank=1), "c": data_parallel()},
    "column_grid": {"a": column_wise(ranks=[0, 1]), "b": row_wise([9, 3]), "c": table_wise(rank=0)},
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return EmbeddingBagCollection(
        [EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=DIM, name=n, feature_names=[f"f{n}"]) for n in "abc"]
    )


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    lengths = torch.randint(0, 4, (3 * 2,), generator=g)
    return torch.randint(0, ROWS, (int(lengths.sum()),), generator=g), lengths


def _job(rank: int, ws: int, plan: str, max_norm: float, norm_type: float) -> dict:
    model = shard_modules(_model(), ShardingPlan({"": PLANS[plan]}), embedding_grad="sum")
    ids, lengths = _batch(rank)
    out = model(KeyedJaggedTensor(["fa", "fb", "fc"], ids, lengths=lengths))
    (out.values() * torch.arange(out.values().numel()).view_as(out.values())).sum().backward()
    norm = clip_grad_norm_(model, model.parameters(), max_norm, norm_type)
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad  # the clipped gradients, gathered as weights
    return {"norm": float(norm), "state": full_state_dict(model)}


def _reference(ws: int, max_norm: float, norm_type: float) -> dict:
    model = _model()
    tables = [model.embedding_bags[n].weight for n in "abc"]
    loss = 0
    for rank in range(ws):
        ids, lengths = _batch(rank)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        pooled = [
            F.embedding_bag(
                ids[offsets[2 * t] : offsets[2 * t + 2]], w, offsets[2 * t : 2 * t + 2] - offsets[2 * t], mode="sum"
            )
            for t, w in enumerate(tables)
        ]
        out = torch.cat(pooled, dim=1)
        loss = loss + (out * torch.arange(out.numel()).view_as(out)).sum()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(tables, max_norm, norm_type)
    with torch.no_grad():
        for w in tables:
            w -= w.grad
    return {"norm": float(norm), "state": model.state_dict()}


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_grad_norm_matches_one_process(plan: str, norm_type: float) -> None:
    want = _reference(2, 1.0, norm_type)
    assert want["norm"] > 10  # the bound is reached: clipping scales every gradient
    for rank, got in enumerate(run_distributed(_job, 2, plan, 1.0, norm_type)):
        assert got["norm"] == pytest.approx(want["norm"], rel=1e-6), f"rank {rank}"
        for k, w in want["state"].items():
            torch.testing.assert_close(got["state"][k], w, atol=1e-6, rtol=1e-6, msg=lambda m: f"rank {rank} {k}: {m}")
