"""Bytes the hot-path collectives send, by (sending host, receiving host, stage): what crosses between hosts.

Off unless ``LIGHTNING_REC_BYTE_COUNT=1`` is set or :func:`enable` / :func:`counting` turn it on; off, each
collective pays one read of a module attribute. On, each collective adds, per destination rank, the bytes this
rank sends it: all-to-alls as they are addressed (gloo, NCCL and the shared-memory transport send each
destination its own piece directly); all-gathers and sum all-reduces through torch.distributed as gloo's ring
moves them (this rank sends only to the next rank of the group: ``n - 1`` pieces for an all-gather, ``2 (n - 1)
/ n`` of the tensor for an all-reduce), through shared memory as every peer reading this rank's whole buffer.
A rank counts only what it sends; :func:`gather_byte_counts` sums every rank's table.

Hosts: as the transport numbers them (:func:`lightning_rec.transport.host_of`: global rank ``g`` runs on host
``g // LOCAL_WORLD_SIZE``). Stages: the innermost :func:`stage` label, else inferred from the calling function
(``input_dist``, ``output_dist_fwd``, ``output_dist_bwd``, ``dp_grad_sync``, ...), else ``module.function`` of the
first caller outside the transport. What does not go through the transport is not
counted: object collectives, barriers, checkpoints, and DDP's dense-gradient all-reduce unless its comm hook
is :func:`ddp_comm_hook`.
"""

from __future__ import annotations

import atexit
import inspect
import logging
import os
import weakref
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import PurePath
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

# the package imports this module while it initialises: its names are read at call time only
from lightning_rec import transport

_ENV = "LIGHTNING_REC_BYTE_COUNT"
ON = os.environ.get(_ENV, "0") not in ("", "0")  # read by the transport on every collective
log = logging.getLogger("lightning_rec.transport")

# (global source rank, global destination rank, stage) -> bytes
_COUNTS: defaultdict[tuple[int, int, str], int] = defaultdict(int)
_CALLS: defaultdict[str, int] = defaultdict(int)  # collectives counted, per stage
_STAGES: list[str] = []
_GROUP_RANKS: dict[int, tuple[weakref.ref, list[int]]] = {}

# the pipeline's call sites -> stage: by (file stem, function), else by file stem alone. Other functions of
# pipeline/collectives.py are generic wrappers, walked past to their caller; any other is named as it is
_KNOWN = {
    ("output_dist", "backward"): "output_dist_bwd",
    ("collectives", "backward"): "all_to_all_bwd",  # a differentiable all-to-all's reverse (sequence, weights)
    ("collectives", "_sum_touched_rows"): "dp_grad_sync",
    ("collectives", "_sum_touched_rows_sparse"): "dp_grad_sync",
    ("collectives", "_union_of_touched_rows"): "dp_grad_sync",
    ("collectives", "own_rows_of_union"): "fused_union",
    ("collectives", "gather_union"): "fused_union",
}
_MODULES = {
    "input_dist": "input_dist",
    "input_payload": "input_dist",
    "output_dist": "output_dist_fwd",
    "fused_lookup": "fused_union",
    "agreement": "agreement",
}
_GENERIC = {"_all_to_all", "all_to_all", "forward", "apply", "all_gather_ints", "all_gather_padded", "_all_gather_rows"}
_TRANSPORT_DIR = str(PurePath(__file__).parent)
_PACKAGE_DIR = str(PurePath(__file__).parent.parent)


def enable(on: bool = True) -> None:
    """Turn counting on (or off) in this process; every rank should agree, though nothing here needs it."""
    global ON
    ON = on


def enabled() -> bool:
    return ON


@contextmanager
def counting() -> Iterator[None]:
    """Count the collectives run inside (and keep what was counted before)."""
    was = ON
    enable(True)
    try:
        yield
    finally:
        enable(was)


@contextmanager
def stage(label: str) -> Iterator[None]:
    """Attribute the collectives run inside to ``label`` (innermost wins). Cheap enough to leave in hot code."""
    _STAGES.append(label)
    try:
        yield
    finally:
        _STAGES.pop()


def reset() -> None:
    _COUNTS.clear()
    _CALLS.clear()


def byte_counts(by: str = "host") -> dict[tuple[int, int, str], int]:
    """What this rank sent: ``{(src_host, dst_host, stage): bytes}`` (``by="rank"``: global ranks instead)."""
    if by not in ("host", "rank"):
        raise ValueError(f"by must be 'host' or 'rank', got {by!r}")
    if by == "rank":
        return dict(_COUNTS)
    out: defaultdict[tuple[int, int, str], int] = defaultdict(int)
    for (src, dst, label), n in _COUNTS.items():
        out[(transport.host_of(src), transport.host_of(dst), label)] += n
    return dict(out)


def collective_counts() -> dict[str, int]:
    """How many counted collectives this rank ran, per stage."""
    return dict(_CALLS)


def cross_host_bytes(counts: dict[tuple[int, int, str], int]) -> dict[str, int]:
    """Bytes between different hosts per stage, from a :func:`byte_counts` table (by host)."""
    out: defaultdict[str, int] = defaultdict(int)
    for (src, dst, label), n in counts.items():
        if src != dst:
            out[label] += n
    return dict(out)


def gather_byte_counts(group: dist.ProcessGroup | None = None, by: str = "host") -> dict[tuple[int, int, str], int]:
    """Every rank's :func:`byte_counts` summed (collective over ``group``; uses torch.distributed directly, so
    it is not counted itself)."""
    mine = byte_counts(by)
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    out: defaultdict[tuple[int, int, str], int] = defaultdict(int)
    for table in everyone:
        for key, n in table.items():
            out[key] += n
    return dict(out)


def log_byte_counts(steps: int = 1) -> str:
    """One debug line of this rank's bytes per step, by host pair and stage; returned as well."""
    parts = [f"{s}->{d} {label}: {n / steps:.0f}" for (s, d, label), n in sorted(byte_counts().items())]
    line = f"bytes sent per step ({steps} steps): " + ("; ".join(parts) or "none")
    log.debug(line)
    return line


@atexit.register
def _log_at_exit() -> None:
    if _COUNTS:
        log_byte_counts()


# -- recording (called by the transport only while ON) ------------------------------------------------


def _ranks(group: dist.ProcessGroup | None) -> list[int]:
    pg = group if group is not None else dist.group.WORLD
    cached = _GROUP_RANKS.get(id(pg))
    if cached is not None and cached[0]() is pg:
        return cached[1]
    ranks = dist.get_process_group_ranks(pg) if group is not None else list(range(dist.get_world_size()))
    _GROUP_RANKS[id(pg)] = (weakref.ref(pg), ranks)
    return ranks


def _label(frame: FrameType | None) -> str:
    if _STAGES:
        return _STAGES[-1]
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_PACKAGE_DIR) and not path.startswith(_TRANSPORT_DIR):
            key = (PurePath(path).stem, frame.f_code.co_name)
            known = _KNOWN.get(key) or _MODULES.get(key[0])
            if known is not None:
                return known
            if not (key[0] == "collectives" and key[1] in _GENERIC):
                return f"{key[0]}.{key[1]}"
        frame = frame.f_back
    return "other"


def record(group: dist.ProcessGroup | None, per_dest: Sequence[int]) -> None:
    """This rank sent ``per_dest[r]`` bytes to rank ``r`` of ``group`` (its own entry is ignored)."""
    ranks = _ranks(group)
    me = dist.get_rank(group)
    label = _label(inspect.currentframe())
    _CALLS[label] += 1
    src = ranks[me]
    for r, n in enumerate(per_dest):
        if n and r != me:
            _COUNTS[(src, ranks[r], label)] += int(n)


def record_everyone(group: dist.ProcessGroup | None, nbytes: int, ring: bool, reduce: bool) -> None:
    """An all-gather (``reduce=False``) or sum all-reduce of ``nbytes`` per rank: gloo's ring (``ring``) sends
    the next rank ``n - 1`` pieces or ``2 (n - 1) / n`` of the tensor; shared memory, every peer the whole."""
    n = dist.get_world_size(group)
    if n == 1:
        return
    me = dist.get_rank(group)
    if not ring:
        record(group, [nbytes] * n)
        return
    sent = 2 * (n - 1) * nbytes // n if reduce else (n - 1) * nbytes
    record(group, [sent if r == (me + 1) % n else 0 for r in range(n)])


def nbytes_of(lists: Sequence[Sequence[torch.Tensor]]) -> list[int]:
    return [sum(t.numel() * t.element_size() for t in lst) for lst in lists]


def ddp_comm_hook(state: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default all-reduce of a gradient bucket, counted as stage ``dense_grad_allreduce``:
    ``ddp.register_comm_hook(None, ddp_comm_hook)`` before the first step. Lightning registers
    ``DDPStrategy(ddp_comm_hook=...)`` on CUDA only; elsewhere a callback's ``on_train_start`` can call
    ``trainer.strategy.model.register_comm_hook``."""
    if ON:
        buf = bucket.buffer()
        with stage("dense_grad_allreduce"):
            record_everyone(state, buf.numel() * buf.element_size(), ring=True, reduce=True)
    return allreduce_hook(state, bucket)  # type: ignore[arg-type]


# DDP checks a hook's annotations as objects; this module's are strings (postponed evaluation)
ddp_comm_hook.__annotations__ = {
    "state": dist.ProcessGroup | None,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
