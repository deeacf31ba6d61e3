"""ClickLoader: a stateful DataLoader for the click readers, and the per-step agreement of ranks on their batches.

Every rank of a sharded model runs every forward and backward (each lookup is a collective), so all ranks
must take a batch at the same step, or all stop. ``agreed`` wraps an iterator so that, at each step, the
ranks exchange one status each (batch / exhausted / failed) over gloo: a rank that failed to read (a bad
line) or ran out of batches while others have one makes *every* rank raise at that step, with the failing
rank's message, instead of leaving the others waiting in a collective until the group timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_rec import _compat
from lightning_rec.data._stream import ClickStream
from lightning_rec.transport import inflight

_OK, _DONE, _FAILED = 0, 1, 2
_GLOO_GROUPS: dict[int, Any] = {}


def status_group() -> Any:
    """A gloo group for the status flags (the default group when it is gloo; created once otherwise)."""
    if dist.get_backend() == "gloo":
        return None
    key = id(_compat.default_group())
    if key not in _GLOO_GROUPS:
        _GLOO_GROUPS[key] = dist.new_group(backend="gloo", timeout=_compat.group_timeout())
    return _GLOO_GROUPS[key]


def agreement_needed() -> bool:
    """Whether ranks must agree on each batch: a process group of more than one rank exists."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _fetch(iterator: Iterator[Any]) -> tuple[Any, BaseException | None, int]:
    try:
        return next(iterator), None, _OK
    except StopIteration:
        return None, None, _DONE
    except Exception as e:  # reported on every rank by `agreed`
        return None, e, _FAILED


def agreed(iterator: Iterator[Any], what: str) -> Iterator[Any]:
    """Yield from ``iterator`` while every rank has an item; raise on every rank as soon as one has none.

    A rank whose ``next`` raised re-raises its own error; the others raise the same type (ValueError,
    else RuntimeError) with that rank's message. Ranks running out at different steps raise a RuntimeError
    naming which ranks had batches left. All ranks stop together when all run out.

    The exchange is off the critical path: the next item is fetched before this one is handed out and its
    status travels (an asynchronous all-gather of one int per rank) while the caller works on this one.
    """
    group = status_group()
    world = dist.get_world_size(group)

    def exchange(status: int) -> tuple[list[torch.Tensor], inflight.Tracked]:
        flags = [torch.zeros(1, dtype=torch.int32) for _ in range(world)]
        mine = torch.tensor([status], dtype=torch.int32)
        return flags, inflight.track(dist.all_gather(flags, mine, group=group, async_op=True), flags, mine)

    step = 0
    item, error, status = _fetch(iterator)
    flags, work = exchange(status)
    while True:
        work.wait()
        statuses = [int(f) for f in flags]
        if all(s == _OK for s in statuses):
            current = item
            item, error, status = _fetch(iterator)
            flags, work = exchange(status)
            try:
                yield current
            except GeneratorExit:
                # the caller stopped early (max_steps, limit_*_batches, an error): every rank sent this status
                # before handing out its batch, so it completes; waited for here, not left running at exit
                work.settle()
                raise
            step += 1
            continue
        if all(s == _DONE for s in statuses):
            return
        failed = [r for r, s in enumerate(statuses) if s == _FAILED]
        if failed:
            messages: list[Any] = [None] * world
            own = None if error is None else (type(error).__name__, str(error))
            dist.all_gather_object(messages, own, group=group)
            if error is not None:
                raise error
            kind, text = messages[failed[0]]
            cls = ValueError if kind == "ValueError" else RuntimeError
            raise cls(f"{what}: rank {failed[0]} failed reading its batch {step} ({kind}): {text}")
        done = [r for r, s in enumerate(statuses) if s == _DONE]
        more = [r for r, s in enumerate(statuses) if s == _OK]
        raise RuntimeError(
            f"{what}: ranks {done} ran out of batches after {step} batches while ranks {more} have more. Every rank "
            "must yield the same number of batches (each sharded lookup is a collective across ranks): give each "
            "rank an equal share, or drop the rows that do not fill a batch on every rank"
        )


class AgreedLoader:
    """Wraps any iterable (e.g. a DataLoader of an IterableDataset without a length) with ``agreed``.

    ``state_dict`` / ``load_state_dict`` are passed through when the wrapped loader has them.
    """

    def __init__(self, loader: Iterable[Any], what: str = "dataloader") -> None:
        self.loader, self.what = loader, what

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        return agreed(it, self.what) if agreement_needed() else it

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


class ClickLoader:
    """A stateful loader of a :class:`ClickStream` (``SyntheticClicks``, ``CriteoTSV``, ``CriteoNpy``, ...).

    Iterating starts the next epoch (the first from a loaded state, if any); ``state_dict()`` holds the epoch
    and the stream position after the batches yielded so far, so a checkpoint taken at any step resumes at
    the next batch (Lightning saves and restores it with the fit loop, as for torchdata's
    ``StatefulDataLoader``). The state is the same on every rank; loaded at another world size, the rows
    left are re-split over the new ranks. Worker processes (``num_workers``) each read whole batches
    round-robin; ``pin_memory`` pins them for non-blocking copies to the GPU. Under a process group of more
    than one rank, the ranks agree on every batch (see ``agreed``). ``epoch_hint()`` (e.g. the trainer's
    ``current_epoch``) is the least epoch a new epoch may start at, for a resume that brings no loader state.
    """

    _epoch: int | None  # the epoch being read (None before the first, and after a load_state_dict)

    def __init__(
        self,
        dataset: ClickStream,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        what: str | None = None,
        multiprocessing_context: str | None = None,
        epoch_hint: Callable[[], int] | None = None,
    ) -> None:
        # not `.dataset`: Lightning warns on every run about an IterableDataset with a length behind `.dataset`,
        # a hazard of hand-sharded datasets that the stream's own sharding avoids
        self.stream = dataset
        self.num_workers, self.pin_memory = int(num_workers), bool(pin_memory)
        # the datasets batch themselves: batch_size=None turns off the DataLoader's own batching. Workers are
        # not persistent: each epoch's iterator sends them the dataset with that epoch's position. They are
        # forked where the platform can (a process started by spawn, e.g. by torch.multiprocessing, would
        # otherwise spawn them too, re-importing everything every epoch); they never touch the process group.
        if multiprocessing_context is None and self.num_workers and "fork" in mp.get_all_start_methods():
            multiprocessing_context = "fork"
        self._loader = DataLoader(
            dataset,
            batch_size=None,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            prefetch_factor=prefetch_factor if self.num_workers else None,
            persistent_workers=False,
            multiprocessing_context=multiprocessing_context if self.num_workers else None,
        )
        self.what = what or type(dataset).__name__
        self._next_epoch, self._resume, self._resume_batches = 0, 0, 0
        self._epoch, self._start, self._start_batches, self._yielded = None, 0, 0, 0
        # the trainer's epoch: Lightning does not hand a loader its saved state when it resumes from a checkpoint
        # taken at the end of an epoch, so a fresh loader would replay epoch 0's rows
        self._epoch_hint = epoch_hint

    def __len__(self) -> int:
        return len(self.stream)

    def __iter__(self) -> Iterator[Any]:
        # a generator: the epoch starts at the first next(), so an iter() that only probes the loader (as
        # Lightning's check that a loader is iterable does) neither starts an epoch nor its workers
        if self._epoch_hint is not None and self._resume == 0 and self._resume_batches == 0:
            self._next_epoch = max(self._next_epoch, int(self._epoch_hint()))
        self._epoch, self._start, self._start_batches = self._next_epoch, self._resume, self._resume_batches
        self._yielded = 0
        self._next_epoch, self._resume, self._resume_batches = self._epoch + 1, 0, 0
        self.stream.set_position(self._epoch, self._start)
        it: Iterator[Any] = iter(self._loader)
        if agreement_needed():
            it = agreed(it, self.what)
        for batch in it:
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "position", "batches", ...}``: where the next batch starts, and how many batches of the
        epoch this rank has taken (the same on every rank)."""
        if self._epoch is None:
            epoch, position, batches = self._next_epoch, self._resume, self._resume_batches
        else:
            epoch, position = self._epoch, self.stream.position_after(self._yielded)
            batches = self._start_batches + self._yielded
        return {
            "epoch": epoch,
            "position": position,
            "batches": batches,
            "layout": [self.stream.world_size, self.stream.batch_size],
            **self.stream.describe(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s position (a finished epoch resumes at the start of the next one); saved at
        another world size or batch size, the rows left are re-split over this layout."""
        mine = self.stream.describe()
        differ = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if differ:
            raise ValueError(
                f"{self.what}: the loader state was saved for other data (saved vs now: {differ}); "
                "resume with the same rows, shuffle and seed"
            )
        epoch, position, batches = int(state["epoch"]), int(state["position"]), int(state.get("batches", 0))
        self.stream.set_position(epoch, position)
        if self.stream.epoch_done(position):
            epoch, position, batches = epoch + 1, 0, 0
        elif state.get("layout", [self.stream.world_size, self.stream.batch_size]) != [
            self.stream.world_size,
            self.stream.batch_size,
        ]:
            left = self.stream.batches_left()
            if batches + left > len(self):
                # Lightning counts batches across the resume and stops the epoch at len(loader) batches
                warnings.warn(
                    f"{self.what}: resumed at another layout (world size, batch size {state.get('layout')} -> "
                    f"{[self.stream.world_size, self.stream.batch_size]}) after {batches} batches, with {left} "
                    f"batches of this epoch left, but the epoch has {len(self)} batches in this layout: a Lightning "
                    f"fit loop ends this epoch after {len(self) - batches} of them, skipping the rest of its rows. "
                    "Resume at the same layout, or at the end of an epoch, to read every row",
                    stacklevel=2,
                )
        self._next_epoch, self._resume, self._resume_batches, self._epoch = epoch, position, batches, None
