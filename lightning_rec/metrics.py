"""Click-through metrics on torchmetrics: normalized entropy, calibration, log loss, and the usual set.

Every metric takes probabilities in ``[0, 1]`` and labels in ``{0, 1}`` (checked), accumulates sums in
float64, and is synced across ranks by torchmetrics (a sum of its states), so under uneven shards --
ranks with different numbers of samples, or none -- the value equals the single-process one.
"""

from __future__ import annotations

from typing import Any

import torch
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import BinaryAUROC

EPS = 1e-7  # probabilities are clamped to [EPS, 1 - EPS] before taking logs


def _check(probs: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, name: str) -> None:
    if probs.shape != target.shape:
        raise ValueError(
            f"{name}: probs {tuple(probs.shape)} and target {tuple(target.shape)} must have the same shape"
        )
    if not probs.is_floating_point():
        raise ValueError(f"{name}: probs must be floating point probabilities, got {probs.dtype}")
    if probs.numel() and not bool(((probs >= 0) & (probs <= 1)).all()):
        raise ValueError(
            f"{name}: probs must lie in [0, 1] (got min {float(probs.min())}, max {float(probs.max())}); "
            "pass sigmoid(logits), not logits"
        )
    if target.numel() and not bool(((target == 0) | (target == 1)).all()):
        raise ValueError(f"{name}: target must hold only 0 and 1")
    if weight is not None:
        if weight.shape != probs.shape:
            raise ValueError(f"{name}: weight {tuple(weight.shape)} must have the shape of probs {tuple(probs.shape)}")
        if weight.numel() and not bool((torch.isfinite(weight) & (weight >= 0)).all()):
            raise ValueError(f"{name}: weight must be finite and >= 0")


class _WeightedSums(Metric):
    """Float64 sums of weight, weight * label, weight * prob and weight * cross-entropy, summed over ranks."""

    is_differentiable = False
    full_state_update = False

    # states (add_state in __init__)
    weight_sum: torch.Tensor
    positive_sum: torch.Tensor
    prob_sum: torch.Tensor
    ce_sum: torch.Tensor

    def __init__(self, validate_args: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.validate_args = validate_args
        for name in ("weight_sum", "positive_sum", "prob_sum", "ce_sum"):
            self.add_state(name, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, probs: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        if self.validate_args:
            _check(probs, target, weight, type(self).__name__)
        p = probs.detach().reshape(-1).double()
        y = target.detach().reshape(-1).double()
        w = torch.ones_like(p) if weight is None else weight.detach().reshape(-1).double()
        pc = p.clamp(EPS, 1 - EPS)
        ce = -(y * torch.log(pc) + (1 - y) * torch.log1p(-pc))
        self.weight_sum += w.sum()
        self.positive_sum += (w * y).sum()
        self.prob_sum += (w * p).sum()
        self.ce_sum += (w * ce).sum()


class LogLoss(_WeightedSums):
    """Mean binary cross-entropy ``-mean(w * (y log p + (1 - y) log(1 - p)))`` / mean weight; nan when empty."""

    higher_is_better = False

    def compute(self) -> torch.Tensor:
        return (self.ce_sum / self.weight_sum).float()


class NormalizedEntropy(_WeightedSums):
    """Normalized entropy: log loss divided by the entropy of the base rate (the log loss of always
    predicting the observed click rate). Below 1 means better than that constant; lower is better.

    The base rate is clamped to ``[EPS, 1 - EPS]``, so a set with one class only gives a large finite NE
    (undefined in theory); an empty set gives nan.
    """

    higher_is_better = False

    def compute(self) -> torch.Tensor:
        rate = (self.positive_sum / self.weight_sum).clamp(EPS, 1 - EPS)
        base = -(rate * torch.log(rate) + (1 - rate) * torch.log1p(-rate))
        return (self.ce_sum / self.weight_sum / base).float()


class Calibration(_WeightedSums):
    """Predicted clicks over actual clicks, ``sum(w * p) / sum(w * y)``; 1 is calibrated, inf without positives."""

    def compute(self) -> torch.Tensor:
        return (self.prob_sum / self.positive_sum).float()


class _RecMetricCollection(MetricCollection):
    def update(self, *args: Any, **kwargs: Any) -> None:
        # BinaryAUROC would silently drop per-sample weights; refuse them rather than mix weighted and unweighted
        if kwargs.get("weight") is not None or len(args) > 2:
            raise ValueError(
                "rec_metrics: auroc does not support sample weights; update NormalizedEntropy / "
                "Calibration / LogLoss with weights separately"
            )
        kwargs.pop("weight", None)
        super().update(*args, **kwargs)


def rec_metrics(prefix: str = "", validate_args: bool = True) -> MetricCollection:
    """``{"auroc", "ne", "calibration", "logloss"}`` as one collection: ``update(probs, target)``.

    ``auroc`` is torchmetrics' exact BinaryAUROC (it keeps every prediction until ``compute``).
    Log it from a LightningModule with ``self.log_dict(metrics, on_epoch=True)`` after ``metrics.update``.
    """
    return _RecMetricCollection(
        {
            "auroc": BinaryAUROC(validate_args=validate_args),
            "ne": NormalizedEntropy(validate_args=validate_args),
            "calibration": Calibration(validate_args=validate_args),
            "logloss": LogLoss(validate_args=validate_args),
        },
        prefix=prefix,
        compute_groups=False,
    )
