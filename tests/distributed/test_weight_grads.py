"""Per-sample weights that need a gradient (a feature processor's learned weights) get, under every plan, the
gradient one process computes with plain ``F.embedding_bag``.

They take their own paths: a differentiable all-to-all to the shard owners (model-parallel tables), and for
fused data-parallel tables a differentiable gather into the union batch (``pipeline/fused_lookup.py``).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from lightning_rec.sharding import ShardingPlan, column_wise, data_parallel, row_wise, shard_modules, table_wise
from lightning_rec.testing import run_distributed

BATCH = 3


def _plan(kind: str, ws: int) -> dict:
    return {
        "row_wise": {"t0": row_wise(), "t1": row_wise()},
        "column_wise": {"t0": column_wise(list(range(ws))), "t1": column_wise(list(range(ws)))},
        "data_parallel": {"t0": data_parallel(), "t1": data_parallel()},
        "mixed": {"t0": table_wise(ws - 1), "t1": data_parallel()},
    }[kind]


def _weight_grad_job(rank: int, ws: int, kind: str, fused: bool) -> dict:
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(10, 8, "t0", ["a"]), EmbeddingBagConfig(7, 16, "t1", ["b"])]
    ebc = EmbeddingBagCollection(tables, is_weighted=True, kernel="torch")
    init = {t.name: ebc.embedding_bags[t.name].weight.detach().clone() for t in tables}
    model = shard_modules(
        ebc, ShardingPlan({"": _plan(kind, ws)}), embedding_optimizer={"kind": "sgd", "lr": 0.1} if fused else None
    )
    g = torch.Generator().manual_seed(100 + rank)
    lengths = torch.randint(0, 4, (2 * BATCH,), generator=g)
    n_a, n_b = int(lengths[:BATCH].sum()), int(lengths[BATCH:].sum())
    values = torch.cat([torch.randint(0, 10, (n_a,), generator=g), torch.randint(0, 7, (n_b,), generator=g)])
    w = torch.rand(n_a + n_b, generator=g).requires_grad_()
    coef = torch.randn(BATCH, 24, generator=g)
    out = model(KeyedJaggedTensor(["a", "b"], values, lengths=lengths, weights=w)).values()
    (out * coef).sum().backward()

    # one process: this rank's samples against the unsharded initial tables (the forward reads them before
    # any update, and a rank's weights only feed its own samples)
    ref_w = w.detach().clone().requires_grad_()
    pieces, start = [], 0
    for f, (name, n) in enumerate([("t0", n_a), ("t1", n_b)]):
        lens = lengths[f * BATCH : (f + 1) * BATCH]
        offsets = torch.cat([lens.new_zeros(1), lens.cumsum(0)[:-1]])
        pieces.append(
            F.embedding_bag(
                values[start : start + n], init[name], offsets, mode="sum", per_sample_weights=ref_w[start : start + n]
            )
        )
        start += n
    ref_out = torch.cat(pieces, dim=1)
    (ref_out * coef).sum().backward()
    return {
        "out": (out.detach() - ref_out.detach()).abs().max().item(),
        "grad": (w.grad - ref_w.grad).abs().max().item(),
        "grad_norm": ref_w.grad.abs().max().item(),
    }


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kind", ["row_wise", "column_wise", "data_parallel", "mixed"])
def test_per_sample_weight_gradients_match_one_process(kind: str, fused: bool) -> None:
    for res in run_distributed(_weight_grad_job, 2, kind, fused, timeout_s=60):
        assert res["out"] < 1e-5 and res["grad"] < 1e-5, res
        assert res["grad_norm"] > 0  # the comparison is not of zeros
