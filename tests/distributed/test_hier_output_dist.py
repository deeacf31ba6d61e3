"""The hierarchical pooled output dist (issue 46) on 4 gloo ranks laid out as 2 hosts x 2 ranks
(``LOCAL_WORLD_SIZE=2``, the host rule of ``transport.host_of`` and ``plans/mesh.py``).

Every sharding type and mixed plans train equal to one process on the global batch with the host blocks on
(forced for the types where ``auto`` keeps the flat exchange, so the path serves every layout), and the
transport's byte accounting shows the cross-host output-dist bytes at the analytic least for the row-block
layouts (``host_output_dist.cross_host_elements``), against the flat exchange's count with
``LIGHTNING_REC_OUTPUT_DIST=flat``. The same code on simulated hosts with their own network:
``test_hosts_network.py`` (its ``all_types`` phase runs with the default, ``auto``).
"""

from __future__ import annotations

import os
import random
from typing import Any
from unittest import mock

import pytest
import torch

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from lightning_rec.pipeline.host_output_dist import cross_host_elements
from lightning_rec.pipeline.output_dist import ENV, OutputDistKind
from lightning_rec.sharding import (
    ShardingPlan,
    grid_shard,
    row_wise,
    shard_modules,
    sharded_collections,
    table_row_wise,
    table_wise,
)
from lightning_rec.testing import run_distributed
from lightning_rec.transport import accounting
from tests.distributed import test_sharded_equivalence
from tests.distributed.cases import ALL_TYPES, random_case, random_placement
from tests.distributed.test_sharded_equivalence import _check_case

WORLD, PER_HOST = 4, 2
HOSTS = [r // PER_HOST for r in range(WORLD)]


def _hierarchical(model: Any) -> int:
    """How many of the model's collections run the host blocks (their output dist's kind, fixed when built)."""
    return sum(
        1 for _, c in sharded_collections(model) if getattr(c, "output_dist_kind", None) is OutputDistKind.HIERARCHICAL
    )


def _case(seed: int, kinds: tuple[str, ...]) -> dict:
    case = random_case(seed, WORLD, types=kinds)
    case["local_size"] = PER_HOST
    rng = random.Random(seed + 1)
    for t in case["tables"]:
        case["plan"][t.name] = random_placement(
            rng, rng.choice(kinds), t.num_embeddings, t.embedding_dim, WORLD, PER_HOST
        )
    return case


def _equivalence_job(rank: int, ws: int, runs: list[tuple[int, tuple[str, ...], str]]) -> list[dict]:
    out = []
    built: list[Any] = []

    def shard_and_keep(*args: Any, **kwargs: Any) -> Any:
        built.append(shard_modules(*args, **kwargs))
        return built[-1]

    for seed, kinds, mode in runs:
        os.environ[ENV] = mode
        built.clear()
        with mock.patch.object(test_sharded_equivalence, "shard_modules", shard_and_keep):
            got = _check_case(rank, ws, _case(seed, kinds), sequence=False)
        out.append({"seed": seed, "worst": got["worst"], "hierarchical": sum(_hierarchical(m) for m in built)})
    built.clear()
    return out


_RUNS = [(4600 + 10 * i + j, (kind,), "hierarchical") for i, kind in enumerate(ALL_TYPES) for j in range(2)] + [
    (4700 + i, ALL_TYPES, "auto") for i in range(6)
]


def test_every_type_and_mixed_plans_train_equal_to_one_process_with_host_blocks() -> None:
    results = run_distributed(_equivalence_job, WORLD, _RUNS, ranks_per_node=PER_HOST, timeout_s=400)
    for rank, cases in enumerate(results):
        for (seed, kinds, mode), got in zip(_RUNS, cases):
            if mode == "hierarchical" and kinds != ("data_parallel",):
                assert got["hierarchical"] >= 1, (rank, seed, kinds, got)


def _table(i: int, dim: int) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(name=f"t{i}", num_embeddings=40 + i, embedding_dim=dim, feature_names=[f"f{i}"])


_BYTE_PLANS = {
    "row_wise": lambda i: row_wise(),
    "table_row_wise": lambda i: table_row_wise(i % 2),
    "grid_shard": lambda i: grid_shard([0, 1]),
    "mixed": lambda i: (row_wise(), table_row_wise(1), grid_shard([1, 0]), table_wise(3))[i % 4],
}
BATCH = (3, 0, 5, 2)


def _bytes_job(rank: int, ws: int, kind: str, mode: str) -> dict:
    os.environ[ENV] = mode  # read when the collection (its output dist) is built
    tables = [_table(i, 8 if i % 2 else 4) for i in range(4)]
    torch.manual_seed(0)
    plan = ShardingPlan({"": {t.name: _BYTE_PLANS[kind](i) for i, t in enumerate(tables)}})
    model = shard_modules(EmbeddingBagCollection(tables), plan, local_size=PER_HOST)
    routing = next(c for _, c in sharded_collections(model)).routing
    g = torch.Generator().manual_seed(rank)
    lengths = torch.randint(1, 4, (len(tables) * BATCH[rank],), generator=g)
    values = torch.cat(
        [
            torch.randint(0, t.num_embeddings, (int(n),), generator=g)
            for t, n in zip(tables, lengths.view(len(tables), -1).sum(1))
        ]
    )
    kjt = KeyedJaggedTensor([t.feature_names[0] for t in tables], values, lengths=lengths, stride=BATCH[rank])
    accounting.reset()
    with accounting.counting():
        model(kjt).values().pow(2).sum().backward()
    counts = accounting.cross_host_bytes(accounting.gather_byte_counts())
    return {
        "fwd": counts.get("output_dist_fwd", 0),
        "bwd": counts.get("output_dist_bwd", 0),
        "flat": 4 * cross_host_elements(routing, HOSTS, BATCH, flat=True),
        "least": 4 * cross_host_elements(routing, HOSTS, BATCH, flat=False),
        "hierarchical": _hierarchical(model),
    }


@pytest.mark.parametrize("kind", ["row_wise", "table_row_wise", "grid_shard", "mixed"])
def test_cross_host_output_dist_bytes_are_the_least_with_host_blocks(kind: str) -> None:
    hier = run_distributed(_bytes_job, WORLD, kind, "auto", ranks_per_node=PER_HOST)[0]
    flat = run_distributed(_bytes_job, WORLD, kind, "flat", ranks_per_node=PER_HOST)[0]
    assert hier["hierarchical"] == 1 and flat["hierarchical"] == 0
    assert hier["least"] < hier["flat"], hier  # these layouts hold columns twice on a host
    assert hier["fwd"] == hier["bwd"] == hier["least"], hier
    assert flat["fwd"] == flat["bwd"] == flat["flat"], flat
