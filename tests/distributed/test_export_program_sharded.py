"""A model sharded over 2 gloo processes -> one torch.export program of the unsharded model, written by rank 0."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_rec import KeyedJaggedTensor, ShardingPlan, full_state_dict
from lightning_rec.checkpoint import CheckpointError
from lightning_rec.export import export_program
from lightning_rec.models import DLRM
from lightning_rec.sharding import column_wise, data_parallel, fused_optimizer, row_wise, shard_modules, table_wise
from lightning_rec.testing import run_distributed

CARDS = {"user.id": 23, "item": 31, "geo city": 8, "hist": 17}
PLAN = ShardingPlan(
    {
        "sparse_arch.embedding_bag_collection": {
            "user.id": row_wise(),
            "item": table_wise(rank=1),
            "geo city": column_wise(ranks=[1, 0]),
            "hist": data_parallel(),
        }
    }
)


def _model() -> DLRM:
    torch.manual_seed(0)
    return DLRM(
        num_dense=3,
        feature_names=list(CARDS),
        num_embeddings_per_feature=list(CARDS.values()),
        embedding_dim=8,
        dense_arch_layer_sizes=[8, 8],
        over_arch_layer_sizes=[8, 1],
        sparse_grad=False,
    )


def _batch(b: int, max_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (len(CARDS) * b,), generator=g)
    values = torch.cat(
        [
            torch.randint(0, n, (int(k),), generator=g)
            for n, k in zip(CARDS.values(), lengths.view(len(CARDS), b).sum(1))
        ]
    )
    return torch.randn(b, 3, generator=g), values, lengths


def _job(rank: int, ws: int, path: str, fused: bool) -> tuple | None:
    # fused: the tables are updated inside backward by fbgemm's kernel (the program still has none of it)
    # fused row-wise Adagrad refuses column splits (a row statistic per column shard would change the math):
    # the fused variant uses the element-wise kind, Adagrad
    spec = {"kind": "adagrad", "lr": 0.5} if fused else None
    model = shard_modules(_model(), PLAN, embedding_optimizer=spec)
    # a few SGD steps, each rank on its own batch, so the tables differ from their initial values
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for step in range(2):
        dense, values, lengths = _batch(5, 3, 10 * step + rank)
        model(dense, KeyedJaggedTensor(list(CARDS), values, lengths=lengths)).sum().backward()
        opt.step()
        opt.zero_grad()
        if fused:
            fused_optimizer(model).step()  # closes the fused kernels' step
    out = export_program(model, path)
    assert out == Path(path)
    state = full_state_dict(model, rank0_only=True)
    # a failure on rank 0 (here: keys that are no features) reaches every rank as an error, never a hang
    try:
        export_program(model, path + ".bad", keys=["nope"])
    except (ValueError, CheckpointError) as e:
        assert "nope" in str(e)
    else:
        raise AssertionError("export_program accepted unknown keys")
    # the sharded model's own answer on rank 0's batch of 3 (rank 1 looks up its batch alongside)
    batch = _batch(3 if rank == 0 else 4, 4, 500 + rank)
    with torch.no_grad():
        sharded_out = model(batch[0], KeyedJaggedTensor(list(CARDS), batch[1], lengths=batch[2]))
    return (state, batch, sharded_out) if rank == 0 else None


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["plain", "fused"])
def test_sharded_model_exports_the_unsharded_program(tmp_path: Path, fused: bool) -> None:
    path = tmp_path / "dlrm.pt2"
    # processes of their own (daemon=False is another pool): torch.export in a rank process that earlier ran
    # torch.compile and other jobs failed now and then inside torch (IndexError in make_constraints)
    state, batch, sharded_out = run_distributed(_job, 2, str(path), fused, daemon=False)[0]
    assert not (tmp_path / "dlrm.pt2.bad").exists()
    reference = _model()
    reference.load_state_dict(state)
    assert not torch.equal(
        reference.sparse_arch.embedding_bag_collection.embedding_bags["item"].weight,
        _model().sparse_arch.embedding_bag_collection.embedding_bags["item"].weight,
    )
    reference.eval()
    program = torch.export.load(path)
    assert "fbgemm" not in str(program.graph)
    program = program.module()
    torch.testing.assert_close(program(*batch), sharded_out)
    for seed, (b, n) in enumerate([(1, 2), (6, 0), (13, 5)]):
        dense, values, lengths = _batch(b, n, 100 + seed)
        with torch.no_grad():
            ref = reference(dense, KeyedJaggedTensor(list(CARDS), values, lengths=lengths))
        torch.testing.assert_close(program(dense, values, lengths), ref)
