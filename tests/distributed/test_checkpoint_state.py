"""lightning_rec.checkpoint without Lightning: fused row-wise optimizer state.

(Column splits of a table with per-row optimizer state are refused at sharding time:
tests/distributed/test_sharded_agreement.py.)

(Plain full state_dicts loading into sharded models: tests/distributed/test_sharded_cases.py.)
"""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_rec import (
    CombinedOptimizer,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    ShardingPlan,
    full_state_dict,
)
from lightning_rec import checkpoint as ckpt
from lightning_rec.sharding import fused_optimizer, row_wise, shard_modules, table_wise
from lightning_rec.testing import run_distributed

TABLES = [
    EmbeddingBagConfig(name="wide.t", num_embeddings=6, embedding_dim=8, feature_names=["f"]),
    EmbeddingBagConfig(name="other", num_embeddings=5, embedding_dim=4, feature_names=["g"]),
]
SPEC = {"kind": "rowwise_adagrad", "lr": 0.5}


def _batch(rank: int, ws: int) -> KeyedJaggedTensor:
    # the global batch is 4 bags per feature; rank r holds bags [r * 4 / ws, (r + 1) * 4 / ws)
    ids = {"f": [[0, 1], [2], [1, 5], [3]], "g": [[4], [0, 1], [2], []]}
    per = 4 // ws
    bags = {k: v[rank * per : (rank + 1) * per] for k, v in ids.items()}
    lengths = torch.tensor([len(b) for k in ("f", "g") for b in bags[k]])
    values = torch.tensor([i for k in ("f", "g") for b in bags[k] for i in b])
    return KeyedJaggedTensor(["f", "g"], values, lengths=lengths)


def _states(opt) -> dict:
    return {name: {k: v.clone() for k, v in st.items()} for name, st in opt.state_dict()["tables"].items()}


class _TwoTowers(torch.nn.Module):
    """Two collections whose tables share names, as two towers often do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.query = EmbeddingBagCollection(TABLES)
        self.item = EmbeddingBagCollection(TABLES)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.query(kjt).values() * self.item(kjt).values()


def _two_towers_job(rank: int, ws: int, path: str) -> dict:
    plan = ShardingPlan({p: {"wide.t": row_wise(), "other": table_wise(ws - 1)} for p in ("query", "item")})
    model = shard_modules(_TwoTowers(), plan, embedding_grad="mean", embedding_optimizer=SPEC)
    opt = fused_optimizer(model)
    model(_batch(rank, ws)).pow(2).mean().backward()
    opt.step()
    ckpt.save(path, model, [opt])
    fresh = shard_modules(_TwoTowers(), plan, embedding_grad="mean", embedding_optimizer=SPEC)
    fresh_opt = fused_optimizer(fresh)
    ckpt.load(path, fresh, [fresh_opt])
    from lightning_rec import full_state_dict

    return {
        "keys": sorted(opt.state_dict()["tables"]),
        "weights": full_state_dict(model),
        "same_state": all(
            torch.equal(a["sum"], b["sum"]) for a, b in zip(_states(opt).values(), _states(fresh_opt).values())
        ),
    }


def test_fused_collections_may_share_table_names(tmp_path) -> None:
    results = run_distributed(_two_towers_job, 2, str(tmp_path / "towers"))
    # fused state is keyed by collection path + table name (rank 1 also holds both towers' "other")
    assert results[0]["keys"] == ["item.wide.t", "query.wide.t"]
    assert results[1]["keys"] == ["item.other", "item.wide.t", "query.other", "query.wide.t"]
    assert all(r["same_state"] for r in results)
    # the towers' tables trained separately: one process with plain row-wise Adagrad semantics agrees
    ref = _TwoTowers()
    weights = {n: p.detach().clone() for n, p in ref.named_parameters()}
    sums = {n: torch.zeros(p.shape[0]) for n, p in ref.named_parameters()}
    out = torch.cat([ref(_batch(r, 2)) for r in range(2)])
    grads = torch.autograd.grad(out.pow(2).mean(), list(ref.parameters()))
    for (n, _), g in zip(ref.named_parameters(), grads):
        sums[n] += g.pow(2).mean(1)
        weights[n] -= SPEC["lr"] * g / (sums[n].sqrt()[:, None] + 1e-8)
    for n, w in weights.items():
        torch.testing.assert_close(results[0]["weights"][n], w, atol=1e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")


# -- checkpoints users already have: the committed lightning_rec.dcp/1 fixture -------------------------------

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "v1_checkpoint"


def _fixture_model():
    from tests.lightning.models import ClickModule

    plan = ShardingPlan({"ebc": {"user": row_wise(), "item": table_wise(1), "geo": table_wise(0)}})
    model = shard_modules(
        ClickModule(), plan, embedding_grad="mean", embedding_optimizer={"kind": "rowwise_adagrad", "lr": 0.1}
    )
    return model, CombinedOptimizer([torch.optim.Adagrad(model.head.parameters(), lr=0.1), fused_optimizer(model)])


def _v1_fixture_job(rank: int, ws: int, out: str) -> dict:
    model, opt = _fixture_model()
    meta = ckpt.load(FIXTURE, model, [opt])  # the old format: row-wise state broadcast over columns
    sums = {n: st["sum"].clone() for n, st in fused_optimizer(model).state_dict()["tables"].items()}
    weights = full_state_dict(model)
    ckpt.save(out, model, [opt])  # today's format, then back: bitwise again
    fresh, fresh_opt = _fixture_model()
    ckpt.load(out, fresh, [fresh_opt])
    again = {n: st["sum"] for n, st in fused_optimizer(fresh).state_dict()["tables"].items()}
    return {
        "step": meta["global_step"],
        "sums": sums,
        "weights": weights,
        "again": again,
        "head_sum": opt.optimizers[0].state_dict()["state"][0]["sum"],
    }


def test_v1_fixture_resumes_bitwise_and_resaves_one_value_per_row(tmp_path) -> None:
    want = torch.load(FIXTURE.parent / "v1_checkpoint.expected.pt", weights_only=True)
    out = tmp_path / "v2"
    results = run_distributed(_v1_fixture_job, 2, str(out))
    for rank, r in enumerate(results):
        assert r["step"] == 4
        assert r["sums"].keys() == want["sums"][rank].keys() and r["sums"], r["sums"].keys()
        for name, s in want["sums"][rank].items():
            assert torch.equal(r["sums"][name], s), name
            assert torch.equal(r["again"][name], s), name
        for k, v in want["weights"].items():
            assert torch.equal(r["weights"][k], v), k
        assert r["head_sum"].abs().sum() > 0
    md = ckpt.storage.CheckedReader(out, 0).read_metadata().state_dict_metadata
    rows = {k: list(v.size) for k, v in md.items() if k.endswith("/sum") and "fused" in k}
    assert rows == {
        "optimizer_0.fused/ebc.embedding_bags.user.weight/sum": [11, 1],
        "optimizer_0.fused/ebc.embedding_bags.item.weight/sum": [13, 1],
        "optimizer_0.fused/ebc.embedding_bags.geo.weight/sum": [5, 1],
    }, rows
