"""Fused optimizers on sequence collections (issue 44 item 2): an ``EmbeddingCollection`` whose tables update inside
backward through no-bag fused kernels equals one process whose torch optimizer steps the same global batch, for
every sharding type the sequence path supports, with a data-parallel table (the union rule) and under 2D replicas;
every copy of a table holds the same bits and optimizer state."""

from __future__ import annotations

import pytest
import torch

from lightning_rec.plans.mesh import init_2d_mesh
from lightning_rec.sharding import data_parallel
from lightning_rec.testing import run_distributed
from tests.distributed.cases import ALL_TYPES, ROW_WHOLE_TYPES, random_case
from tests.distributed.test_sharded_equivalence import _check_case


def _job(rank: int, ws: int, runs: list[tuple[int, str]], model_parallel_size: int | None) -> list[dict]:
    mesh = init_2d_mesh(model_parallel_size) if model_parallel_size else None
    mp = model_parallel_size or ws
    out = []
    for i, (seed, kind) in enumerate(runs):
        types = ROW_WHOLE_TYPES if kind == "rowwise_adagrad" else ALL_TYPES
        case = random_case(seed, mp, sequence=True, types=types, world=ws, fused=True)
        first = case["tables"][0]
        case["plan"][first.name] = data_parallel()  # every case holds a data-parallel table: the union rule
        case["embedding_grad"] = ("sum", "mean")[i % 2]
        out.append({**_check_case(rank, ws, case, True, mesh, fused=kind), "dp": first.name})
    return out


def _assert_copies_identical(results: list[list[dict]], model_parallel_size: int) -> None:
    for r, per_case in enumerate(results):
        peer = r % model_parallel_size  # the same shard rank in the first replica group
        for i, (mine, theirs) in enumerate(zip(per_case, results[peer])):
            for n, w in mine["local"].items():
                assert torch.equal(w, theirs["local"][n]), f"case {i}: rank {r} and rank {peer} differ in {n}"
            for t, st in mine["state"].items():
                for k, v in st.items():
                    assert torch.equal(v, theirs["state"][t][k]), f"case {i}: optimizer state {t}/{k} differs"
    for i, first in enumerate(results[0]):
        key = f"embeddings.{first['dp']}.weight"
        for r, res in enumerate(results):
            assert torch.equal(res[i]["local"][key], first["local"][key]), f"case {i}: rank {r} differs in {key}"


@pytest.mark.parametrize("ws, kinds", [(2, ("sgd", "rowwise_adagrad")), (3, ("adagrad", "sgd"))])
def test_fused_sequence_training_equals_single_process(ws: int, kinds: tuple[str, ...]) -> None:
    runs = [(2300 + 10 * ws + i, kinds[i % len(kinds)]) for i in range(4)]
    _assert_copies_identical(run_distributed(_job, ws, runs, None, timeout_s=300), ws)


@pytest.mark.slow
def test_fused_sequence_2d_replicas_equal_single_process() -> None:
    runs = [(2500 + i, kind) for i, kind in enumerate(["sgd", "rowwise_adagrad", "adagrad"])]
    _assert_copies_identical(run_distributed(_job, 4, runs, 2, timeout_s=300), 2)


SEQ_SPECS = {"s0": ("sgd", 0.3), "s1": ("rowwise_adagrad", 0.5), "s2": ("adagrad", 0.2), "s3": ("rowwise_adagrad", 0.5)}


def _mixed_job(rank: int, ws: int, parts: int) -> None:
    import copy

    from lightning_rec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor, PerTableOptimizers
    from lightning_rec.sharding import (
        ShardingPlan,
        column_wise,
        full_state_dict,
        fused_optimizer,
        row_wise,
        shard_modules,
        table_wise,
    )
    from tests.distributed.test_sharded_equivalence import _RowwiseAdagrad

    rows = {"s0": 9, "s1": 11, "s2": 7, "s3": 6}
    dims = {"s0": 8, "s1": 8, "s2": 4, "s3": 8}
    torch.manual_seed(0)
    model = EmbeddingCollection(
        [EmbeddingConfig(name=n, num_embeddings=rows[n], embedding_dim=dims[n], feature_names=[f"f{n}"]) for n in rows]
    )
    ref = copy.deepcopy(model)
    plan = ShardingPlan({"": {"s0": column_wise([1, 0]), "s1": row_wise(), "s2": data_parallel(), "s3": table_wise(1)}})
    specs = {n: {"kind": k, "lr": lr, "eps": 1e-8} for n, (k, lr) in SEQ_SPECS.items()}
    sharded = shard_modules(model, plan, embedding_optimizer=PerTableOptimizers(tables=specs))
    opt = fused_optimizer(sharded)
    assert opt is not None
    opt.accumulate = parts > 1
    ref_opts = {}
    for n, (kind, lr) in SEQ_SPECS.items():
        p = [ref.embeddings[n].weight]
        ref_opts[n] = (
            torch.optim.SGD(p, lr=lr)
            if kind == "sgd"
            else _RowwiseAdagrad(p, lr=lr, eps=1e-8)
            if kind == "rowwise_adagrad"
            else torch.optim.Adagrad(p, lr=lr, eps=1e-8, initial_accumulator_value=0.0)
        )

    def batch(r: int, step: int, part: int) -> KeyedJaggedTensor:
        g = torch.Generator().manual_seed(100 * step + 10 * part + r)
        b = 2 + r
        lengths = torch.randint(0, 4, (len(rows) * b,), generator=g)
        values = torch.cat(
            [
                torch.randint(0, rows[n], (int(lengths[i * b : (i + 1) * b].sum()),), generator=g)
                for i, n in enumerate(rows)
            ]
        )
        return KeyedJaggedTensor([f"f{n}" for n in rows], values, lengths=lengths)

    def loss(m: torch.nn.Module, r: int, step: int, part: int) -> torch.Tensor:
        out = m(batch(r, step, part))
        total = torch.zeros(())
        for i, name in enumerate(sorted(out)):
            v = out[name].values()
            total = total + (v * torch.randn(v.shape, generator=torch.Generator().manual_seed(7 + i + r))).sum()
        return total

    for step in range(3):
        for part in range(parts):
            loss(sharded, rank, step, part).backward()
        opt.step()
        for o in ref_opts.values():
            o.zero_grad()
        for r in range(ws):
            for part in range(parts):
                loss(ref, r, step, part).backward()
        for o in ref_opts.values():
            o.step()
    got, want = full_state_dict(sharded), ref.state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=0, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("parts", [1, 4])
def test_sequence_tables_each_with_their_own_fused_optimizer(parts: int) -> None:
    run_distributed(_mixed_job, 2, parts, timeout_s=300)
