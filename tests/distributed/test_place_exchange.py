"""Placing pooled rows straight out of the exchange (pipeline/output_dist.py) gives the bits of the two-step path.

The two-step path is the one every other test checks against plain embedding_bag: the output all-to-all into
a flat buffer (``dists.pooled_output_dist``), then ``place_columns``. Here both run on the same random layouts
(whole tables, row blocks, column shards, data-parallel tables, on 3 ranks with unequal batches), through
shared memory and through gloo, and the outputs and both inputs' gradients must be equal bit for bit.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.distributed as dist

from lightning_rec.pipeline import input_dist as dists
from lightning_rec.pipeline.output_dist import exchange_and_place, place_columns
from lightning_rec.pipeline.routing import build_routing
from lightning_rec.plans.shard_geometry import ShardMeta, offsets_of
from lightning_rec.testing import run_distributed
from lightning_rec.transport import shm

WS = 3


def _layout(seed: int):
    """1-5 tables over 3 ranks: whole tables, row blocks (on one rank, or two), column shards, data-parallel."""
    rng = random.Random(seed)
    feature_table, dims, shards = [], [], []
    for t in range(rng.randint(1, 5)):
        dim = rng.choice([2, 3, 4, 8])
        kind = rng.choice(["table", "rows", "rows", "cols", "dp"])
        if kind == "dp":
            shards.append(None)
        elif kind == "table":
            shards.append([ShardMeta(0, 6, 0, dim, rng.randrange(WS))])
        elif kind == "rows":
            a, b = rng.randrange(WS), rng.randrange(WS)
            shards.append([ShardMeta(0, 3, 0, dim, a), ShardMeta(3, 3, 0, dim, b)])
        else:
            cut = rng.randint(1, dim - 1)
            shards.append([ShardMeta(0, 6, 0, cut, rng.randrange(WS)), ShardMeta(0, 6, cut, dim - cut,
                                                                                  rng.randrange(WS))])
        for _ in range(rng.randint(1, 2)):
            feature_table.append(t)
            dims.append(dim)
    return feature_table, dims, shards


def _job(rank: int, ws: int, seeds: list[int], use_shm: bool) -> list[str]:
    os.environ["LIGHTNING_REC_SHM"] = "1" if use_shm else "0"
    group = dist.new_group(list(range(ws)))  # set up under this setting
    batches = [2, 0, 3]  # one rank with an empty batch
    b = batches[rank]
    kinds = []
    for seed in seeds:
        feature_table, dims, shards = _layout(seed)
        local = [t for t, sh in enumerate(shards) if sh and any(s.rank == rank for s in sh)]
        rt = build_routing(feature_table, dims, shards, local, group_rank=rank, group_size=ws)
        kinds.append(rt.colmap_kind)
        gen = torch.Generator().manual_seed(seed * 10 + rank)
        dp_width = sum(n * count for _, _, n, count, _ in rt.colmap_runs[0])
        pooled0 = torch.randn(sum(batches), rt.cols_from[rank], dtype=torch.float64, generator=gen)
        dp0 = torch.randn(b, dp_width, dtype=torch.float64, generator=gen) if rt.dp_tables else None
        coef = torch.randn(b, rt.feat_off[-1], dtype=torch.float64, generator=gen)
        results = []
        for new in (False, True):
            pooled = pooled0.clone().requires_grad_(True)
            dp = None if dp0 is None else dp0.clone().requires_grad_(True)
            if new:
                out = exchange_and_place(pooled, dp, rt, batches, b, group)
            else:
                flat = dists.pooled_output_dist(pooled, rt, batches, b, group)
                parts = [] if dp is None else [(dp, 0, dp_width, rt.colmap_runs[0], rt.colmap_add[0])]
                starts = offsets_of([b * w for w in rt.cols_from])
                parts += [(flat, s, w, g, a) for s, w, g, a in zip(starts, rt.cols_from, rt.colmap_runs[1:],
                                                                    rt.colmap_add[1:])]
                out = place_columns(parts, rt.colmap_kind, b, rt.feat_off[-1], torch.float64, torch.device("cpu"))
            (out * coef).sum().backward()
            results.append((out.detach(), pooled.grad, None if dp is None else dp.grad))
        (o1, g1, d1), (o2, g2, d2) = results
        assert torch.equal(o1, o2), f"seed {seed} rank {rank}: outputs differ"
        assert (g1 is None and g2 is None) or torch.equal(g1, g2), f"seed {seed} rank {rank}: pooled grads differ"
        assert (d1 is None and d2 is None) or torch.equal(d1, d2), f"seed {seed} rank {rank}: dp grads differ"
        assert rt.cols_from[rank] == 0 or pooled0.shape[0] == 0 or g2.abs().sum() > 0
    dist.destroy_process_group(group)
    return kinds


@pytest.mark.parametrize("use_shm", [True, False], ids=["shared_memory", "gloo"])
def test_exchange_and_place_equals_all_to_all_then_place(use_shm: bool) -> None:
    if use_shm and not shm._wanted():
        pytest.skip("shared-memory transport needs Linux x86-64")
    kinds = run_distributed(_job, WS, list(range(16)), use_shm)
    assert {"overlay", "sum", "permutation"} <= set(kinds[0])
