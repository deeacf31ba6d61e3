"""fp16 GradScaler under sharding: every rank agrees on skipping a step when any rank's shards overflowed."""

from __future__ import annotations

import torch

from lightning_rec import _compat
from lightning_rec.testing import run_distributed


def _step(rank: int, synced: bool) -> tuple[float, float]:
    shard = torch.nn.Parameter(torch.ones(2))  # a different shard on every rank
    opt = torch.optim.SGD([shard], lr=1.0)
    scaler = torch.amp.GradScaler(device="cpu", init_scale=4.0)
    if synced:
        scaler = _compat.synced_grad_scaler(scaler, torch.distributed.group.WORLD)
    loss = (shard * (float("inf") if rank == 1 else 1.0)).sum()  # only rank 1's shard overflows
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return float(shard[0].detach()), float(scaler.get_scale())


def _job(rank: int, ws: int) -> dict:
    return {"plain": _step(rank, False), "synced": _step(rank, True)}


def test_overflow_on_one_rank_skips_the_step_everywhere() -> None:
    results = run_distributed(_job, 2)
    plain = [r["plain"] for r in results]
    assert plain[0][0] != 1.0 and plain[1][0] == 1.0  # torch's scaler alone: rank 0 steps, rank 1 skips
    for value, scale in (r["synced"] for r in results):
        assert value == 1.0 and scale == 2.0  # synced: both skip and back off
