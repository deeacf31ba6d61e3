"""An input dist a train pipeline started ahead of its forward, and the slot through which the forward takes it.

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

from collections.abc import Iterator
from contextlib import contextmanager

from lightning_rec import _compat
from lightning_rec.pipeline.stages import LookupContext
from lightning_rec.sparse import KeyedJaggedTensor


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
