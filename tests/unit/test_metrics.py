"""Recommendation metrics against plain numpy computations on one process."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_rec.metrics import Calibration, LogLoss, NormalizedEntropy, rec_metrics


def np_logloss(p, y, w=None):
    w = np.ones_like(p) if w is None else w
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return float(np.sum(-w * (y * np.log(p) + (1 - y) * np.log(1 - p))) / np.sum(w))


def np_ne(p, y, w=None):
    w = np.ones_like(p) if w is None else w
    r = np.clip(np.sum(w * y) / np.sum(w), 1e-7, 1 - 1e-7)
    return np_logloss(p, y, w) / float(-(r * np.log(r) + (1 - r) * np.log(1 - r)))


def np_calibration(p, y, w=None):
    w = np.ones_like(p) if w is None else w
    return float(np.sum(w * p) / np.sum(w * y))


def np_auc(p, y):
    """Mean over (positive, negative) pairs of [p_pos > p_neg] + 0.5 [p_pos == p_neg]."""
    pos, neg = p[y == 1][:, None], p[y == 0][None, :]
    return float(((pos > neg) + 0.5 * (pos == neg)).mean())


def sample(n: int, seed: int):
    rng = np.random.default_rng(seed)
    p = rng.uniform(0, 1, n).round(2)  # rounding makes ties, which AUROC must count half
    y = (rng.uniform(0, 1, n) < p).astype(np.float64)
    return p, y


@pytest.mark.parametrize("n", [2, 50, 333])
def test_metrics_match_numpy_over_several_updates(n: int) -> None:
    p, y = sample(n, n)
    if y.min() == y.max():
        y[0] = 1 - y[0]  # both classes, so every metric is defined
    m = rec_metrics("val_")
    for idx in np.array_split(np.arange(n), 4):  # some chunks are empty when n < 4
        m.update(torch.tensor(p[idx], dtype=torch.float32), torch.tensor(y[idx], dtype=torch.float32))
    got = {k: float(v) for k, v in m.compute().items()}
    p32 = p.astype(np.float32).astype(np.float64)
    want = {
        "val_auroc": np_auc(p32, y),
        "val_ne": np_ne(p32, y),
        "val_calibration": np_calibration(p32, y),
        "val_logloss": np_logloss(p32, y),
    }
    assert set(got) == set(want)
    for k, v in want.items():
        assert math.isclose(got[k], v, rel_tol=1e-5), (k, got[k], v)


def test_weighted_metrics_match_numpy() -> None:
    p, y = sample(200, 1)
    w = np.random.default_rng(2).uniform(0, 3, 200)
    for cls, ref in ((NormalizedEntropy, np_ne), (LogLoss, np_logloss), (Calibration, np_calibration)):
        m = cls()
        m.update(torch.tensor(p[:120]), torch.tensor(y[:120]), torch.tensor(w[:120]))
        m.update(torch.tensor(p[120:]), torch.tensor(y[120:]), weight=torch.tensor(w[120:]))
        assert math.isclose(float(m.compute()), ref(p, y, w), rel_tol=1e-6), cls.__name__
    # integer weights act as repeated rows
    m = LogLoss()
    m.update(torch.tensor([0.2, 0.9]), torch.tensor([0.0, 1.0]), torch.tensor([2.0, 1.0]))
    assert math.isclose(
        float(m.compute()), np_logloss(np.array([0.2, 0.2, 0.9]), np.array([0.0, 0.0, 1.0])), rel_tol=1e-6
    )


def test_ne_of_base_rate_prediction_is_one_and_extremes_stay_finite() -> None:
    y = torch.tensor([1.0, 0.0, 0.0, 0.0])
    ne = NormalizedEntropy()
    ne.update(torch.full((4,), 0.25), y)
    assert math.isclose(float(ne.compute()), 1.0, rel_tol=1e-6)
    for metric in (NormalizedEntropy(), LogLoss()):
        metric.update(torch.tensor([0.0, 1.0, 1.0]), torch.tensor([1.0, 0.0, 1.0]))  # confidently wrong
        assert math.isfinite(float(metric.compute()))
    only_pos = NormalizedEntropy()
    only_pos.update(torch.tensor([0.9, 0.8]), torch.tensor([1.0, 1.0]))
    assert math.isfinite(float(only_pos.compute()))
    empty = LogLoss()
    empty.update(torch.zeros(0), torch.zeros(0))
    assert math.isnan(float(empty.compute()))
    no_pos = Calibration()
    no_pos.update(torch.tensor([0.1]), torch.tensor([0.0]))
    assert float(no_pos.compute()) == math.inf


def test_bad_inputs_raise_clear_errors() -> None:
    m = NormalizedEntropy()
    with pytest.raises(ValueError, match=r"probs must lie in \[0, 1\].*logits"):
        m.update(torch.tensor([0.5, 2.0]), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"probs must lie in \[0, 1\]"):
        m.update(torch.tensor([float("nan")]), torch.tensor([0.0]))
    with pytest.raises(ValueError, match="target must hold only 0 and 1"):
        m.update(torch.tensor([0.5]), torch.tensor([2.0]))
    with pytest.raises(ValueError, match="same shape"):
        m.update(torch.tensor([0.5, 0.5]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="weight must be finite and >= 0"):
        m.update(torch.tensor([0.5]), torch.tensor([1.0]), torch.tensor([-1.0]))
    with pytest.raises(ValueError, match="floating point"):
        m.update(torch.tensor([1]), torch.tensor([1]))
    with pytest.raises(ValueError, match="Calibration: probs"):
        Calibration().update(torch.tensor([-0.1]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="auroc does not support sample weights"):
        rec_metrics().update(torch.tensor([0.5]), torch.tensor([1.0]), weight=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="probs must lie"):
        rec_metrics().update(torch.tensor([3.0]), torch.tensor([1.0]))
