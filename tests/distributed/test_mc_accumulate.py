"""Managed collision with gradient accumulation: a row given to a new id between micro-batches does not receive
the gradient its old id left there (torch optimizer on ``.grad``, and the fused kernel's kept gradients), at 1
and 2 processes, against a reference computed from the remaps by hand."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, ShardingPlan
from lightning_rec.mc import (
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    MCHManagedCollisionModule,
)
from lightning_rec.sharding import full_state_dict, fused_optimizer, row_wise, shard_modules
from lightning_rec.testing import run_distributed

# two ids per rank and micro-batch, buckets of 4 rows: every id is admitted (at most 4 new ids reach a bucket)
ROWS, DIM, BUCKETS = 8, 4, 2
MICRO_BATCHES, BAGS, IDS_PER_BAG = 6, 2, 1
LR = 0.5
KEY = "_embedding_module.embedding_bags.t.weight"


def _model() -> ManagedCollisionEmbeddingBagCollection:
    torch.manual_seed(0)
    cfg = EmbeddingBagConfig(name="t", num_embeddings=ROWS, embedding_dim=DIM, feature_names=["f"])
    ebc = EmbeddingBagCollection([cfg])
    mch = MCHManagedCollisionModule(ROWS, num_buckets=BUCKETS, eviction_policy=LRU_EvictionPolicy())
    mcc = ManagedCollisionCollection({"t": mch}, ebc.embedding_bag_configs())
    return ManagedCollisionEmbeddingBagCollection(ebc, mcc, return_remapped_features=True)


def _job(rank: int, ws: int, fused: bool) -> dict:
    plan = ShardingPlan({"_embedding_module": {"t": row_wise([ROWS // ws] * ws)}})
    model = shard_modules(_model(), plan, embedding_optimizer={"kind": "sgd", "lr": LR} if fused else None)
    if fused:
        opt = fused_optimizer(model)
        opt.accumulate = True
    else:
        opt = torch.optim.SGD(model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(10 + rank)
    seen = []
    for _ in range(MICRO_BATCHES):  # many raw ids for few rows: ids keep evicting each other
        ids = torch.randint(0, 20, (BAGS * IDS_PER_BAG,), generator=g)
        kjt = KeyedJaggedTensor(["f"], ids, lengths=torch.full((BAGS,), IDS_PER_BAG))
        out, remapped = model(kjt)
        coeff = torch.randn(out.values().shape, generator=g)
        (out.values() * coeff).sum().backward()
        seen.append((ids.tolist(), remapped.values().tolist(), coeff))
    before = full_state_dict(model)[KEY].clone()
    opt.step()
    after = full_state_dict(model)[KEY].clone()
    everyone: list = [None] * ws
    dist.all_gather_object(everyone, seen)
    return {"before": before, "after": after, "seen": everyone}


def _expected(before: torch.Tensor, seen: list) -> torch.Tensor:
    """SGD on the summed gradient, where a row's gradient counts only from micro-batches after the last one
    that gave the row to another id (SUM pooling: each id of a bag gets the bag's output gradient)."""
    owner: dict[int, int] = {}  # row -> raw id holding it, as of the micro-batch being read
    grad = torch.zeros_like(before)
    for k in range(MICRO_BATCHES):
        pairs = {(raw, row) for per_rank in seen for raw, row in zip(per_rank[k][0], per_rank[k][1])}
        assert len({row for _, row in pairs}) == len({raw for raw, _ in pairs}), f"micro-batch {k}: ids share rows"
        for per_rank in seen:
            ids, rows, coeff = per_rank[k]
            for i, (raw, row) in enumerate(zip(ids, rows)):
                if owner.get(row, raw) != raw:
                    grad[row] = 0  # the row changed hands: what the old id left there is not the new id's
                owner[row] = raw
                grad[row] += coeff[i // IDS_PER_BAG]
    return before - LR * grad


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused"])
@pytest.mark.parametrize("ws", [1, 2])
def test_a_row_taken_by_a_new_id_drops_the_old_ids_kept_gradient(ws: int, fused: bool) -> None:
    results = run_distributed(_job, ws, fused)
    r = results[0]
    changed_hands = _changed_hands(r["seen"])
    assert changed_hands, "the batches never gave a row to a new id between micro-batches: nothing was tested"
    want = _expected(r["before"], r["seen"])
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["after"], want, atol=1e-6, rtol=0, msg=lambda m: f"rank {rank}: {m}")


def _changed_hands(seen: list) -> int:
    owner: dict[int, int] = {}
    n = 0
    for k in range(MICRO_BATCHES):
        for per_rank in seen:
            for raw, row in zip(per_rank[k][0], per_rank[k][1]):
                n += owner.get(row, raw) != raw
                owner[row] = raw
    return n
