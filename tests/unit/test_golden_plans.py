"""Golden plans: the planner's choices and estimates for fixed inputs, compared with a committed JSON file.

The file was written by the planner before it was split into a package and sped up, so this proves those
changes preserved behaviour: the same placement for every table, the same per-rank estimates, the same
report text. A deliberate change of the cost model or the search regenerates it:
``LIGHTNING_REC_REGEN_GOLDEN=1 python -m pytest tests/unit/test_golden_plans.py`` (and say why in the commit).
"""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from lightning_rec.sharding import (
    Planner,
    ShardingPlan,
    TableConstraint,
    Topology,
    column_wise,
    data_parallel,
    grid_shard,
    row_wise,
    table_row_wise,
    table_wise,
)

GOLDEN = Path(__file__).parent / "data" / "golden_plans.json"
REGEN = os.environ.get("LIGHTNING_REC_REGEN_GOLDEN") == "1"


def _mixed_tables(n: int, seed: int, dims=(16, 32, 64, 128), lo=1.0, hi=7.0, dtypes=(torch.float32,)):
    rng = random.Random(seed)
    tables = [
        EmbeddingBagConfig(
            int(10 ** rng.uniform(lo, hi)),
            rng.choice(dims),
            f"table {i}",
            [f"f{i}"] + ([f"g{i}"] if rng.random() < 0.2 else []),
            dtype=rng.choice(dtypes),
        )
        for i in range(n)
    ]
    pooling = {f: rng.choice([1, 1, 3, 20, 50]) for t in tables for f in t.feature_names}
    return tables, pooling


def _dlrm_cuda():
    tables, pooling = _mixed_tables(26, 1)
    p = Planner(
        Topology(8, 8, 4, device_memory="16GB", device="cuda"),
        batch_size=2048,
        pooling_factors=pooling,
        optimizer="rowwise_adagrad",
        gradients="fused",
    )
    return p, tables


def _dlrm_cpu_sparse():
    tables, pooling = _mixed_tables(26, 2, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    return Planner(Topology(2), batch_size=1024, pooling_factors=pooling, gradients="sparse"), tables


def _two_d_tight_memory():
    tables, pooling = _mixed_tables(20, 3, lo=4, hi=7.5)
    p = Planner(
        Topology(16, 8, 4, device_memory="3.5GB", device="cuda"),
        batch_size=512,
        pooling_factors=pooling,
        optimizer="adam",
        gradients="dense",
    )
    return p, tables


def _host_memory_offload():
    tables, pooling = _mixed_tables(12, 4, lo=6, hi=8)
    p = Planner(
        Topology(8, 8, 4, device_memory="4GB", host_memory="64GB", device="cuda"),
        batch_size=256,
        pooling_factors=pooling,
        optimizer="adagrad",
        gradients="sparse",
    )
    return p, tables


def _constraints_and_together():
    tables, pooling = _mixed_tables(10, 5, dims=(32, 64, 128))
    names = [t.name for t in tables]
    cons = {
        names[0]: TableConstraint(sharding_types=["column_wise"]),
        names[1]: TableConstraint(placement=table_wise(2)),
        names[2]: TableConstraint(sharding_types=["table_row_wise", "grid_shard"], allow_host_memory=False),
        names[3]: TableConstraint(sharding_types=["data_parallel"]),
    }
    p = Planner(
        Topology(4, 4, 2, device="cpu"),
        batch_size=128,
        pooling_factors=pooling,
        constraints=cons,
        together=[[names[4], names[5]], [names[6], names[7], names[8]]],
        min_column_width=16,
    )
    return p, tables


def _cluster():
    tables, pooling = _mixed_tables(150, 6, dims=(16, 32, 64, 128, 256), lo=3, hi=7.3)
    p = Planner(
        Topology(256, 256, 8, device_memory="80GB", host_memory="2TB", device="cuda"),
        batch_size=512,
        pooling_factors=pooling,
        optimizer="rowwise_adagrad",
        gradients="fused",
    )
    return p, tables


def _cluster_small_groups():
    tables, pooling = _mixed_tables(120, 7, dims=(16, 32, 64, 128, 256), lo=3, hi=7.3)
    p = Planner(
        Topology(1024, 8, 8, device_memory="80GB", device="cuda"),
        batch_size=512,
        pooling_factors=pooling,
        optimizer="rowwise_adagrad",
        gradients="fused",
    )
    return p, tables


class _TwoCollections(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sparse = EmbeddingBagCollection(
            [EmbeddingBagConfig(50_000, 64, "user", ["u"]), EmbeddingBagConfig(300, 16, "geo", ["geo"])],
            device="meta",
            sparse_grad=True,
        )
        self.seq = EmbeddingCollection(
            [EmbeddingConfig(80_000, 32, "item", ["item", "clicked"]), EmbeddingConfig(1000, 32, "user", ["x"])],
            device="meta",
        )


def _model_two_collections():
    return Planner(Topology(4, 4, 2), batch_size=64, pooling_factors={"clicked": 30}), _TwoCollections()


PLANNED = {
    "dlrm_cuda_fused": _dlrm_cuda,
    "dlrm_cpu_sparse_mixed_dtypes": _dlrm_cpu_sparse,
    "2d_tight_memory_adam_dense": _two_d_tight_memory,
    "host_memory_offload": _host_memory_offload,
    "constraints_and_together": _constraints_and_together,
    "cluster_256_ranks": _cluster,
    "cluster_groups_of_8": _cluster_small_groups,
    "model_two_collections": _model_two_collections,
}


def _estimated():
    tables = [
        EmbeddingBagConfig(1000, 64, "a", ["a"]),
        EmbeddingBagConfig(999, 32, "b", ["b", "c"]),
        EmbeddingBagConfig(77, 64, "c", ["d"], dtype=torch.float16),
        EmbeddingBagConfig(5000, 128, "d", ["e"]),
    ]
    plan = ShardingPlan(
        {
            "": {
                "a": row_wise([100, 0, 500, 300, 0, 0, 50, 50]),
                "b": column_wise([7, 2], [8, 24]),
                "c": grid_shard([1, 0], [48, 16]),
                "d": table_row_wise(1),
            }
        }
    )
    p = Planner(Topology(16, 8, 4), batch_size=32, default_pooling_factor=7, optimizer="momentum", gradients="dense")
    other = ShardingPlan(
        {"": {"a": data_parallel(), "b": table_wise(5), "c": column_wise([0, 1, 2, 3]), "d": grid_shard([0, 1])}}
    )
    return {"explicit_sizes": (p, tables, plan), "every_type": (p, tables, other)}


def _plain(x):
    """JSON-able with floats rounded to 12 significant digits (so a reordered sum still compares)."""
    if isinstance(x, float):
        return float(f"{x:.12g}") if math.isfinite(x) else str(x)
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _record(planner: Planner, report) -> dict:
    plan = {
        path: {
            t: {
                "type": ps.sharding_type.value,
                "ranks": ps.ranks,
                "row_sizes": ps.row_sizes,
                "col_sizes": ps.col_sizes,
                "host_indexes": ps.host_indexes,
                "kernel": ps.compute_kernel,
            }
            for t, ps in mod.items()
        }
        for path, mod in report.plan.plan.items()
    }
    d = report.as_dict()
    if len(d["ranks"]) > 16:  # keep the file small: every rank's total, the full breakdown of the first 16
        d["rank_time_ms"] = [r["time_ms"] for r in d["ranks"]]
        d["rank_memory_bytes"] = [r["memory_bytes"] for r in d["ranks"]]
        d["ranks"] = d["ranks"][:16]
    out = {"plan": plan, "report": d}
    if len(report.tables) <= 30:
        out["text"] = str(report)
    return _plain(out)


def _compute() -> dict:
    out = {}
    for name, make in PLANNED.items():
        planner, what = make()
        planner.plan(what)
        out[name] = _record(planner, planner.explain())
    for name, (planner, tables, plan) in _estimated().items():
        out[f"estimate_{name}"] = _record(planner, planner.estimate(tables, plan))
    return out


def _close(a, b, path: str) -> None:
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, (int, float)) and isinstance(b, (int, float)), f"{path}: {a!r} != {b!r}"
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{path}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}:\n{a}\n!=\n{b}"


@pytest.fixture(scope="module")
def golden() -> dict:
    if REGEN:
        GOLDEN.parent.mkdir(exist_ok=True)
        cases = _compute()  # one case per line: small diffs, readable names
        GOLDEN.write_text("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in cases.items()) + "\n}\n")
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name", [*PLANNED, *(f"estimate_{n}" for n in ("explicit_sizes", "every_type"))])
def test_plans_and_estimates_match_golden(golden: dict, name: str) -> None:
    if name in PLANNED:
        planner, what = PLANNED[name]()
        planner.plan(what)
        report = planner.explain()
    else:
        planner, tables, plan = _estimated()[name.removeprefix("estimate_")]
        report = planner.estimate(tables, plan)
    got = json.loads(json.dumps(_record(planner, report)))
    _close(got, golden[name], name)


def test_golden_covers_every_sharding_type(golden: dict) -> None:
    # a golden file that never exercises a type cannot prove that type's refactor
    seen = {ps["type"] for case in golden.values() for mod in case["plan"].values() for ps in mod.values()}
    assert seen >= {"data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "grid_shard"}, seen
    kernels = {ps["kernel"] for case in golden.values() for mod in case["plan"].values() for ps in mod.values()}
    assert "fused_uvm" in kernels, "no case keeps a table in host memory"
