"""The pooled output dist (pipeline/output_dist.py: rows placed straight out of the exchange) against a
reference built from plain parts: torch.distributed's all-to-all into a flat buffer, then one ``index_add``
per block over its output columns (the routing's column map, expanded column by column).

Random layouts (whole tables, row blocks, column shards, data-parallel tables, on 3 ranks with unequal
batches), through shared memory and through gloo, and on a group of one rank; the outputs and both
inputs' gradients must be equal bit for bit (each column's sum is taken in the same block order).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn

from lightning_rec.pipeline.output_dist import OutputDistKind, PooledOutputDist
from lightning_rec.pipeline.routing import build_routing
from lightning_rec.plans.shard_geometry import ShardMeta, offsets_of
from lightning_rec.testing import run_distributed
from lightning_rec.transport import shm

WS = 3


def _layout(seed: int, ws: int):
    """1-5 tables over ``ws`` ranks: whole tables, row blocks (on one rank, or two), column shards, data-parallel."""
    rng = random.Random(seed)
    feature_table, dims, shards = [], [], []
    for t in range(rng.randint(1, 5)):
        dim = rng.choice([2, 3, 4, 8])
        kind = rng.choice(["table", "rows", "rows", "cols", "dp"])
        if kind == "dp":
            shards.append(None)
        elif kind == "table":
            shards.append([ShardMeta(0, 6, 0, dim, rng.randrange(ws))])
        elif kind == "rows":
            a, b = rng.randrange(ws), rng.randrange(ws)
            shards.append([ShardMeta(0, 3, 0, dim, a), ShardMeta(3, 3, 0, dim, b)])
        else:
            cut = rng.randint(1, dim - 1)
            shards.append(
                [ShardMeta(0, 6, 0, cut, rng.randrange(ws)), ShardMeta(0, 6, cut, dim - cut, rng.randrange(ws))]
            )
        for _ in range(rng.randint(1, 2)):
            feature_table.append(t)
            dims.append(dim)
    return feature_table, dims, shards


def _reference(pooled, dp, rt, batches, b, group):
    """The output from torch.distributed's differentiable all-to-all and a per-column index_add."""
    me = dist.get_rank(group)
    flat = (
        dist_nn.all_to_all_single(
            torch.empty(b * sum(rt.cols_from), dtype=pooled.dtype),
            pooled.reshape(-1),
            [b * w for w in rt.cols_from],
            [n * rt.cols_from[me] for n in batches],
            group=group,
        )
        if dist.get_world_size(group) > 1
        else pooled.reshape(-1)
    )
    blocks = [] if dp is None else [dp]
    blocks += [flat[s : s + b * w].view(b, w) for s, w in zip(offsets_of([b * w for w in rt.cols_from]), rt.cols_from)]
    # every block's output columns straight from the routes: the data-parallel features', then each rank's
    off = rt.feat_off
    cols_of = [[c for f in rt.dp_features for c in range(off[f], off[f + 1])]] if dp is not None else []
    cols_of += [
        [off[r.feature] + r.shard.col_offset + c for r in routes for c in range(r.shard.cols)]
        for routes in rt.routes_to
    ]
    out = torch.zeros(b, rt.feat_off[-1], dtype=pooled.dtype)
    for block, cols in zip(blocks, cols_of):
        if cols:
            out = out.index_add(1, torch.tensor(cols), block)
    return out


def _job(rank: int, ws: int, seeds: list[int], use_shm: bool) -> list[str]:
    os.environ["LIGHTNING_REC_SHM"] = "1" if use_shm else "0"
    group = dist.new_group(list(range(ws)))  # set up under this setting
    alone = dist.new_group([rank], use_local_synchronization=True) if ws > 1 else group
    kinds = []
    for seed in seeds:
        for g, size, me in ((group, ws, rank), (alone, 1, 0)):
            batches = [2, 0, 3][:size] if size > 1 else [3]  # one rank with an empty batch
            b = batches[me]
            feature_table, dims, shards = _layout(seed, size)
            local = [t for t, sh in enumerate(shards) if sh and any(s.rank == me for s in sh)]
            rt = build_routing(feature_table, dims, shards, local, group_rank=me, group_size=size)
            out_dist = PooledOutputDist(rt, g)
            assert out_dist.kind is OutputDistKind.FLAT  # one host
            kinds.append(out_dist.placement.kind)
            gen = torch.Generator().manual_seed(seed * 10 + rank)
            dp_width = sum(rt.feat_off[f + 1] - rt.feat_off[f] for f in rt.dp_features)
            pooled0 = torch.randn(sum(batches), rt.cols_from[me], dtype=torch.float64, generator=gen)
            dp0 = torch.randn(b, dp_width, dtype=torch.float64, generator=gen) if rt.dp_tables else None
            coef = torch.randn(b, rt.feat_off[-1], dtype=torch.float64, generator=gen)
            results = []
            for ours in (True, False):
                pooled = pooled0.clone().requires_grad_(True)
                dp = None if dp0 is None else dp0.clone().requires_grad_(True)
                if ours:
                    out = out_dist(pooled, dp, batches, b)
                else:
                    out = _reference(pooled, dp, rt, batches, b, g)
                (out * coef).sum().backward()
                results.append((out.detach(), pooled.grad, None if dp is None else dp.grad))
            (o1, g1, d1), (o2, g2, d2) = results
            where = f"seed {seed} rank {rank} group of {size}"
            assert torch.equal(o1, o2), f"{where}: outputs differ"
            assert torch.equal(g1, g2), f"{where}: pooled grads differ"
            assert (d1 is None and d2 is None) or torch.equal(d1, d2), f"{where}: dp grads differ"
            assert rt.cols_from[me] == 0 or pooled0.shape[0] == 0 or g1.abs().sum() > 0
    dist.destroy_process_group(group)
    return kinds


@pytest.mark.parametrize("use_shm", [True, False], ids=["shared_memory", "gloo"])
def test_pooled_output_dist_equals_all_to_all_then_index_add(use_shm: bool) -> None:
    if use_shm and not shm._wanted():
        pytest.skip("shared-memory transport needs Linux x86-64")
    kinds = run_distributed(_job, WS, list(range(16)), use_shm)
    assert {"overlay", "sum", "permutation", "identity"} <= set(kinds[0])
