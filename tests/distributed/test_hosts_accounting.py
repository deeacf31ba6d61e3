"""The transport's byte accounting against counts derived by hand, on 4 gloo ranks pretending to be 2 hosts.

Ranks 0-1 are host 0 and ranks 2-3 host 1 (``LOCAL_WORLD_SIZE=2``, as a 2-node launcher sets it). Each
collective's expected bytes follow from its arguments alone: an all-to-all sends rank ``r`` exactly its split;
gloo's ring all-gather and all-reduce send only to the next rank; the shared-memory transport lets every peer
read the whole tensor. A sharded row-wise collection's output dist sends every other rank its samples' partial
pooled rows, forward, and gets their gradients back, backward (the flat exchange, ``LIGHTNING_REC_OUTPUT_DIST=flat``);
with the host blocks (the default there: two row blocks per host), only each host's sum crosses, from the rank
with the destination's index in its host.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, ShardingPlan, transport
from lightning_rec.sharding import row_wise, shard_modules
from lightning_rec.testing import run_distributed
from lightning_rec.transport import accounting, shm

WORLD, PER_HOST = 4, 2
DIM = 8
BATCH = (3, 0, 5, 2)  # samples per rank


def _splits(src: int, dst: int) -> int:
    return (src + 1) * 10 + dst  # rows rank ``src`` sends rank ``dst``


def _collectives_job(rank: int, ws: int, path: str) -> dict:
    if path == "gloo":
        os.environ["LIGHTNING_REC_SHM"] = "0"  # read when a group first meets the transport
    group = dist.new_group(list(range(ws)), timeout=timedelta(seconds=60))
    shared = transport.shared_group(group) is not None
    accounting.reset()
    out: dict = {"shared": shared}
    with accounting.counting():
        x = torch.randn(sum(_splits(rank, d) for d in range(ws)), 3, dtype=torch.float64)
        got = torch.empty(sum(_splits(s, rank) for s in range(ws)), 3, dtype=torch.float64)
        with transport.stage("a2a"):
            transport.all_to_all_single(
                got, x, [_splits(s, rank) for s in range(ws)], [_splits(rank, d) for d in range(ws)], group
            )
        with transport.stage("gather"):
            gathered = torch.empty(ws * 12, dtype=torch.int32)
            transport.all_gather_single(gathered, torch.zeros(12, dtype=torch.int32), group)
        with transport.stage("reduce"):
            transport.all_reduce_sum(torch.ones(100, dtype=torch.float32), group)
        with transport.stage("pieces"):
            sends = [
                [torch.zeros(d + 1, dtype=torch.int64), torch.zeros(2 * rank, dtype=torch.int64)] for d in range(ws)
            ]
            sizes = [[rank + 1, 2 * s] for s in range(ws)]
            transport.all_to_all_pieces(sends, sizes, lambda got: None, group, torch.device("cpu")).wait()
    # counting is off again: nothing more is added
    transport.all_reduce_sum(torch.ones(100), group)
    out["by_rank"] = {f"{s} {d} {k}": n for (s, d, k), n in accounting.byte_counts(by="rank").items()}
    out["by_host"] = {f"{s} {d} {k}": n for (s, d, k), n in accounting.byte_counts().items()}
    out["everyone"] = {f"{s} {d} {k}": n for (s, d, k), n in accounting.gather_byte_counts().items()}
    transport.close_all()
    return out


@pytest.mark.parametrize("path", ["gloo", "shm"])
def test_collective_bytes_equal_the_counts_their_arguments_give(path: str) -> None:
    if path == "shm" and not shm._wanted():
        pytest.skip("the shared-memory transport needs Linux x86-64")
    results = run_distributed(_collectives_job, WORLD, path, ranks_per_node=PER_HOST)
    ring = path == "gloo"
    expected_all: dict[str, int] = {}
    for rank, got in enumerate(results):
        assert got["shared"] == (not ring)
        want: dict[str, int] = {}
        for d in range(WORLD):
            if d == rank:
                continue
            want[f"{rank} {d} a2a"] = _splits(rank, d) * 3 * 8
            want[f"{rank} {d} pieces"] = (d + 1 + 2 * rank) * 8
            if not ring:
                want[f"{rank} {d} gather"] = 12 * 4
                want[f"{rank} {d} reduce"] = 100 * 4
            elif d == (rank + 1) % WORLD:
                want[f"{rank} {d} gather"] = (WORLD - 1) * 12 * 4
                want[f"{rank} {d} reduce"] = 2 * (WORLD - 1) * 100 * 4 // WORLD
        want = {k: v for k, v in want.items() if v}
        assert got["by_rank"] == want, (rank, got["by_rank"], want)
        by_host: dict[str, int] = {}
        for key, n in want.items():
            s, d, label = key.split()
            hk = f"{int(s) // PER_HOST} {int(d) // PER_HOST} {label}"
            by_host[hk] = by_host.get(hk, 0) + n
        assert got["by_host"] == by_host
        for key, n in by_host.items():
            expected_all[key] = expected_all.get(key, 0) + n
    for got in results:
        assert got["everyone"] == expected_all


def _sharded_job(rank: int, ws: int, mode: str) -> dict:
    os.environ["LIGHTNING_REC_OUTPUT_DIST"] = mode  # read when the collection builds its output dist
    tables = [EmbeddingBagConfig(name="t", num_embeddings=40, embedding_dim=DIM, feature_names=["f"])]
    torch.manual_seed(0)
    model = shard_modules(EmbeddingBagCollection(tables), ShardingPlan({"": {"t": row_wise()}}))
    g = torch.Generator().manual_seed(rank)
    lengths = torch.randint(1, 4, (BATCH[rank],), generator=g)
    kjt = KeyedJaggedTensor(["f"], torch.randint(0, 40, (int(lengths.sum()),), generator=g), lengths=lengths)
    accounting.reset()
    with accounting.counting():
        model(kjt).values().sum().backward()
    out = {f"{s} {d} {k}": n for (s, d, k), n in accounting.byte_counts(by="rank").items()}
    return {"counts": out, "calls": accounting.collective_counts(), "line": accounting.log_byte_counts()}


def test_a_row_wise_steps_output_dist_bytes_are_its_partial_rows() -> None:
    results = run_distributed(_sharded_job, WORLD, "flat", ranks_per_node=PER_HOST)
    for rank, got in enumerate(results):
        counts = got["counts"]
        for d in range(WORLD):
            if d == rank:
                continue
            # forward: every rank's partial sums of d's samples; backward: their gradient back to each block
            assert counts.get(f"{rank} {d} output_dist_fwd", 0) == BATCH[d] * DIM * 4, (rank, d, counts)
            assert counts.get(f"{rank} {d} output_dist_bwd", 0) == BATCH[rank] * DIM * 4, (rank, d, counts)
        assert got["calls"].get("input_dist", 0) >= 2, got["calls"]  # the header and the ids
        assert any(k.endswith(" input_dist") for k in counts), counts
        # the debug line, by host pair: rank 0 sends host 1 (ranks 2, 3) their samples' partial rows
        if rank == 0:
            assert f"0->1 output_dist_fwd: {(BATCH[2] + BATCH[3]) * DIM * 4}" in got["line"], got["line"]


def test_with_host_blocks_each_hosts_sum_crosses_once() -> None:
    results = run_distributed(_sharded_job, WORLD, "auto", ranks_per_node=PER_HOST)
    for rank, got in enumerate(results):
        counts = got["counts"]
        for d in range(WORLD):
            if d // PER_HOST == rank // PER_HOST:
                continue
            # rank 0 adds host 0's two row blocks for rank 2 and sends the sum (rank 1 for rank 3); backward, rank
            # 2 sends the sum's gradient to rank 0 only, which passes it on to rank 1 within host 0
            paired = d % PER_HOST == rank % PER_HOST
            assert counts.get(f"{rank} {d} output_dist_fwd", 0) == (BATCH[d] * DIM * 4 if paired else 0), counts
            assert counts.get(f"{rank} {d} output_dist_bwd", 0) == (BATCH[rank] * DIM * 4 if paired else 0), counts
