"""Random tables, plans and batches for the equivalence tests, reproducible from a seed on every rank."""

from __future__ import annotations

import random

import torch

from lightning_rec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor
from lightning_rec.sharding import (
    ParameterSharding,
    column_wise,
    data_parallel,
    grid_shard,
    row_wise,
    table_row_wise,
    table_wise,
)

ALL_TYPES = ("data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "grid_shard")
# row-wise Adagrad keeps one statistic per row of a shard: column shards change its math, the others do not
ROW_WHOLE_TYPES = ("data_parallel", "table_wise", "row_wise", "table_row_wise")


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def random_placement(
    rng: random.Random, kind: str, rows: int, dim: int, ws: int, local: int, min_width: int = 1
) -> ParameterSharding:
    hosts = ws // local
    if kind == "data_parallel":
        return data_parallel()
    if kind == "table_wise":
        return table_wise(rng.randrange(ws))
    if kind == "row_wise":
        if rng.random() < 0.4:
            cuts = sorted(rng.randint(0, rows) for _ in range(ws - 1))
            sizes = [b - a for a, b in zip([0] + cuts, cuts + [rows])]
            return row_wise(sizes)
        return row_wise()
    if kind == "column_wise":
        n = rng.choice([d for d in _divisors(dim, ws) if dim // d >= min_width])
        return column_wise(rng.sample(range(ws), n))
    if kind == "table_row_wise":
        return table_row_wise(rng.randrange(hosts))
    if kind == "grid_shard":
        n = rng.choice([d for d in _divisors(dim, hosts) if dim // d >= min_width])
        return grid_shard(rng.sample(range(hosts), n))
    raise ValueError(kind)


def random_case(
    seed: int,
    ws: int,
    sequence: bool = False,
    types: tuple[str, ...] = ALL_TYPES,
    world: int | None = None,
    fused: bool = False,
) -> dict:
    """A random case whose plan is for a model-parallel group of ``ws`` ranks, batches for ``world`` ranks.

    ``fused``: only what fbgemm's fused kernel holds (widths that are multiples of 4).
    """
    rng = random.Random(seed)
    local = rng.choice([d for d in range(1, ws + 1) if ws % d == 0])
    n_tables = rng.randint(1, 5)
    tables, plan, features = [], {}, []
    for i in range(n_tables):
        rows = rng.choice([1, 2, 3, 5, 7, 10, 12]) if rng.random() < 0.5 else rng.randint(1, ws + 2)
        dim = rng.choice([4, 8] if fused else [2, 4, 6, 8])  # fbgemm's fused kernel needs widths % 4 == 0
        feats = [f"t{i} f{j}.x" for j in range(rng.randint(1, 2))]
        features += feats
        name = f"table.{i} ü"
        if sequence:
            tables.append(EmbeddingConfig(name=name, num_embeddings=rows, embedding_dim=dim, feature_names=feats))
        else:
            tables.append(
                EmbeddingBagConfig(
                    name=name,
                    num_embeddings=rows,
                    embedding_dim=dim,
                    feature_names=feats,
                    pooling=rng.choice(["sum", "mean"]),
                )
            )
        plan[name] = random_placement(rng, rng.choice(types), rows, dim, ws, local, min_width=4 if fused else 1)
    return dict(
        tables=tables,
        plan=plan,
        local_size=local,
        weighted=(not sequence) and rng.random() < 0.4,
        embedding_grad=rng.choice(["sum", "mean"]),
        sparse_grad=rng.random() < 0.3,
        batch_sizes=[rng.choice([0, 1, 2, 3, 5]) for _ in range(world or ws)],
        # learned per-sample weights (a feature processor's) take their own differentiable paths
        weights_grad=rng.random() < 0.5,
        unread_feature=rng.random() < 0.5,
        seed=seed,
    )


def batch(case: dict, rank: int, step: int) -> KeyedJaggedTensor:
    """Rank ``rank``'s batch at ``step``; every rank can build every other rank's batch."""
    g = torch.Generator().manual_seed(case["seed"] * 1000 + step * 10 + rank)
    b = case["batch_sizes"][rank]
    keys, lengths, values = [], [], []
    for t in case["tables"]:
        for f in t.feature_names:
            keys.append(f)
            lens = torch.randint(0, 4, (b,), generator=g)
            lengths.append(lens)
            values.append(torch.randint(0, t.num_embeddings, (int(lens.sum()),), generator=g))
    if case.get("unread_feature"):
        # a key no table reads (the batch carries features for other modules): ignored, sharded or not
        keys.append("unread ✓")
        lens = torch.randint(0, 3, (b,), generator=g)
        lengths.append(lens)
        values.append(torch.randint(0, 1000, (int(lens.sum()),), generator=g))
    lengths_t, values_t = torch.cat(lengths), torch.cat(values)
    weights = torch.rand(values_t.numel(), generator=g) if case["weighted"] else None
    if weights is not None and case.get("weights_grad"):
        weights.requires_grad_()
    # hand the features over in a shuffled key order: the collection must reorder them
    kjt = KeyedJaggedTensor(keys, values_t, weights=weights, lengths=lengths_t, stride=b)
    perm = list(range(len(keys)))
    random.Random(case["seed"] + step).shuffle(perm)
    return kjt.permute(perm)


def loss_coefficients(case: dict, rank: int, step: int, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(case["seed"] * 7919 + step * 31 + rank)
    return torch.randn(*shape, generator=g)
