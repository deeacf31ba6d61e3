"""Sharded embedding training on 2 CPU processes, checked against the same training on one process.

Six tables, one per sharding type, train a tiny click model for a few SGD steps on synthetic data.
Every rank trains on its own batch; the script then gathers the sharded tables and compares them with
a single process that trained the unsharded collection on the concatenated global batch.

    python examples/sharded_lookup_demo.py [--world-size 2] [--steps 20]
"""

from __future__ import annotations

import argparse
import copy
import time

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
    table_row_wise,
    table_wise,
)
from lightning_rec.testing import run_distributed

TABLES = [
    EmbeddingBagConfig(name="user", num_embeddings=5_000, embedding_dim=16, feature_names=["user_id"]),
    EmbeddingBagConfig(
        name="item", num_embeddings=20_000, embedding_dim=16, feature_names=["item_id", "clicked_items"], pooling="mean"
    ),
    EmbeddingBagConfig(name="category", num_embeddings=100, embedding_dim=16, feature_names=["category"]),
    EmbeddingBagConfig(name="city", num_embeddings=1_000, embedding_dim=16, feature_names=["city"]),
    EmbeddingBagConfig(
        name="query terms", num_embeddings=8_000, embedding_dim=16, feature_names=["query"], pooling="mean"
    ),
    EmbeddingBagConfig(name="ad.campaign", num_embeddings=3_000, embedding_dim=16, feature_names=["campaign"]),
]
BATCH, LR = 256, 0.05


def plan(world_size: int) -> ShardingPlan:
    return ShardingPlan(
        {
            "ebc": {
                "user": row_wise(),
                "item": table_row_wise(host_index=0),
                "category": data_parallel(),
                "city": table_wise(rank=world_size - 1),
                "query terms": column_wise(ranks=list(range(world_size))[:2]),
                "ad.campaign": grid_shard(host_indexes=[0]),
            }
        }
    )


class ClickModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(TABLES)
        self.head = torch.nn.Linear(7 * 16, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.head(self.ebc(kjt).values()).squeeze(1)


def make_batch(rank: int, step: int) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    keys, lengths, values = [], [], []
    for t in TABLES:
        for f in t.feature_names:
            lens = torch.randint(0, 6 if f in ("clicked_items", "query") else 2, (BATCH,), generator=g)
            zipf = (torch.rand(int(lens.sum()), generator=g) ** 3 * t.num_embeddings).long()  # skewed ids
            keys.append(f)
            lengths.append(lens)
            values.append(zipf)
    labels = (torch.rand(BATCH, generator=g) < 0.3).float()
    return KeyedJaggedTensor(keys, torch.cat(values), lengths=torch.cat(lengths)), labels


def train(rank: int, world_size: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = ClickModel()
    reference = copy.deepcopy(model)
    model = shard_modules(model, plan(world_size), local_size=world_size)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    start = time.perf_counter()
    for step in range(steps):
        kjt, labels = make_batch(rank, step)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(kjt), labels)
        opt.zero_grad()
        loss.backward()
        # dense parameters follow DDP (averaged); embeddings follow embedding_grad="sum"
        for p in model.head.parameters():
            torch.distributed.all_reduce(p.grad)
            p.grad /= world_size
        opt.step()
    seconds = time.perf_counter() - start
    sharded_state = full_state_dict(model)
    if rank != 0:
        return {}
    # the reference: one process, every rank's batch; per-rank losses summed (embedding_grad="sum"),
    # dense gradients averaged as DDP does
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(steps):
        ref_opt.zero_grad()
        for r in range(world_size):
            kjt, labels = make_batch(r, step)
            torch.nn.functional.binary_cross_entropy_with_logits(reference(kjt), labels).backward()
        for p in reference.head.parameters():
            p.grad /= world_size
        ref_opt.step()
    ref_state = reference.state_dict()
    err = max(float((sharded_state[k] - ref_state[k]).abs().max()) for k in ref_state)
    return {"seconds": seconds, "max_err": err, "loss": loss.item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    print(plan(args.world_size))
    res = run_distributed(train, args.world_size, args.steps)[0]
    samples = args.steps * BATCH * args.world_size
    print(
        f"trained {args.steps} steps on {args.world_size} processes: {samples / res['seconds']:.0f} samples/s, "
        f"last loss {res['loss']:.4f}"
    )
    print(f"max |sharded - single-process| over all weights after training: {res['max_err']:.2e}")
    if res["max_err"] > 1e-4:
        raise SystemExit("sharded training diverged from the single-process reference")
    print("OK: sharded training matches single-process training")


if __name__ == "__main__":
    main()
