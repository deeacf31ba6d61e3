"""Sharding a model built on the meta device: only the local shard is ever allocated (issue 14, item 6).

A collection on the meta device has shapes only; ``shard_modules`` allocates this rank's shard and fills it
from the table config's ``init_fn``. An ``init_fn`` that takes ``row_offset`` / ``col_offset`` learns where
the shard sits, so a position-based deterministic init gives exactly the shards a fully built (CPU) model is
cut into, for every sharding type, plain and fused. A large full table materialized on a rank only to be cut
into a shard gets one warning naming it. Peak memory is measured in benchmarks/bench_shard_memory.py.
"""

from __future__ import annotations

import warnings

import torch

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_rec.pipeline import local_tables as collection_mod
from lightning_rec.sharding import (
    ShardingPlan,
    column_wise,
    data_parallel,
    full_state_dict,
    grid_shard,
    row_wise,
    shard_modules,
    table_row_wise,
    table_wise,
)
from lightning_rec.sparse import KeyedJaggedTensor
from lightning_rec.testing import run_distributed

WS = 2


def position_init(w: torch.Tensor, row_offset: int = 0, col_offset: int = 0) -> None:
    """Deterministic and position-based: the value of a cell depends only on its place in the full table."""
    r = torch.arange(row_offset, row_offset + w.shape[0], dtype=torch.float64).unsqueeze(1)
    c = torch.arange(col_offset, col_offset + w.shape[1], dtype=torch.float64).unsqueeze(0)
    w.copy_(torch.sin(r * 1.37 + c * 0.61))


def _plans() -> list[tuple[dict, int]]:
    """(plan, local_size) pairs that together cover every sharding type at 2 processes."""
    return [
        (
            {
                "tw": table_wise(1),
                "rw": row_wise([3, 6]),
                "cw": column_wise([1, 0]),
                "twrw": table_row_wise(0),
                "dp": data_parallel(),
            },
            WS,
        ),
        (
            {
                "tw": row_wise(),
                "rw": grid_shard([0, 1]),
                "cw": grid_shard([1, 0]),
                "twrw": table_row_wise(1),
                "dp": table_wise(0),
            },
            1,
        ),
    ]


def _tables(init_fn) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=n, num_embeddings=rows, embedding_dim=8, feature_names=[f"f {n}"], init_fn=init_fn)
        for n, rows in [("tw", 5), ("rw", 9), ("cw", 7), ("twrw", 4), ("dp", 6)]
    ]


def _kjt(rank: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(rank)
    keys = [f"f {n}" for n in ("tw", "rw", "cw", "twrw", "dp")]
    lengths = torch.randint(1, 3, (len(keys) * 2,), generator=g)
    values = torch.randint(0, 4, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor(keys, values, lengths=lengths, stride=2)


def _local(sharded) -> dict[str, torch.Tensor]:
    container = getattr(sharded, sharded.table_attr)
    return {n: container[n].weight.detach().clone() for n in container}


def _meta_vs_cpu_job(rank: int, ws: int, fused: bool, init: str) -> list[dict]:
    init_fn = position_init if init == "position" else (lambda w: w.fill_(0.25))
    optimizer = {"kind": "sgd", "lr": 0.5} if fused else None
    out = []
    for plan, local in _plans():
        built = {}
        for device in ("cpu", "meta"):
            ebc = EmbeddingBagCollection(_tables(init_fn), device=device)
            full = {n: ebc.embedding_bags[n].weight.detach().clone() for n in plan} if device == "cpu" else None
            sharded = shard_modules(ebc, ShardingPlan({"": plan}), local_size=local, embedding_optimizer=optimizer)
            pieces = _local(sharded)
            sharded(_kjt(rank)).values().sum().backward()  # the meta-built model trains like the CPU-built one
            built[device] = (full, pieces, full_state_dict(sharded), sharded)
        full, cpu_pieces, cpu_state, _ = built["cpu"]
        _, meta_pieces, meta_state, sharded = built["meta"]
        names = [t.name for t in sharded.tables]
        slices = {}
        for n in meta_pieces:  # each piece is its slice of the CPU-built full table
            s = next((s for ti, s in sharded.local_shards if names[ti] == n), None)
            slices[n] = (
                full[n]
                if s is None
                else full[n][s.row_offset : s.row_offset + s.rows, s.col_offset : s.col_offset + s.cols]
            )
        out.append(
            dict(
                same_local=meta_pieces.keys() == cpu_pieces.keys()
                and len(meta_pieces) > 0
                and all(torch.equal(cpu_pieces[n], p) for n, p in meta_pieces.items()),
                slices_of_cpu_tables=all(torch.equal(slices[n], p) for n, p in meta_pieces.items()),
                same_after_step=meta_state.keys() == cpu_state.keys()
                and all(torch.equal(cpu_state[k], v) for k, v in meta_state.items()),
            )
        )
    return out


def test_meta_built_model_gives_exactly_the_cpu_shards() -> None:
    for fused in (False, True):
        for init in ("position", "constant"):
            for per_plan in run_distributed(_meta_vs_cpu_job, WS, fused, init):
                for res in per_plan:
                    assert res == dict(same_local=True, slices_of_cpu_tables=True, same_after_step=True), (
                        fused,
                        init,
                        res,
                    )


def _warning_job(rank: int, ws: int) -> dict:
    collection_mod.LARGE_TABLE_BYTES = 1000  # bytes: the tables below are "large"
    collection_mod._warned_large.clear()
    tables = [
        EmbeddingBagConfig(name=n, num_embeddings=100, embedding_dim=4, feature_names=[f"f{n}"])
        for n in ("big.rows", "big owner", "replica", "small")
    ]
    tables[3] = EmbeddingBagConfig(name="small", num_embeddings=10, embedding_dim=4, feature_names=["fsmall"])
    plan = ShardingPlan(
        {"": {"big.rows": row_wise(), "big owner": table_wise(0), "replica": data_parallel(), "small": row_wise()}}
    )
    seen = {}
    for device in ("cpu", "meta", "cpu"):  # the second CPU build of the same tables warns no more
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            shard_modules(EmbeddingBagCollection(tables, device=device), plan)
        seen.setdefault(device, []).append([str(w.message) for w in caught if "materialized" in str(w.message)])
    return seen


def test_large_full_table_cut_into_a_shard_warns_once_naming_it() -> None:
    for rank, seen in enumerate(run_distributed(_warning_job, WS)):
        first, again = seen["cpu"]
        assert seen["meta"] == [[]] and again == []
        names = sorted(m.split("'")[1] for m in first)
        # the owner keeps all of "big owner"; the replica and the small table are not cut needlessly
        assert names == (["big.rows"] if rank == 0 else ["big owner", "big.rows"]), first
        msg = next(m for m in first if "'big.rows'" in m)
        assert "100 x 4" in msg and "MiB" in msg and "meta" in msg and "50%" in msg
