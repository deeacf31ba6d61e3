"""Data-parallel tables take sparse gradients by themselves where the optimizer makes that exact.

Real 2-process gloo jobs against one process of plain ``F.embedding_bag`` over every rank's batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_rec import (
    CombinedOptimizer,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
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
    return [
        EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=[f"f_{n}"], pooling=p)
        for n, r, d, p in TABLES
    ]


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
            pooled = [
                F.embedding_bag(
                    ids,
                    w,
                    torch.cat([lens.new_zeros(1), lens.cumsum(0)]),
                    mode=mode,
                    include_last_offset=True,
                    sparse=kind == "sparse_adam",
                )  # it takes no other
                for w, (ids, lens, _), (_, _, _, mode) in zip(weights, batch, TABLES)
            ]
            loss = loss + _loss(pooled, batch)
        loss.backward()
        opt.step()
    return [w.detach() for w in weights]


def _job(rank: int, ws: int, kind: str, sparse_grad, clip: bool, device: str = "cpu") -> dict:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(_configs(), **({} if sparse_grad == "default" else {"sparse_grad": sparse_grad}))
    ebc = shard_modules(ebc, ShardingPlan({"": {n: data_parallel() for n, *_ in TABLES}}), device=device)
    opt = _opt(kind, ebc.parameters())
    decided = use_sparse_grads_where_possible(ebc, opt, gradient_clipping=clip)
    sparse = []
    for step in range(STEPS):
        opt.zero_grad()
        batch = _batch(step, rank)
        kjt = KeyedJaggedTensor(
            [f"f_{n}" for n, *_ in TABLES], torch.cat([b[0] for b in batch]), lengths=torch.cat([b[1] for b in batch])
        ).to(device)
        kt = ebc(kjt)
        _loss([kt[f"f_{n}"].cpu() for n, *_ in TABLES], batch).backward()
        sparse.append([p.grad.is_sparse for p in ebc.parameters()])
        if clip:
            torch.nn.utils.clip_grad_norm_(ebc.parameters(), 1e6)  # a no-op bound: it must only run
        opt.step()
    return {
        "weights": [p.detach().cpu() for p in ebc.parameters()],
        "sparse": sparse,
        "decided": decided,
        "kernels": ebc.lookup_kernels,
    }


@pytest.mark.parametrize(
    "kind, sparse", [("sgd", True), ("adagrad", True), ("sparse_adam", True), ("adam", False), ("sgd_momentum", False)]
)
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


def _decisions_job(rank: int, ws: int) -> dict:
    """Which optimizers, options and collections keep the data-parallel tables dense."""

    def fresh(**kw):
        torch.manual_seed(0)
        return shard_modules(
            EmbeddingBagCollection(_configs(), **kw), ShardingPlan({"": {"a": data_parallel(), "b": data_parallel()}})
        )

    class MySGD(torch.optim.SGD):
        pass

    out = {}
    cases = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
        "sgd_wd": lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.01),
        "adagrad_wd": lambda p: torch.optim.Adagrad(p, lr=0.1, weight_decay=0.01),
        "subclass": lambda p: MySGD(p, lr=0.1),
        "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.1),
        "combined": lambda p: CombinedOptimizer([torch.optim.Adagrad(p, lr=0.1)]),
    }
    for name, make in cases.items():
        ebc = fresh()
        out[name] = use_sparse_grads_where_possible(ebc, make(ebc.parameters()))[""]
    ebc = fresh()
    one = [p for n, p in ebc.named_parameters() if n.endswith("a.weight")]
    out["partial"] = use_sparse_grads_where_possible(ebc, torch.optim.SGD(one, lr=0.1))[""]
    ebc = fresh()
    out["scaler"] = use_sparse_grads_where_possible(
        ebc, torch.optim.SGD(ebc.parameters(), lr=0.1), grad_scaler=object()
    )[""]
    ebc = fresh(sparse_grad=True)  # explicit True: sparse already, not switched
    out["explicit_true"] = use_sparse_grads_where_possible(ebc, torch.optim.SGD(ebc.parameters(), lr=0.1))[""]
    ebc = fresh()
    use_sparse_grads_where_possible(ebc, torch.optim.SGD(ebc.parameters(), lr=0.1))
    out["switch_back"] = use_sparse_grads_where_possible(ebc, torch.optim.Adam(ebc.parameters(), lr=0.1))[""]
    kjt = KeyedJaggedTensor(["f_a", "f_b"], torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]))
    ebc(kjt).values().sum().backward()
    out["switched_back_dense"] = not any(p.grad.is_sparse for p in ebc.parameters())
    return out


def test_decision_rules() -> None:
    (r,) = run_distributed(_decisions_job, 1)
    assert r["sgd"] is None and r["combined"] is None
    assert "weight_decay" in r["sgd_wd"] and "weight_decay" in r["adagrad_wd"]
    assert "MySGD" in r["subclass"] and "RMSprop" in r["rmsprop"]
    assert "'b' is in no optimizer" in r["partial"]
    assert "GradScaler" in r["scaler"]
    assert "sparse_grad=True" in r["explicit_true"]
    assert "Adam" in r["switch_back"] and r["switched_back_dense"]


def _sequence_job(rank: int, ws: int) -> dict:
    torch.manual_seed(0)
    ec = EmbeddingCollection([EmbeddingConfig(name="s", num_embeddings=20, embedding_dim=3, feature_names=["f"])])
    ec = shard_modules(ec, ShardingPlan({"": {"s": data_parallel()}}))
    opt = torch.optim.Adagrad(ec.parameters(), lr=0.3)
    decided = use_sparse_grads_where_possible(ec, opt)[""]
    sparse = []
    for step in range(STEPS):
        opt.zero_grad()
        ids, lengths, target = _seq_batch(step, rank)
        (ec(KeyedJaggedTensor(["f"], ids, lengths=lengths))["f"].values() * target).sum().backward()
        sparse.append(next(ec.parameters()).grad.is_sparse)
        opt.step()
    return {"w": next(ec.parameters()).detach().clone(), "sparse": sparse, "decided": decided}


def _seq_batch(step: int, rank: int):
    g = torch.Generator().manual_seed(77 * step + rank)
    lengths = torch.randint(0, 4, (3,), generator=g)
    ids = torch.randint(0, 7, (int(lengths.sum()),), generator=g)
    return ids, lengths, torch.randn(len(ids), 3, generator=g)


def test_sequence_data_parallel_table_sparse_under_adagrad() -> None:
    results = run_distributed(_sequence_job, 2)
    torch.manual_seed(0)
    w = torch.nn.Parameter(
        next(
            EmbeddingCollection(
                [EmbeddingConfig(name="s", num_embeddings=20, embedding_dim=3, feature_names=["f"])]
            ).parameters()
        ).detach()
    )
    opt = torch.optim.Adagrad([w], lr=0.3)
    for step in range(STEPS):
        opt.zero_grad()
        sum((F.embedding(ids, w) * t).sum() for ids, _, t in (_seq_batch(step, r) for r in range(2))).backward()
        opt.step()
    for r in results:
        assert r["decided"] is None and all(r["sparse"])
        torch.testing.assert_close(r["w"], w.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_auto_kernel_switches_to_sparse_torch_lookup() -> None:
    # on CUDA "auto" is fbgemm, whose autograd kernel is dense: the switch re-resolves the replicas to torch
    results = run_distributed(_job, 2, "adagrad", "default", False, "cuda")
    want = _reference("adagrad", 2)
    for r in results:
        assert all(s == [True, True] for s in r["sparse"]) and set(r["kernels"].values()) == {"torch"}
        for got, ref in zip(r["weights"], want):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
