"""Evaluation with unequal batch counts: a rank out of batches keeps joining the others' sharded lookups.

Every sharded lookup is a collective, so under ``rec_sharded`` a rank that ran out of validation, test or
prediction batches would leave the others waiting. Lightning's predict sampler does not pad (each sample is
predicted once) and users' own evaluation loaders may differ in length, so ranks can legitimately run
different numbers of evaluation steps. The rank with fewer batches records which lookup modules one of its
steps called, with which feature keys, and after its last batch of a dataloader calls them again with empty
batches once per step it is short. The user's step never sees those calls: no empty batch reaches
``predict_step`` or ``validation_step``, nothing is logged or returned, and every sample is evaluated exactly once.

Evaluation makes no other collectives per step (DDP synchronises nothing without gradients; ``sync_dist``
logging reduces at epoch end), so replaying the lookups is all the others wait for. Training keeps equal
counts (its gradients are collectives too); the strategy checks them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from lightning_rec.mc.embedding import ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection
from lightning_rec.pipeline.shard_modules import ShardedCollection
from lightning_rec.sparse import KeyedJaggedTensor

# modules whose forward makes collectives; a managed-collision wrapper remaps across ranks before its lookup
_LOOKUPS = (ShardedCollection, ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection)


def lookup_roots(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost modules of ``model`` whose forward is a collective lookup, in module order."""
    found: list[tuple[str, nn.Module]] = []
    for path, m in model.named_modules():
        if isinstance(m, _LOOKUPS) and not any(path.startswith(f"{p}.") or not p for p, _ in found):
            found.append((path, m))
    return found


@dataclass(frozen=True)
class _Call:
    module: nn.Module
    keys: tuple[str, ...]
    weighted: bool
    device: torch.device


class UnevenEvaluation:
    """Joins the other ranks' lookups after this rank's last batch of each evaluation dataloader.

    Args:
        model: the (sharded) LightningModule.
        counts: this rank's batches per dataloader.
        most: the most batches any rank runs, per dataloader.
    """

    def __init__(self, model: nn.Module, counts: Sequence[int], most: Sequence[int]) -> None:
        self.counts = [int(c) for c in counts]
        self.most = [int(m) for m in most]
        self._steps = 0
        self._calls: list[_Call] = []
        self._recording: list[_Call] | None = None
        self._handles = [m.register_forward_pre_hook(self._record, with_kwargs=True) for _, m in lookup_roots(model)]

    @classmethod
    def if_needed(cls, model: nn.Module, stage: str, counts: Sequence[float]) -> UnevenEvaluation | None:
        """Compare every rank's batch counts (collective); an instance when they differ and can be joined.

        Raises on every rank when they cannot: a rank without any batch before others' batches, or a loader
        without a length beside sized ones.
        """
        mine = [c if c == float("inf") else int(c) for c in counts]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        if all(c == gathered[0] for c in gathered):
            return None
        finite = all(c != float("inf") for g in gathered for c in g)
        bad = unreplayable(gathered) if finite else []
        if not finite or bad or len({len(g) for g in gathered}) > 1:
            limit = {"validation": "val", "test": "test", "prediction": "predict"}[stage]
            why = (
                f"rank {bad[0][0]} has no {stage} batch of dataloader {bad[0][1]} while other ranks have some, "
                "so it cannot join their lookups"
                if bad
                else "a loader without a length runs beside sized ones"
            )
            raise ValueError(
                f"rec_sharded: ranks would run different numbers of {stage} batches (by rank: {gathered}) and {why}. "
                "Every sharded lookup is a collective across ranks. Give every rank at least one batch of each "
                f"dataloader (fewer ranks, a smaller batch size), loaders of equal length, or limit_{limit}_batches"
            )
        # every count is finite (checked above): an int
        return cls(model, cast("list[int]", mine), [max(g[d] for g in gathered) for d in range(len(mine))])

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _record(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._recording is None:
            return
        features = args[0] if args else kwargs.get("features")
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(
                f"rec_sharded: {type(module).__name__} was given a {type(features).__name__}, not a KeyedJaggedTensor"
            )
        self._recording.append(
            _Call(module, tuple(features.keys()), features.weights_or_none() is not None, features.values().device)
        )

    def step(self, run: Any, *args: Any, **kwargs: Any) -> Any:
        """Run one evaluation step (``run(*args, **kwargs)``); after this rank's last batch of a dataloader,
        join the steps it is short of, there and in the following dataloaders where it has no batch."""
        self._recording = []
        try:
            out = run(*args, **kwargs)
            self._calls = self._recording
        finally:
            self._recording = None
        self._steps += 1
        done, d = 0, 0
        while d < len(self.counts) and done + self.counts[d] < self._steps:
            done += self.counts[d]
            d += 1
        if d < len(self.counts) and self._steps == done + self.counts[d]:  # this was the last batch of dataloader d
            short = self.most[d] - self.counts[d]
            d += 1
            while d < len(self.counts) and self.counts[d] == 0:
                short += self.most[d]
                d += 1
            for _ in range(short):
                self._replay()
        return out

    def _replay(self) -> None:
        for call in self._calls:
            empty = torch.zeros(0, dtype=torch.long, device=call.device)
            kjt = KeyedJaggedTensor(
                list(call.keys),
                empty,
                weights=torch.zeros(0, device=call.device) if call.weighted else None,
                lengths=torch.zeros(0, dtype=torch.long, device=call.device),
                stride=0,
            )
            call.module(kjt)


def unreplayable(counts: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """``(rank, dataloader)`` pairs where a rank has no batch before others' batches it would have to join:
    with nothing evaluated yet, it cannot know which lookups a step makes."""
    bad = []
    for rank, mine in enumerate(counts):
        for d, c in enumerate(mine):
            if c:
                break
            if any(other[d] for other in counts):
                bad.append((rank, d))
    return bad


class EvaluationSteps:
    """The Trainer strategy's evaluation steps (it owns one and calls it from its hooks): through an
    :class:`UnevenEvaluation` while the ranks' batch counts differ, directly otherwise."""

    def __init__(self) -> None:
        self._uneven: UnevenEvaluation | None = None

    def start(self, model: nn.Module, stage: str, counts: Sequence[float], world_size: int) -> None:
        """At an evaluation's start: compare every rank's batch counts (collective where ``world_size > 1``)."""
        self.end()
        if world_size > 1:
            self._uneven = UnevenEvaluation.if_needed(model, stage, counts)

    def run(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One evaluation step: ``step(*args, **kwargs)``, joined by replayed lookups where this rank is short."""
        if self._uneven is None:
            return step(*args, **kwargs)
        return self._uneven.step(step, *args, **kwargs)

    def end(self) -> None:
        """At an evaluation's end (or teardown, after one that raised): no hooks left on the module."""
        if self._uneven is not None:
            self._uneven.close()
            self._uneven = None
