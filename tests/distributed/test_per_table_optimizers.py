"""Fused optimizers per table (issue 44 item 1): tables of one collection and of two collections train with different
kinds and hyper-parameters, under every sharding type, 2 and 4 processes, with and without accumulation; each
table must match one process whose torch optimizer of that table's kind steps the same global batch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from lightning_rec.fused_kinds import PerTableOptimizers
from lightning_rec.plans.mesh import init_2d_mesh
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

EPS = 1e-8
SPECS = {  # table -> (kind, lr): t0 and t3 share a spec, hence a kernel
    "t0": ("rowwise_adagrad", 0.5),
    "t1": ("sgd", 0.3),
    "t2": ("adagrad", 0.2),
    "t3": ("rowwise_adagrad", 0.5),
    "s0": ("sgd", 0.1),
}
A_TABLES = [
    EmbeddingBagConfig(name="t0", num_embeddings=11, embedding_dim=8, feature_names=["f0", "f1"]),
    EmbeddingBagConfig(name="t1", num_embeddings=7, embedding_dim=8, feature_names=["f2"], pooling="mean"),
    EmbeddingBagConfig(name="t2", num_embeddings=9, embedding_dim=8, feature_names=["f3"]),
    EmbeddingBagConfig(name="t3", num_embeddings=6, embedding_dim=4, feature_names=["f4"]),
]
B_TABLES = [EmbeddingBagConfig(name="s0", num_embeddings=10, embedding_dim=4, feature_names=["g0"])]
ROWS = {"f0": 11, "f1": 11, "f2": 7, "f3": 9, "f4": 6, "g0": 10}
# (plan per table, local size): every sharding type appears; row-wise statistics never on a column split
LAYOUTS = {
    "mixed_a": (
        {
            "t0": row_wise(),
            "t1": column_wise([1, 0]),
            "t2": table_wise(rank=1),
            "t3": data_parallel(),
            "s0": table_row_wise(host_index=0),
        },
        2,
    ),
    "mixed_b": (
        {
            "t0": table_row_wise(host_index=1),
            "t1": data_parallel(),
            "t2": grid_shard(host_indexes=[1, 0]),
            "t3": table_wise(rank=0),
            "s0": row_wise(),
        },
        1,
    ),
}


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = EmbeddingBagCollection(A_TABLES, kernel="torch")
        self.b = EmbeddingBagCollection(B_TABLES, kernel="torch")

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return torch.cat([self.a(kjt).values(), self.b(kjt).values()], dim=1)


def _batch(rank: int, step: int, part: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * part + rank)
    b = 2 + rank % 3 + part
    keys = list(ROWS)
    lengths = torch.randint(0, 4, (len(keys) * b,), generator=g)
    values = torch.cat(
        [
            torch.randint(0, ROWS[k], (int(n),), generator=g)
            for f, k in enumerate(keys)
            for n in lengths[f * b : (f + 1) * b]
        ]
    )
    return KeyedJaggedTensor(keys, values, lengths=lengths)


def _loss(model: nn.Module, rank: int, step: int, part: int) -> torch.Tensor:
    out = model(_batch(rank, step, part))
    coef = torch.randn(out.shape, generator=torch.Generator().manual_seed(7 + 1000 * step + 10 * part + rank))
    return (out * coef).sum()


def _reference(ref: Two) -> dict[str, torch.optim.Optimizer]:
    opts: dict[str, torch.optim.Optimizer] = {}
    for coll in (ref.a, ref.b):
        for name in [t.name for t in coll.embedding_bag_configs()]:
            kind, lr = SPECS[name]
            p = [coll.embedding_bags[name].weight]
            if kind == "rowwise_adagrad":
                opts[name] = _RowwiseAdagrad(p, lr=lr, eps=EPS)
            elif kind == "adagrad":
                opts[name] = torch.optim.Adagrad(p, lr=lr, eps=EPS, initial_accumulator_value=0.0)
            else:
                opts[name] = torch.optim.SGD(p, lr=lr)
    return opts


def _job(rank: int, ws: int, layout: str, parts: int, mp: int | None) -> list[int]:
    mesh = init_2d_mesh(mp) if mp else None
    groups = {} if mesh is None else {"process_group": mesh.shard_group, "replica_group": mesh.replica_group}
    torch.manual_seed(0)
    model = Two()
    ref = copy.deepcopy(model)
    plan_of, local = LAYOUTS[layout]
    option = PerTableOptimizers(
        default={"kind": "sgd", "lr": SPECS["s0"][1]},
        tables={n: {"kind": k, "lr": lr, "eps": EPS} for n, (k, lr) in SPECS.items() if n != "s0"},
    )
    plan = ShardingPlan({"a": {t.name: plan_of[t.name] for t in A_TABLES}, "b": {"s0": plan_of["s0"]}})
    sharded = shard_modules(model, plan, local_size=local, embedding_optimizer=option, **groups)
    opt = fused_optimizer(sharded)
    assert opt is not None
    opt.accumulate = parts > 1
    ref_opts = _reference(ref)
    for step in range(3):
        if step == 2:  # a scheduler's move: only the groups holding t1 change
            for i, g in enumerate(opt.param_groups):
                if "a.t1" in opt.table_names(i):
                    g["lr"] = g["lr"] * 0.5
            ref_opts["t1"].param_groups[0]["lr"] *= 0.5
        for part in range(parts):
            _loss(sharded, rank, step, part).backward()
        opt.step()
        for o in ref_opts.values():
            o.zero_grad()
        for r in range(ws):  # one process: every rank's losses (embedding_grad="sum"), one step
            for part in range(parts):
                _loss(ref, r, step, part).backward()
        for o in ref_opts.values():
            o.step()
    state, want = full_state_dict(sharded), ref.state_dict()
    for key in want:
        torch.testing.assert_close(state[key], want[key], atol=1e-6, rtol=0, msg=lambda m: f"{layout} {key}: {m}")
    # tables sharing a spec share a kernel: never two groups of one spec among this rank's shards
    return [len(opt.param_groups)]


@pytest.mark.parametrize("ws, mp", [(2, None), (4, None), (4, 2)], ids=["2", "4", "2x2"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("parts", [1, 4])
def test_each_table_trains_with_its_own_fused_optimizer(ws: int, mp: int | None, layout: str, parts: int) -> None:
    # 2x2: 2 replicas of a 2-way model-parallel group; each copy of a table keeps to the union rule per kernel
    results = run_distributed(_job, ws, layout, parts, mp, timeout_s=300)
    assert len(results) == ws


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = EmbeddingBagCollection(A_TABLES, kernel="torch")
        self.head = nn.Linear(sum(t.embedding_dim * len(t.feature_names) for t in A_TABLES), 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.head(self.a(kjt).values())


def _mark(model: _Head) -> None:
    """TorchRec users' two calls: row-wise Adagrad on the big tables, SGD on the rest."""
    from lightning_rec.distributed import RowWiseAdagrad, apply_optimizer_in_backward

    bags = model.a.embedding_bags
    apply_optimizer_in_backward(RowWiseAdagrad, [bags["t0"].weight, bags["t2"].weight], {"lr": 0.5, "eps": EPS})
    apply_optimizer_in_backward(torch.optim.SGD, [bags["t1"].weight, bags["t3"].weight], {"lr": 0.3})


def _dmp_job(rank: int, ws: int) -> None:
    from lightning_rec.distributed import DistributedModelParallel, in_backward_optimizer_filter

    model = _Head()
    ref = copy.deepcopy(model)
    _mark(model)
    _mark(ref)  # unsharded, the marks step each table inside backward (TorchRec's semantics)
    plan = ShardingPlan(
        {"a": {"t0": row_wise(), "t1": table_wise(rank=1), "t2": table_wise(rank=0), "t3": data_parallel()}}
    )
    dmp = DistributedModelParallel(model, plan=plan)
    dense = torch.optim.SGD([p for _, p in in_backward_optimizer_filter(dmp.named_parameters())], lr=0.1)
    ref_dense = torch.optim.SGD([p for _, p in in_backward_optimizer_filter(ref.named_parameters())], lr=0.1)
    assert dmp.fused_optimizer is not None and len(dmp.fused_optimizer.param_groups) >= 1
    for step in range(3):
        _loss(dmp, rank, step, 0).backward()
        dense.step()
        dmp.fused_optimizer.step()
        dense.zero_grad()
        # one process, TorchRec's averaging over ranks (embedding_grad="mean"): the mean of the ranks' losses
        ref_dense.zero_grad()
        (sum(_loss(ref, r, step, 0) for r in range(ws)) / ws).backward()
        ref_dense.step()
    state, want = full_state_dict(dmp.module), ref.state_dict()
    for key in want:
        torch.testing.assert_close(state[key], want[key], atol=1e-5, rtol=0, msg=lambda m: f"{key}: {m}")


def test_torchrec_two_marks_under_distributed_model_parallel() -> None:
    run_distributed(_dmp_job, 2, timeout_s=300)
