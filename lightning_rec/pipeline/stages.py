"""The stage contract of every sharded collection: ``input_dist -> compute -> output_dist``, typed.

``input_dist`` checks this rank's input and starts the exchange of ids; it returns a :class:`LookupContext`
(the checked input, the exchange in flight and what it delivered: metadata, no lookups). ``compute`` returns the
lookups (``Lookups``: :class:`PooledLookups`, :class:`SequenceLookups`); ``output_dist`` takes the context and
those lookups and returns the forward's result (``Out``). :class:`Stages` writes ``forward`` once for all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

import torch

from lightning_rec.pipeline.input_dist import PendingInputDist, Received
from lightning_rec.sparse import KeyedJaggedTensor

Lookups = TypeVar("Lookups")
Out = TypeVar("Out")


@dataclass
class LookupContext:
    """One forward's metadata through the stages: this rank's checked input and its input dist.

    ``input_dist`` makes it with the exchange in flight; :meth:`wait` (in ``compute``) takes the delivery once.
    """

    kjt: KeyedJaggedTensor  # this rank's input, checked, in config order
    pending: PendingInputDist | None = None  # the input dist in flight; None: no model-parallel table
    on_received: Callable[[Received], Received] | None = None  # managed collision: remap on the owner
    received: Received | None = None  # what the input dist delivered to this rank (set by ``wait``)

    def wait(self) -> Received | None:
        """The input dist's delivery (waiting for it once); None without model-parallel tables."""
        if self.received is None and self.pending is not None:
            recv = self.pending.wait()
            self.received = recv if self.on_received is None else self.on_received(recv)
            self.pending = None
        return self.received


class PooledLookups(NamedTuple):
    """A pooled collection's lookups: the data-parallel tables' pooled rows of this rank's samples
    (``[b, their columns]``), and this rank's shards' pooled rows of every bag it received
    (``[sum of the shard ranks' batches, route columns]``); None where there is no such table."""

    dp: torch.Tensor | None
    shards: torch.Tensor | None


class SequenceLookups(NamedTuple):
    """A sequence collection's lookups: ``{feature: [ids, dim]}`` of the data-parallel tables, and per route the
    rows of every id this rank received (None without model-parallel tables)."""

    dp: dict[int, torch.Tensor]
    shards: list[torch.Tensor] | None


class Stages(Generic[Lookups, Out]):
    """``forward`` as the three stages; subclasses supply them (``input_dist`` comes from the shared collection)."""

    def input_dist(self, features: KeyedJaggedTensor) -> LookupContext:
        raise NotImplementedError

    def compute(self, ctx: LookupContext) -> Lookups:
        raise NotImplementedError

    def output_dist(self, ctx: LookupContext, lookups: Lookups) -> Out:
        raise NotImplementedError

    def forward(self, features: KeyedJaggedTensor) -> Out:
        ctx = self.input_dist(features)
        return self.output_dist(ctx, self.compute(ctx))
