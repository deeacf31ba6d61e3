"""Metrics synced over real gloo processes with uneven shards equal the single-process value."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_rec.metrics import NormalizedEntropy, rec_metrics
from lightning_rec.testing import run_distributed
from tests.unit.test_metrics import np_auc, np_calibration, np_logloss, np_ne, sample

SIZES = {3: [29, 0, 13]}  # samples per rank: uneven, and one rank empty


def _shard(ws: int, rank: int):
    p, y = sample(sum(SIZES[ws]), 7)
    w = np.random.default_rng(8).uniform(0.5, 2, p.size)
    a = sum(SIZES[ws][:rank])
    sl = slice(a, a + SIZES[ws][rank])
    return p, y, w, sl


def _job(rank: int, ws: int) -> dict:
    p, y, w, sl = _shard(ws, rank)

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.tensor(a[sl], dtype=torch.float32)

    updated = rec_metrics()  # an empty rank still calls update, with zero-length tensors
    updated.update(t(p), t(y))
    never = rec_metrics()  # an empty rank never calls update
    if SIZES[ws][rank]:
        for chunk in np.array_split(np.arange(sl.start, sl.stop), 2):
            never.update(torch.tensor(p[chunk], dtype=torch.float32), torch.tensor(y[chunk], dtype=torch.float32))
    weighted = NormalizedEntropy()
    weighted.update(t(p), t(y), t(w))
    return {
        "updated": {k: float(v) for k, v in updated.compute().items()},
        "never": {k: float(v) for k, v in never.compute().items()},
        "weighted_ne": float(weighted.compute()),
    }


@pytest.mark.slow
@pytest.mark.parametrize("ws", [3])
def test_synced_metrics_equal_single_process(ws: int) -> None:
    results = run_distributed(_job, ws, timeout_s=120)
    p, y, w, _ = _shard(ws, 0)
    p = p.astype(np.float32).astype(np.float64)
    w = w.astype(np.float32).astype(np.float64)
    want = {"auroc": np_auc(p, y), "ne": np_ne(p, y), "calibration": np_calibration(p, y), "logloss": np_logloss(p, y)}
    for rank, r in enumerate(results):
        for case in ("updated", "never"):
            for k, v in want.items():
                assert math.isclose(r[case][k], v, rel_tol=1e-5), (rank, case, k, r[case][k], v)
        assert math.isclose(r["weighted_ne"], np_ne(p, y, w), rel_tol=1e-5), rank
