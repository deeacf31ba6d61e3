"""Data-parallel tables take sparse gradients by themselves where the optimizer makes that exact.

Real 2-process gloo jobs against one process of plain ``F.embedding_bag`` over every rank's batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from lightning_rec.sharding import ShardingPlan, data_parallel, shard_modules, use_sparse_grads_where_possible
from lightning_rec.testing import run_distributed

STEPS = 4
TABLES = [("a", 50, 4, "sum"), ("b", 30, 3, "mean")]


def _opt(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.3)
    if kind == "sgd_momentum":
        return torch.optim.SGD(params, lr=0.3, momentum=0.9)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=0.3)
    if kind == "sparse_adam":
        return torch.optim.SparseAdam(params, lr=0.05)
    return torch.optim.Adam(params, lr=0.05)


def _configs():
    return [EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=[f"f_{n}"], pooling=p)
            for n, r, d, p in TABLES]


def _batch(step: int, rank: int):
    """Rank ``rank``'s ids (with repeats), bag lengths and loss weights for one step: (ids, lengths, target) per table."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    out = []
    for _, rows, dim, _ in TABLES:
        lengths = torch.randint(0, 4, (3,), generator=g)
        ids = torch.randint(0, rows // 3, (int(lengths.sum()),), generator=g)  # few rows: many repeats
        out.append((ids, lengths, torch.randn(3, dim, generator=g)))
    return out


def _loss(pooled: list[torch.Tensor], batch) -> torch.Tensor:
    return sum((p * t).sum() for p, (_, _, t) in zip(pooled, batch))


def _reference(kind: str, ws: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(w.detach().clone()) for w in EmbeddingBagCollection(_configs()).parameters()]
    opt = _opt(kind, weights)
    for step in range(STEPS):
        opt.zero_grad()
        loss = 0
        for rank in range(ws):  # embedding_grad="sum": every rank's loss adds up
            batch = _batch(step, rank)
            pooled = [F.embedding_bag(ids, w, torch.cat([lens.new_zeros(1), lens.cumsum(0)]), mode=mode,
                                      include_last_offset=True, sparse=kind == "sparse_adam")  # it takes no other
                      for w, (ids, lens, _), (_, _, _, mode) in zip(weights, batch, TABLES)]
            loss = loss + _loss(pooled, batch)
        loss.backward()
        opt.step()
    return [w.detach() for w in weights]


def _job(rank: int, ws: int, kind: str, sparse_grad, clip: bool) -> dict:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(_configs(), **({} if sparse_grad == "default" else {"sparse_grad": sparse_grad}))
    ebc = shard_modules(ebc, ShardingPlan({"": {n: data_parallel() for n, *_ in TABLES}}))
    opt = _opt(kind, ebc.parameters())
    decided = use_sparse_grads_where_possible(ebc, opt, gradient_clipping=clip)
    sparse = []
    for step in range(STEPS):
        opt.zero_grad()
        batch = _batch(step, rank)
        kjt = KeyedJaggedTensor([f"f_{n}" for n, *_ in TABLES], torch.cat([b[0] for b in batch]),
                                lengths=torch.cat([b[1] for b in batch]))
        kt = ebc(kjt)
        _loss([kt[f"f_{n}"] for n, *_ in TABLES], batch).backward()
        sparse.append([p.grad.is_sparse for p in ebc.parameters()])
        if clip:
            torch.nn.utils.clip_grad_norm_(ebc.parameters(), 1e6)  # a no-op bound: it must only run
        opt.step()
    return {"weights": [p.detach().clone() for p in ebc.parameters()], "sparse": sparse, "decided": decided}


@pytest.mark.parametrize("kind, sparse", [("sgd", True), ("adagrad", True), ("sparse_adam", True), ("adam", False),
                                          ("sgd_momentum", False)])
def test_default_data_parallel_table_picks_sparse_where_exact(kind: str, sparse: bool) -> None:
    results = run_distributed(_job, 2, kind, "default", False)
    want = _reference(kind, 2)
    for r in results:
        assert all(s == [sparse, sparse] for s in r["sparse"]), r["decided"]
        assert (r["decided"][""] is None) == sparse
        for got, ref in zip(r["weights"], want):
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results[0]["weights"], results[1]["weights"], rtol=0, atol=0)  # replicas equal


@pytest.mark.parametrize("sparse_grad, clip, why", [(False, False, "explicitly"), ("default", True, "clipping")])
def test_explicit_dense_or_clipping_stays_dense(sparse_grad, clip: bool, why: str) -> None:
    results = run_distributed(_job, 2, "sgd", sparse_grad, clip)
    want = _reference("sgd", 2)
    for r in results:
        assert not any(any(s) for s in r["sparse"])
        assert why in r["decided"][""]
        for got, ref in zip(r["weights"], want):
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
