"""The stage contract of every sharded collection: ``input_dist -> compute -> output_dist``, typed, and the
slot through which a train pipeline hands the forward an input dist it started ahead.

``input_dist`` checks this rank's input and starts the exchange of ids; it returns a :class:`LookupContext`
(the checked input, the exchange in flight and what it delivered: metadata, no lookups). ``compute`` returns the
lookups (``Lookups``: :class:`PooledLookups`, :class:`SequenceLookups`); ``output_dist`` takes the context and
those lookups and returns the forward's result (``Out``). :class:`Stages` writes ``forward`` once for all.

A :class:`RawIdHook` is the one permanent hook on those stages: tables whose ids arrive raw (managed collision),
routed by the hook's row keys in ``input_dist`` and turned into rows by its ``on_received`` when ``compute``
takes the delivery. A collection owns one :class:`RawIdRouting` for the hook it has now (or none); every input
dist started afterwards routes with it, while those already started keep the one they were routed for.

A pipeline calls ``prefetch_input_dist(kjt)`` on every sharded collection for batch i+1 while batch i computes,
and keeps the :class:`PrefetchedInputDist` it gets back. When it runs batch i+1's forward it hands that object to
the collection (``ShardedCollection.feeding``, a :class:`FeedSlot` held for the forward's duration); the
collection's ``input_dist`` takes over the exchange already in flight if it is given the very KJT the dist was
started for. Any other KJT runs its own input dist (the pipeline drops the unused one afterwards). The KJT's
in-place version counters are kept with it: a KJT modified after its ids left would silently train on the old
ids, so taking it over then raises. An input dist no forward takes is dropped (its transfers waited for) without
delivering it: a stage hook's remap runs only in the forward of the batch it belongs to.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Generic, NamedTuple, Protocol, TypeVar

import torch
from torch import nn

from lightning_rec import _compat
from lightning_rec.embedding_modules import FeatureLayout
from lightning_rec.pipeline.input_dist import PendingInputDist, Received, RowKey
from lightning_rec.sparse import KeyedJaggedTensor

Lookups = TypeVar("Lookups")
Out = TypeVar("Out")

RAW_ID_HOOK_ATTR = "raw_id_hook"  # where an unsharded collection carries the hook its sharded twin adopts
_MAX_ID = (1 << 63) - 1  # raw ids are only checked to be non-negative


class RawIdHook(Protocol):
    """Tables of a sharded collection fed raw ids instead of rows, and what their owner runs on arrival.

    Installed once (``ShardedCollection.set_raw_id_hook``, or at sharding: the sharded collection adopts the
    hook its unsharded module carries as ``raw_id_hook``), never toggled per forward. Every input dist then
    sends the raw ids of :attr:`tables` unchanged to the rank holding the global row ``row_key(table, ids)``
    names (only the owning rank matters), checking them only for being non-negative; :meth:`on_received` runs
    on every rank of the shard group when the forward takes the delivery (:meth:`LookupContext.wait`) and
    returns it with those ids made rows of the local shards. It runs there, not when the input dist starts, so
    an input dist a train pipeline started a batch early is remapped after the previous batch's remap and step.
    """

    @property
    def tables(self) -> frozenset[str]:
        """The raw-id tables (fixed once installed)."""
        ...

    def attach(self, collection: nn.Module) -> None:
        """Called when installed on ``collection`` (a ``ShardedCollection``); raise if it cannot serve it."""
        ...

    def row_key(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """For each raw id of ``table``, a global row on the rank that must receive it."""
        ...

    def on_received(self, received: Received) -> Received:
        """``received`` with every raw id made a row of this rank's shard (collective-free, on every rank)."""
        ...


class RawIdRouting:
    """``hook`` (None: every table takes row ids) and what the input dist needs of it: ``row_keys``, the row
    key of each raw-id feature (by feature index), and ``layout``, the collection's layout with those features'
    row counts lifted so that the input check only rejects negative raw ids.
    """

    def __init__(self, hook: RawIdHook | None, layout: FeatureLayout) -> None:
        self.hook = hook
        self.row_keys: dict[int, RowKey] | None = None
        self.layout: FeatureLayout | None = None
        if hook is None:
            return
        names = layout.feature_table_names
        unknown = sorted(hook.tables - set(names))
        if unknown:
            raise ValueError(f"raw-id tables {unknown} are not tables of this collection ({sorted(set(names))})")
        self.row_keys = {f: partial(hook.row_key, t) for f, t in enumerate(names) if t in hook.tables}
        self.layout = copy.copy(layout)
        self.layout.rows = [_MAX_ID if t in hook.tables else r for t, r in zip(names, layout.rows)]


@dataclass
class LookupContext:
    """One forward's metadata through the stages: this rank's checked input and its input dist.

    ``input_dist`` makes it with the exchange in flight; :meth:`wait` (in ``compute``) takes the delivery once;
    :meth:`drop` forgets an input dist no forward will take.
    """

    kjt: KeyedJaggedTensor  # this rank's input, checked, in config order
    pending: PendingInputDist | None = None  # the input dist in flight; None: no model-parallel table
    # the raw-id hook's remap (RawIdHook.on_received) the ids were routed for; runs once, at delivery
    on_received: Callable[[Received], Received] | None = None
    received: Received | None = None  # what the input dist delivered to this rank (set by ``wait``)

    def wait(self) -> Received | None:
        """The input dist's delivery (waiting for it once, then running ``on_received`` on it); None without
        model-parallel tables."""
        if self.received is None and self.pending is not None:
            recv, self.pending = self.pending.wait(), None
            self.received = recv if self.on_received is None else self.on_received(recv)
        return self.received

    def drop(self) -> None:
        """Wait for the transfers of an input dist no forward will take, without ``on_received``: a batch a
        pipeline read ahead but never trained must not change a hook's state (managed collision's admissions)."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None


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


class Stages(ABC, Generic[Lookups, Out]):
    """``forward`` as the three stages; subclasses supply them (``input_dist`` comes from the shared collection)."""

    @abstractmethod
    def input_dist(self, features: KeyedJaggedTensor) -> LookupContext: ...

    @abstractmethod
    def compute(self, ctx: LookupContext) -> Lookups: ...

    @abstractmethod
    def output_dist(self, ctx: LookupContext, lookups: Lookups) -> Out: ...

    def forward(self, features: KeyedJaggedTensor) -> Out:
        ctx = self.input_dist(features)
        return self.output_dist(ctx, self.compute(ctx))


def _versions(kjt: KeyedJaggedTensor) -> tuple[int, ...]:
    """In-place modification counters of the KJT's tensors: a prefetched input dist is valid while they hold."""
    return tuple(
        _compat.tensor_version(t) for t in (kjt.values(), kjt.lengths(), kjt.weights_or_none()) if t is not None
    )


class PrefetchedInputDist:
    """One collection's input dist of one KJT, started before its forward; taken by that forward or dropped."""

    def __init__(self, features: KeyedJaggedTensor, ctx: LookupContext) -> None:
        self.features = features
        self._versions = _versions(features)
        self._ctx: LookupContext | None = ctx

    @property
    def pending(self) -> bool:
        """Neither taken by a forward nor dropped yet."""
        return self._ctx is not None

    def take(self, features: KeyedJaggedTensor) -> LookupContext | None:
        """The forward's context with this input dist in flight, if ``features`` is the KJT it was started for
        and it is still pending; else None (the forward then runs its own)."""
        if features is not self.features or self._ctx is None:
            return None
        ctx, self._ctx = self._ctx, None
        if _versions(features) != self._versions:
            ctx.drop()
            raise ValueError(
                "a KeyedJaggedTensor was modified in place after the train pipeline had started its input "
                "dist (ids, lengths or weights changed): build a new KeyedJaggedTensor instead, or train "
                "without input pipelining"
            )
        return ctx

    def drop(self) -> bool:
        """Wait for the transfers of an input dist no forward took, without its stage hook (``LookupContext.drop``);
        returns whether it was still pending."""
        if self._ctx is None:
            return False
        ctx, self._ctx = self._ctx, None
        ctx.drop()
        return True


class FeedSlot:
    """What one collection's forwards may take over: the prefetched input dist of the batch being run, held by
    the pipeline around that batch's forward only, so no input dist outlives the step it was started for."""

    def __init__(self) -> None:
        self._fed: PrefetchedInputDist | None = None

    def take(self, features: KeyedJaggedTensor) -> LookupContext | None:
        return None if self._fed is None else self._fed.take(features)

    @contextmanager
    def holding(self, prefetched: PrefetchedInputDist) -> Iterator[None]:
        previous, self._fed = self._fed, prefetched
        try:
            yield
        finally:
            self._fed = previous
