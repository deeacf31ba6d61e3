"""lightning_rec.checkpoint without Lightning: fused row-wise optimizer state across column splits.

(Plain full state_dicts loading into sharded models: tests/distributed/test_sharded_cases.py.)
"""

from __future__ import annotations

import torch

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, ShardingPlan
from lightning_rec import checkpoint as ckpt
from lightning_rec.sharding import column_wise, fused_optimizer, row_wise, shard_modules, table_wise
from lightning_rec.testing import run_distributed

TABLES = [EmbeddingBagConfig(name="wide.t", num_embeddings=6, embedding_dim=8, feature_names=["f"]),
          EmbeddingBagConfig(name="other", num_embeddings=5, embedding_dim=4, feature_names=["g"])]
SPEC = {"kind": "rowwise_adagrad", "lr": 0.5}


def _batch(rank: int, ws: int) -> KeyedJaggedTensor:
    # the global batch is 4 bags per feature; rank r holds bags [r * 4 / ws, (r + 1) * 4 / ws)
    ids = {"f": [[0, 1], [2], [1, 5], [3]], "g": [[4], [0, 1], [2], []]}
    per = 4 // ws
    bags = {k: v[rank * per:(rank + 1) * per] for k, v in ids.items()}
    lengths = torch.tensor([len(b) for k in ("f", "g") for b in bags[k]])
    values = torch.tensor([i for k in ("f", "g") for b in bags[k] for i in b])
    return KeyedJaggedTensor(["f", "g"], values, lengths=lengths)


def _step(model, rank: int, ws: int) -> None:
    out = model(_batch(rank, ws)).values()
    (out * torch.arange(1, out.shape[1] + 1)).pow(2).mean().backward()
    fused_optimizer(model).step()


def _fused(plan: dict):
    torch.manual_seed(0)
    model = shard_modules(EmbeddingBagCollection(TABLES), ShardingPlan({"": plan}), embedding_grad="mean",
                          embedding_optimizer=SPEC)
    return model, fused_optimizer(model)


def _states(opt) -> dict:
    return {name: {k: v.clone() for k, v in st.items()} for name, st in opt.state_dict()["tables"].items()}


def _column_split_job(rank: int, ws: int, path: str) -> bool:
    """One step with the wide table in two column shards; save; a fresh model loads each shard's own state."""
    cw = {"wide.t": column_wise([1, 0]), "other": row_wise()}
    model, opt = _fused(cw)
    _step(model, rank, ws)
    ckpt.save(path, model, [opt])
    fresh, fresh_opt = _fused(cw)
    ckpt.load(path, fresh, [fresh_opt])
    before, after = _states(opt), _states(fresh_opt)
    return all(torch.equal(after[n]["sum"], before[n]["sum"]) for n in before) and bool(before)


def _whole_table_job(rank: int, ws: int, path: str) -> tuple[dict, dict]:
    whole = {"wide.t": table_wise(0), "other": table_wise(0)}
    model, opt = _fused(whole)
    _step(model, rank, ws)
    loaded, loaded_opt = _fused(whole)
    ckpt.load(path, loaded, [loaded_opt])
    return _states(opt), _states(loaded_opt)


def test_rowwise_state_merges_column_shards_exactly_and_roundtrips(tmp_path) -> None:
    saved = str(tmp_path / "cw")
    assert run_distributed(_column_split_job, 2, saved) == [True, True]
    # one process, whole table: the merged statistic equals the one an unsharded step computes
    reference, merged = run_distributed(_whole_table_job, 1, saved)[0]
    for name in reference:
        torch.testing.assert_close(merged[name]["sum"], reference[name]["sum"], atol=1e-6, rtol=1e-5)
    assert reference["wide.t"]["sum"].abs().sum() > 0
