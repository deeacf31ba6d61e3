"""Input pipelining: the input dist of batch i+1 travels while batch i trains (TorchRec's ``TrainPipelineSparseDist``).

A sharded collection's input dist moves ids only, so it can start one batch early without changing any
result: the lookups, which read the weights, still run in the forward after the previous step's update.
:class:`InputPrefetcher` finds the KeyedJaggedTensor of each sharded collection in a batch and starts its
input dist (``ShardedCollection.prefetch_input_dist``). When the batch's forward runs, the pipeline hands each
collection the input dist it started for it (``InputPrefetcher.feeding``); the collection's forward, given
that same KJT, waits for it instead of starting its own, and what no forward took is dropped after the forward.
Used by :class:`TrainPipelineSparseDist` (loops without Lightning), and by ``RecShardedStrategy(pipeline=True)``
(:class:`PipelinedLoader` starts them, the strategy's training step hands them over). Results are bitwise those
of the unpipelined loop.

Managed collision remaps ids with state every step changes (admissions, evictions), so batch i+1's remap must
follow batch i's step. A sharded ``ManagedCollisionEmbedding(Bag)Collection`` remaps on the owners, in its
collection's stage hook, when the forward takes the input dist's delivery: its input dist may start early and
the remap still runs in order. Remapping before the input dist (``return_remapped_features=True``, or a
``ManagedCollisionCollection`` / ``MCHManagedCollisionModule`` called in the model's own forward) cannot run a
batch early: pipelining refuses those.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any, NamedTuple, Protocol, cast

import torch
from torch import nn

from lightning_rec.distributed.model_parallel import DistributedModelParallel
from lightning_rec.mc.embedding import ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection
from lightning_rec.mc.modules import ManagedCollisionCollection, MCHManagedCollisionModule
from lightning_rec.pipeline.shard_modules import ShardedCollection, sharded_collections
from lightning_rec.pipeline.stages import PrefetchedInputDist
from lightning_rec.sparse import KeyedJaggedTensor

_MC_WRAPPERS = (ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection)
_MC_TYPES = (MCHManagedCollisionModule, ManagedCollisionCollection, *_MC_WRAPPERS)
# started batches that may wait for their step: the loop's read-ahead (Lightning's one batch) plus the loader's
_MAX_WAITING = 4


def _inside(path: str, parent: str) -> bool:
    return parent == "" or path == parent or path.startswith(parent + ".")


def refuse_managed_collision(model: nn.Module, what: str) -> None:
    """Raise if ``model`` holds managed-collision modules that remap before a sharded collection's input dist
    (which therefore cannot start a batch early); wrappers remapping on the owners at delivery are fine."""
    named = list(model.named_modules())
    fine = [p for p, m in named if isinstance(m, _MC_WRAPPERS) and m.supports_input_pipelining]
    found = [p for p, m in named if isinstance(m, _MC_TYPES) and not any(_inside(p, f) for f in fine)]
    # a refused wrapper's own managed-collision modules need not be named again
    found = [p or "<root>" for p in found if not any(q != p and _inside(p, q) for q in found)]
    if found:
        raise ValueError(
            f"{what}: the managed-collision modules {found[:3]} remap ids before the sharded collection's input "
            "dist (return_remapped_features=True, or called in the model's own forward), with state the previous "
            "batch changes (admissions, evictions), so that input dist cannot start a batch early. Use "
            "ManagedCollisionEmbeddingBagCollection / ManagedCollisionEmbeddingCollection with "
            "return_remapped_features=False (they remap on the owners when the ids arrive, and pipeline), or train "
            "without input pipelining (RecShardedStrategy(pipeline=False), or "
            "TrainPipelineSparseDist(..., pipelined=False))"
        )


def find_kjts(batch: Any, _depth: int = 0) -> list[KeyedJaggedTensor]:
    """Every KeyedJaggedTensor in ``batch`` (the batch itself, or inside mappings, sequences, dataclasses and
    plain objects' attributes, a few levels deep), each once, in a deterministic order."""
    if isinstance(batch, KeyedJaggedTensor):
        return [batch]
    if _depth > 3 or isinstance(batch, (torch.Tensor, str, bytes, nn.Module)):
        return []
    if isinstance(batch, Mapping):
        children: Iterable[Any] = batch.values()
    elif isinstance(batch, (list, tuple)):
        children = batch
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        children = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    elif hasattr(batch, "__dict__") and not isinstance(batch, type):
        children = list(vars(batch).values())
    else:
        return []
    out: list[KeyedJaggedTensor] = []
    for child in children:
        for kjt in find_kjts(child, _depth + 1):
            if not any(kjt is k for k in out):
                out.append(kjt)
    return out


class Started(NamedTuple):
    """One collection's input dist of a batch, started ahead of the batch's forward."""

    path: str
    collection: ShardedCollection
    prefetched: PrefetchedInputDist


class InputPrefetcher:
    """Starts the input dists of a batch for every sharded collection of ``model`` (collective: every rank
    calls :meth:`start` with its own batch of the same step, in the same order), and hands them to the batch's
    forward (:meth:`feeding`).

    A collection's input is the one KeyedJaggedTensor of the batch that holds all its features; a collection
    with none or several such KJTs is not prefetched (its forward runs its input dist as usual).
    """

    def __init__(self, model: nn.Module, what: str = "input pipelining") -> None:
        refuse_managed_collision(model, what)
        self._what = what
        self._collections: list[tuple[str, ShardedCollection, frozenset[str]]] = [
            (path or "<root>", c, frozenset(f for t in c.tables for f in t.feature_names))
            for path, c in sharded_collections(model)
        ]
        self._waiting: list[list[Started]] = []  # started batches not yet fed to a forward, oldest first
        self._warned = False

    def start(self, batch: Any) -> list[Started]:
        """Start the input dist of ``batch`` (already on the model's device); returns what was started."""
        kjts = find_kjts(batch) if self._collections else []
        started = []
        for path, coll, features in self._collections:
            fits = [k for k in kjts if features <= set(k.keys())]
            if len(fits) == 1:
                started.append(Started(path, coll, coll.prefetch_input_dist(fits[0])))
        if started:
            self._waiting.append(started)
            if len(self._waiting) > _MAX_WAITING:  # batches no step ran must not hold their buffers forever
                self._drop_unfed(self._waiting[:1])
                del self._waiting[0]
        return started

    @contextmanager
    def feeding(self, started: list[Started]) -> Iterator[None]:
        """Run the forward of the batch ``started`` belongs to inside: each collection is handed the input dist
        started for it. Afterwards what no forward took is dropped, and said once."""
        self._waiting = [w for w in self._waiting if w is not started]
        try:
            with ExitStack() as stack:
                for s in started:
                    stack.enter_context(s.collection.feeding(s.prefetched))
                yield
        finally:
            missed = [s.path for s in started if s.prefetched.drop()]
        if missed:
            self._warn_once(
                f"the sharded collections {missed} were not called with the batch's own KeyedJaggedTensor (the "
                "object the data loader produced), so their input dist ran twice and nothing overlapped; pass the "
                "batch's KJT to the collection as is to benefit from pipelining"
            )

    def feeding_step(self, batch: Any) -> AbstractContextManager[None]:
        """:meth:`feeding` for a training step given ``batch``, for a loop that reads batches ahead of its steps
        (Lightning's): the waiting batch whose KJTs ``batch`` holds (older ones no step ran are dropped), else the
        oldest waiting one (a step reading its batch from an iterator itself)."""
        if not self._waiting:
            return nullcontext()
        kjts = find_kjts(batch)
        own = [i for i, w in enumerate(self._waiting) if any(s.prefetched.features is k for s in w for k in kjts)]
        first = own[0] if own else 0
        self._drop_unfed(self._waiting[:first])
        del self._waiting[:first]
        return self.feeding(self._waiting[0])

    def clear(self) -> int:
        """Drop every started input dist no forward took (local: no collective); returns how many there were.
        For batches read ahead of the last step run (end of training, an epoch cut short)."""
        waiting, self._waiting = self._waiting, []
        return sum(s.prefetched.drop() for w in waiting for s in w)

    def _drop_unfed(self, batches: list[list[Started]]) -> None:
        if sum(s.prefetched.drop() for w in batches for s in w):
            self._warn_once(
                "batches were started but no training step handed them to its forward, so their input dists ran "
                "twice and nothing overlapped"
            )

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"{self._what}: {message}", stacklevel=4)


class TrainPipelineSparseDist:
    """Train ``model`` (whose forward returns ``(losses, output)``, as ``DLRMTrain``'s does) one batch per call.

    Each :meth:`progress` call trains on one batch while the next batch's input dist (its ids on their way to
    the shard owners) is already in flight, as TorchRec's pipeline does; the weights are bitwise those of the
    plain loop (forward, backward, optimizer step per batch). Batches must have a ``.to(device)`` and carry
    the KeyedJaggedTensor the model passes to its sharded collections as is.

    Args (TorchRec's order): ``model``, ``optimizer`` (the dense / non-fused one), ``device``. The fused
    optimizer of a :class:`DistributedModelParallel` is stepped too. ``execute_all_batches`` is accepted;
    ``apply_jit=True`` (TorchScript) is not supported. ``pipelined=False`` runs one batch after the other
    (models that remap managed-collision ids before a sharded collection need it: ``refuse_managed_collision``).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        pipelined: bool = True,
        **kwargs: Any,
    ) -> None:
        if apply_jit:
            raise ValueError("TrainPipelineSparseDist(apply_jit=True): TorchScript is not supported")
        unknown = sorted(k for k, v in kwargs.items() if v not in (None, False))
        if unknown:
            raise ValueError(f"TrainPipelineSparseDist: options {unknown} are not supported")
        self._model = model
        self._optimizer = optimizer
        self._device = torch.device(device)
        fused = model.fused_optimizer if isinstance(model, DistributedModelParallel) else None
        inside = fused is not None and (fused is optimizer or fused in getattr(optimizer, "optimizers", ()))
        self._fused = None if inside else fused
        self._prefetcher = InputPrefetcher(model, "TrainPipelineSparseDist") if pipelined else None
        self._iter: Iterator[Any] | None = None
        self._next: tuple[Any, list[Started]] | None = None

    def _fetch(self) -> tuple[Any, list[Started]] | None:
        assert self._iter is not None
        try:
            batch = next(self._iter)
        except StopIteration:
            return None
        batch = batch.to(self._device)
        return batch, (self._prefetcher.start(batch) if self._prefetcher is not None else [])

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Train on the next batch of ``dataloader_iter``; return the model's output. Raises StopIteration at
        the end of the data. A different iterator than the last call's starts over from it."""
        if dataloader_iter is not self._iter:
            if self._prefetcher is not None:
                self._prefetcher.clear()
            self._iter = dataloader_iter
            self._next = self._fetch()
        current = self._next
        if current is None:
            raise StopIteration
        batch, started = current
        self._next = self._fetch()  # the next batch's ids travel while this one trains
        self._model.train()
        self._optimizer.zero_grad()
        with self._prefetcher.feeding(started) if self._prefetcher is not None else nullcontext():
            losses, output = self._model(batch)
        torch.sum(losses).backward()
        self._optimizer.step()
        if self._fused is not None:
            self._fused.step()
        return output


class _Resumable(Protocol):
    """A loader that saves its position (``ClickLoader``, Lightning's stateful loaders)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class PipelinedLoader:
    """A training data loader run one batch ahead: when batch i is handed out, batch i+1 is already on the device
    with its input dist started (``prefetcher``), so its ids travel while batch i trains. The training step hands
    those input dists to its forward (``InputPrefetcher.feeding_step``).

    ``move(batch)`` puts a batch on the device. Everything else (length, sampler, ``state_dict`` ...) is the
    wrapped loader's; its ``state_dict`` is the one taken right after the batch last handed out was read, so a
    checkpoint resumes at the next batch although one more was read ahead.
    """

    _OWN = frozenset({"loader", "_prefetcher", "_move", "_state"})

    def __init__(self, loader: Iterable[Any], prefetcher: InputPrefetcher, move: Any) -> None:
        self.loader, self._prefetcher, self._move = loader, prefetcher, move
        self._state: Any = None

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]  # TypeError for unsized loaders, as Lightning expects

    def __iter__(self) -> Iterator[Any]:
        return self._batches()

    def _pull(self, it: Iterator[Any]) -> tuple[Any, Any] | None:
        try:
            batch = next(it)
        except StopIteration:
            return None
        state = self.loader.state_dict() if hasattr(self.loader, "state_dict") else None
        batch = self._move(batch)
        self._prefetcher.start(batch)
        return batch, state

    def _batches(self) -> Iterator[Any]:
        self._prefetcher.clear()  # a batch read ahead by a previous epoch that stopped early (limits)
        self._state = None
        it = iter(self.loader)
        ahead = self._pull(it)
        while ahead is not None:
            batch, state = ahead
            ahead = self._pull(it)  # the next batch's ids leave now, while this one trains
            self._state = state
            yield batch

    def _state_dict(self) -> Any:
        # bound only for a loader with a state_dict (__getattr__ below)
        return self._state if self._state is not None else cast(_Resumable, self.loader).state_dict()

    def _load_state_dict(self, state: Any) -> None:
        self._state = None
        cast(_Resumable, self.loader).load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        if name in PipelinedLoader._OWN:
            raise AttributeError(name)
        if name == "state_dict" and hasattr(self.loader, "state_dict"):
            return self._state_dict
        if name == "load_state_dict" and hasattr(self.loader, "load_state_dict"):
            return self._load_state_dict
        return getattr(self.loader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in PipelinedLoader._OWN:
            object.__setattr__(self, name, value)
        else:  # e.g. Lightning's worker_init_fn: the wrapped loader's
            setattr(self.loader, name, value)
