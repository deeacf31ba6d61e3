"""The Adam family fused on CPU under sharding: 2 processes == one fused kernel fed every rank's batch.

On CPU these kinds run the torch update of ``kernels/_torch_adam.py`` (fbgemm's CPU build has no Adam / LAMB
kernel); its single-process numerics are checked in ``tests/unit/test_fused_adam_cpu.py``. Here the sharded
tables (row-wise, table-wise, data-parallel under the union-batch rule) must end where one unsharded kernel ends
after the union of the ranks' batches (``embedding_grad="sum"``), step counter included.
"""

from __future__ import annotations

import pytest
import torch

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from lightning_rec.kernels import FusedPooledKernel
from lightning_rec.optim import FusedOptimizer
from lightning_rec.sharding import (
    ShardingPlan,
    data_parallel,
    full_state_dict,
    fused_optimizer,
    row_wise,
    shard_modules,
    table_wise,
)
from lightning_rec.testing import run_distributed

TABLES = [
    EmbeddingBagConfig(name="u", num_embeddings=9, embedding_dim=8, feature_names=["u1", "u2"]),
    EmbeddingBagConfig(name="v", num_embeddings=7, embedding_dim=8, feature_names=["v1"]),
]
KEYS, ROWS = ["u1", "u2", "v1"], [9, 9, 7]
PLANS = {
    "row_wise": lambda t: row_wise(),
    "table_wise": lambda t: table_wise(rank=int(t == "v")),
    "data_parallel": lambda t: data_parallel(),
}
STEPS = 3


def _bags(rank: int, step: int) -> list[list[list[int]]]:
    """Per feature, the rank's bags of ids (repeats likely: few rows)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    b = 2 + rank
    return [[torch.randint(0, ROWS[f], (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist()
             for _ in range(b)] for f in range(len(KEYS))]  # fmt: skip


def _coef(rank: int, step: int) -> torch.Tensor:
    return torch.randn(2 + rank, 24, generator=torch.Generator().manual_seed(7 + 100 * step + rank))


def _kjt(bags: list[list[list[int]]]) -> KeyedJaggedTensor:
    lengths = [len(bag) for feature in bags for bag in feature]
    values = [i for feature in bags for bag in feature for i in bag]
    return KeyedJaggedTensor(KEYS, torch.tensor(values, dtype=torch.long), lengths=torch.tensor(lengths))


def _union(ws: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Feature-major values / offsets of every rank's samples (rank 0's first), as one kernel's batch."""
    per_rank = [_bags(r, step) for r in range(ws)]
    bags = [bag for f in range(len(KEYS)) for r in range(ws) for bag in per_rank[r][f]]
    offsets = torch.tensor([0, *(len(bag) for bag in bags)]).cumsum(0)
    return torch.tensor([i for bag in bags for i in bag], dtype=torch.long), offsets


def _job(rank: int, ws: int, kind: str, types: list[str]) -> dict:
    spec = {"kind": kind, "lr": 0.05, "betas": (0.8, 0.95), "weight_decay": 0.01}
    got = {}
    for sharding in types:
        torch.manual_seed(0)
        model = EmbeddingBagCollection(TABLES, kernel="torch")
        w0 = [model.state_dict()[f"embedding_bags.{t.name}.weight"].clone() for t in TABLES]
        plan = ShardingPlan({"": {t.name: PLANS[sharding](t.name) for t in TABLES}})
        sharded = shard_modules(model, plan, local_size=2, embedding_optimizer=spec)
        opt = fused_optimizer(sharded)
        ref = FusedPooledKernel(
            [(t.name, t.num_embeddings, 8, torch.float32) for t in TABLES], [0, 0, 1], spec, weights=w0
        )
        ref_opt = FusedOptimizer(ref)
        for step in range(STEPS):
            out = sharded(_kjt(_bags(rank, step))).values()
            (out * _coef(rank, step)).sum().backward()
            opt.step()
            ref_out = ref(*_union(ws, step))
            (ref_out * torch.cat([_coef(r, step) for r in range(ws)])).sum().backward()
            ref_opt.step()
        state = full_state_dict(sharded)
        for t, want in zip(TABLES, ref.tables()):
            key = f"embedding_bags.{t.name}.weight"
            torch.testing.assert_close(
                state[key], want.detach(), atol=1e-6, rtol=1e-6, msg=lambda m, k=key: f"{kind} {sharding} {k}: {m}"
            )
        assert all(g["iter"] == STEPS for g in opt.state_dict()["param_groups"] if "iter" in g)
        got[sharding] = True
    return got


@pytest.mark.parametrize("kind", ["adam", "partial_rowwise_lamb"])
def test_sharded_fused_adam_on_cpu_matches_one_kernel(kind: str) -> None:
    for r in run_distributed(_job, 2, kind, list(PLANS), timeout_s=300):
        assert list(r) == list(PLANS)
