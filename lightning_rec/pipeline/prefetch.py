"""Input dists a train pipeline started ahead of their forward, waiting for the forward that takes them.

A pipeline calls ``prefetch_input_dist(kjt)`` on every sharded collection for batch i+1 while batch i computes;
the collection's ``input_dist`` then takes over the exchange already in flight for that very KJT object. The
KJT's in-place version counters are kept with it: a KJT modified after its ids left would silently train on the
old ids, so taking it over then raises. An input dist no forward takes is dropped (its transfers waited for) without
delivering it: a stage hook's remap runs only in the forward of the batch it belongs to.
"""

from __future__ import annotations

from typing import Protocol

from lightning_rec import _compat
from lightning_rec.sparse import KeyedJaggedTensor

_MAX_PREFETCHED = 4  # batches whose input dist may wait for their forward (a pipeline keeps one or two)


class Droppable(Protocol):
    def drop(self) -> None: ...


def _versions(kjt: KeyedJaggedTensor) -> tuple[int, ...]:
    """In-place modification counters of the KJT's tensors: a prefetched input dist is valid while they hold."""
    return tuple(
        _compat.tensor_version(t) for t in (kjt.values(), kjt.lengths(), kjt.weights_or_none()) if t is not None
    )


class PrefetchQueue:
    """The prefetched input dists of one collection, oldest first (at most a few: older ones are waited for and
    dropped, so a batch the pipeline never ran cannot hold buffers forever)."""

    def __init__(self) -> None:
        self._items: list[tuple[KeyedJaggedTensor, tuple[int, ...], Droppable]] = []

    def __len__(self) -> int:
        return len(self._items)

    def add(self, features: KeyedJaggedTensor, ctx: Droppable) -> None:
        self._items.append((features, _versions(features), ctx))
        if len(self._items) > _MAX_PREFETCHED:
            self._items.pop(0)[2].drop()

    def take(self, features: KeyedJaggedTensor) -> Droppable | None:
        """The input dist started for this very KJT object (removed from the queue), or None."""
        for i, (prefetched, versions, ctx) in enumerate(self._items):
            if prefetched is features:
                del self._items[i]
                if _versions(features) != versions:
                    raise ValueError(
                        "a KeyedJaggedTensor was modified in place after the train pipeline had started its input "
                        "dist (ids, lengths or weights changed): build a new KeyedJaggedTensor instead, or train "
                        "without input pipelining"
                    )
                return ctx
        return None

    def discard(self, token: object) -> bool:
        """Drop ``token`` if no forward took it (waiting for its transfers); whether it was still there."""
        for i, (_, _, ctx) in enumerate(self._items):
            if ctx is token:
                del self._items[i]
                ctx.drop()
                return True
        return False

    def clear(self) -> int:
        """Drop every prefetched input dist (waiting for its transfers); how many there were."""
        n = len(self._items)
        for _, _, ctx in self._items:
            ctx.drop()
        self._items.clear()
        return n
