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
