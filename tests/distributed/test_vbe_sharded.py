"""Variable batch size per feature (TorchRec's VBE, with inverse_indices) through table-wise and row-wise shards."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from lightning_rec.sharding import ShardingPlan, row_wise, shard_modules, table_wise
from lightning_rec.testing import run_distributed


def _vbe_job(rank: int, ws: int, kind: str) -> tuple[list[list[float]], list[list[float]]]:
    tables = [
        EmbeddingBagConfig(name="t1", num_embeddings=8, embedding_dim=4, feature_names=["f0"]),
        EmbeddingBagConfig(name="t2", num_embeddings=8, embedding_dim=4, feature_names=["f1"], pooling="mean"),
    ]
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables, kernel="torch")
    ref = copy.deepcopy(ebc)
    if kind == "table_wise":
        plan = ShardingPlan({"": {"t1": table_wise(0), "t2": table_wise(ws - 1)}})
    else:
        plan = ShardingPlan({"": {"t1": row_wise(), "t2": row_wise()}})
    sharded = shard_modules(ebc, plan)
    # f0 has 2 distinct bags, f1 has 3 (rank-dependent ids); a batch of 4 samples reads them by inverse_indices
    g = torch.Generator().manual_seed(rank)
    values = torch.randint(0, 8, (6,), generator=g)
    kjt = KeyedJaggedTensor(
        ["f0", "f1"],
        values,
        lengths=torch.tensor([2, 1, 1, 0, 2]),
        stride_per_key_per_rank=[[2], [3]],
        inverse_indices=(["f0", "f1"], torch.tensor([[0, 1, 1, 0], [2, 0, 1, 2]])),
    )
    return sharded(kjt).values().tolist(), ref(kjt).values().tolist()


@pytest.mark.parametrize("kind", ["table_wise", "row_wise"])
def test_vbe_sharded_equals_unsharded(kind: str) -> None:
    for got, want in run_distributed(_vbe_job, 2, kind):
        assert len(got) == 4  # the full batch, as the unsharded collection gives
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-6, rtol=1e-6)
