"""How the hot-path collectives move bytes: through torch.distributed, or through shared memory on one host.

Gloo moves tensors between processes through loopback TCP and its own threads, several times slower than
a copy through shared memory between processes of one host (measured in ``benchmarks/results/vs_torchrec.md``
against ``vs_torchrec_gloo_transport.md``). So, when every rank of a gloo group runs on one host (same boot, same pid
namespace: agreed once per group, collectively), the three collectives of the sharded step
(variable all-to-all, all-gather, sum all-reduce of CPU tensors) go through per-rank shared buffers;
everything else, and every other group, stays on torch.distributed. ``LIGHTNING_REC_SHM=0`` on any rank
keeps a group on torch.distributed.

The interface is the five functions below (``all_to_all_single``, ``all_to_all_pieces``, ``all_to_all_views``,
``all_gather_single``, ``all_reduce_sum``) plus ``shared_group`` / ``close_all``; each runs through one of two
implementations, torch.distributed or the shared-memory protocol of :mod:`lightning_rec.transport.shm` (the
collectives' signatures and byte copies: :mod:`lightning_rec.transport.wire`). Nothing here knows about embeddings.

Memory: each rank of a shared group holds two buffers (one per collective parity) in anonymous memory files.
They start at 1 MiB and double to the largest exchange the group has run, and are never shrunk (a step's
exchanges repeat, so the next step reuses them): a group whose largest exchange is a 16 MiB all-reduce bucket
holds up to about 64 MiB per rank (two buffers of up to twice the bucket). A rank that cannot grow a buffer
makes that collective run through torch.distributed on every rank.

Across hosts (a group whose ranks are on more than one host, hosts as :func:`host_of` numbers them), the
variable all-to-alls of CPU tensors go as point-to-point messages with every receive posted first
(:mod:`lightning_rec.transport.pairwise`): through gloo's all-to-all a slow link's two directions run one after
the other when the ranks arrive apart. ``LIGHTNING_REC_PAIRWISE=0`` (on every rank) keeps gloo's all-to-all
there, ``=1`` takes the messages within a host too; it is read once, at import (:func:`pairwise_mode`), and
sharding checks that every rank read the same value (``pipeline/agreement.py``).

``async_op``: through torch.distributed the work runs asynchronously, as torch's. Through shared memory the
collective completes before the call returns (the returned work is already done): the group's next collectives
reuse its two buffers, so a collective left open while the step runs others on the same group would have its
bytes overwritten. Prefetching an input dist therefore overlaps with gloo only.

Accounting (:mod:`lightning_rec.transport.accounting`): with ``LIGHTNING_REC_BYTE_COUNT=1``, or inside
``counting()``, every collective here adds the bytes this rank sends each peer to a table by (source host,
destination host, stage); ``byte_counts()`` reads it, ``reset_byte_counts()`` clears it, ``stage(label)`` names
the stage of the collectives run inside. Off, it costs one attribute read per collective.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

import torch
import torch.distributed as dist

from lightning_rec.transport import accounting, wire
from lightning_rec.transport.accounting import byte_counts, counting, stage
from lightning_rec.transport.accounting import reset as reset_byte_counts
from lightning_rec.transport.pairwise import start as start_pairwise
from lightning_rec.transport.pairwise import wait_all
from lightning_rec.transport.shm import close_all, shared_group

__all__ = [
    "PendingPieces",
    "all_gather_single",
    "all_reduce_sum",
    "all_to_all_pieces",
    "all_to_all_single",
    "all_to_all_views",
    "byte_counts",
    "close_all",
    "counting",
    "host_of",
    "pairwise_mode",
    "reset_byte_counts",
    "shared_group",
    "spans_hosts",
    "stage",
]

T = TypeVar("T")
# torch 2.13 renamed all_gather_into_tensor (the old name warns); both exist there.
_dist_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# id of a group -> (it, weakly, and whether its ranks are on more than one host)
_SPANS: dict[int, tuple[weakref.ref, bool]] = {}


PAIRWISE_ENV = "LIGHTNING_REC_PAIRWISE"
PAIRWISE_MODES = ("auto", "0", "1")
# Read once, at import: ranks that ran one exchange as messages and the other as gloo's all-to-all would hang, so
# a change made later on one rank must not take effect; sharding checks that every rank read the same value.
_PAIRWISE_SET = os.environ.get(PAIRWISE_ENV, "auto") or "auto"


def pairwise_mode() -> str:
    """``LIGHTNING_REC_PAIRWISE`` as this process read it at import (``auto``, ``0`` or ``1``); raises naming the
    accepted values for any other."""
    if _PAIRWISE_SET not in PAIRWISE_MODES:
        raise ValueError(f"{PAIRWISE_ENV}={_PAIRWISE_SET!r}: expected one of {', '.join(PAIRWISE_MODES)}")
    return _PAIRWISE_SET


def _pairwise(group: dist.ProcessGroup | None, asked: bool | None) -> bool:
    """Whether a CPU variable all-to-all on ``group`` goes as point-to-point messages: as ``asked``, else as
    ``LIGHTNING_REC_PAIRWISE`` says (:func:`pairwise_mode`; default: where the group spans hosts)."""
    if asked is not None:
        return asked
    mode = pairwise_mode()
    if mode in ("0", "1"):
        return mode == "1"
    return spans_hosts(group)


def host_of(rank: int) -> int:
    """The host of global rank ``rank``: ranks are numbered host by host, ``LOCAL_WORLD_SIZE`` to a host (the
    layout torchrun and Lightning give a multi-node job; unset: one host)."""
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    return rank // per_host if per_host > 0 else 0


def spans_hosts(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group``'s ranks (None: the world's) are on more than one host (:func:`host_of`); remembered per
    group."""
    g = group if group is not None else dist.group.WORLD
    hit = _SPANS.get(id(g))
    if hit is None or hit[0]() is not g:
        ranks = dist.get_process_group_ranks(g)
        hit = (weakref.ref(g), len({host_of(r) for r in ranks}) > 1)
        _SPANS[id(g)] = hit
    return hit[1]


def all_to_all_single(
    out: torch.Tensor,
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup | None,
    async_op: bool = False,
) -> dist.Work | None:
    """``dist.all_to_all_single`` (splits in rows of dim 0); through shared memory where the group allows."""
    if accounting.ON:
        n, row = dist.get_world_size(group), wire.row_bytes(x)
        accounting.record(group, [s * row for s in in_splits] if in_splits else [x.shape[0] // n * row] * n)
    if x.device.type == "cpu" and out.device.type == "cpu":
        shared = shared_group(group)
        if shared is not None and shared.all_to_all(out, x, out_splits, in_splits):
            return None
    return dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=async_op)


class PendingPieces(Generic[T]):
    """The result of :func:`all_to_all_pieces`: :meth:`wait` returns what ``consume`` made (computed once)."""

    def __init__(
        self, done: tuple[T] | None, work: dist.Work | None = None, finish: Callable[[], T] | None = None
    ) -> None:
        self._done, self._work, self._finish = done, work, finish

    def wait(self) -> T:
        if self._done is None:
            assert self._finish is not None
            if self._work is not None:
                self._work.wait()
            self._done, self._work, self._finish = (self._finish(),), None, None
        return self._done[0]


def all_to_all_pieces(
    sends: list[list[torch.Tensor]],
    recv_sizes: list[list[int]],
    consume: Callable[[list[list[torch.Tensor]]], T],
    group: dist.ProcessGroup | None,
    device: torch.device,
    async_op: bool = False,
    pairwise: bool | None = None,
) -> PendingPieces[T]:
    """Variable all-to-all of 1-D pieces of one dtype: this rank's ``sends[r]`` reach rank ``r``, where
    ``recv_sizes[s]`` gives the numel of each piece from rank ``s``. ``consume(got)`` gets every source's pieces
    (``got[s]``) and returns what the caller keeps; the pieces are only valid while it runs (through shared
    memory they are views of the sender's buffer, or this rank's own ``sends``), so it copies out what it
    needs, and a caller that reorders pieces pays one copy where a receive buffer would cost two.

    ``pairwise``: CPU tensors through torch.distributed (gloo) as point-to-point messages with only the peers
    that exchange bytes, every receive posted first (:mod:`~lightning_rec.transport.pairwise`: the two
    directions of a link overlap even when the ranks arrive apart); always asynchronous until
    :meth:`PendingPieces.wait`. None: where the group spans hosts (``LIGHTNING_REC_PAIRWISE`` overrides).
    Ignored on other devices: separate receives posted first would block NCCL's stream in turn on both peers.
    """
    if dist.get_world_size(group) == 1:  # a group of one: this rank's pieces are what it receives
        return PendingPieces((consume([list(sends[0])]),))
    if accounting.ON:
        accounting.record(group, accounting.nbytes_of(sends))
    if device.type == "cpu":
        shared = shared_group(group)
        if shared is not None:
            done = shared.pieces(sends, recv_sizes, consume)
            if done is not None:
                return PendingPieces(done)
    dtype = wire.pieces_dtype(sends)
    if device.type == "cpu" and _pairwise(group, pairwise):
        return _pieces_pairwise(sends, recv_sizes, consume, group, device, dtype)
    flat = [t for lst in sends for t in lst]
    whole = wire.spanning(flat)  # pieces split from one buffer: send it as it is
    send = (
        whole.view(dtype)
        if whole is not None and whole.numel() % torch.empty(0, dtype=dtype).element_size() == 0
        else torch.cat(flat)
        if flat
        else torch.zeros(0, dtype=dtype, device=device)
    )
    out_splits = [sum(sizes) for sizes in recv_sizes]
    out = torch.empty(sum(out_splits), dtype=dtype, device=device)
    work = dist.all_to_all_single(
        out, send, out_splits, [sum(t.numel() for t in lst) for lst in sends], group=group, async_op=async_op
    )

    def finish() -> T:
        parts = torch.split(out, out_splits)
        return consume([list(torch.split(p, sizes)) for p, sizes in zip(parts, recv_sizes)])

    return PendingPieces(None, work, finish)


def _pieces_pairwise(
    sends: list[list[torch.Tensor]],
    recv_sizes: list[list[int]],
    consume: Callable[[list[list[torch.Tensor]]], T],
    group: dist.ProcessGroup | None,
    device: torch.device,
    dtype: torch.dtype,
) -> PendingPieces[T]:
    me = dist.get_rank(group)
    into = [torch.empty(0 if s == me else sum(sizes), dtype=dtype, device=device) for s, sizes in enumerate(recv_sizes)]
    out = [None if d == me else wire.gather(list(lst)) for d, lst in enumerate(sends)]
    works = start_pairwise(out, [t.view(torch.uint8) for t in into], group)

    def finish() -> T:
        wait_all(works)
        got = [list(sends[me]) if s == me else list(torch.split(t, recv_sizes[s])) for s, t in enumerate(into)]
        return consume(got)

    return PendingPieces(None, None, finish)


def all_to_all_views(
    sends: list[list[torch.Tensor]],
    recvs: list[list[torch.Tensor]],
    group: dist.ProcessGroup | None,
    pairwise: bool | None = None,
) -> None:
    """Variable all-to-all between tensors of any layout (views into larger tensors, strided): the elements of
    this rank's ``sends[r]`` (row-major, one tensor after the other) fill rank ``r``'s ``recvs[this rank]``.

    Through shared memory a strided piece is one copy into or out of the buffer, with no contiguous copy on
    either side. Sizes must agree in bytes (a mismatch raises, naming both ranks); dtypes may differ.
    ``pairwise``: through torch.distributed, as :func:`all_to_all_pieces`'s (a receiver that is one contiguous
    tensor takes its bytes in place; None: where the group spans hosts).
    """
    tensors = [t for lst in (*sends, *recvs) for t in lst]
    if dist.get_world_size(group) == 1:
        wire.copy_own(list(sends[0]), list(recvs[0]), 0)
        return
    if accounting.ON:
        accounting.record(group, accounting.nbytes_of(sends))
    on_cpu = all(t.device.type == "cpu" for t in tensors)
    if on_cpu:
        shared = shared_group(group)
        if shared is not None and shared.exchange(sends, recvs):
            return
    if on_cpu and _pairwise(group, pairwise):
        _views_pairwise(sends, recvs, group)
        return
    device = tensors[0].device if tensors else torch.device("cpu")
    send = wire.gather([t for lst in sends for t in lst]).to(device)
    in_splits = [sum(wire.nbytes(t) for t in lst) for lst in sends]
    out_splits = [sum(wire.nbytes(t) for t in lst) for lst in recvs]
    # receivers that lie back to back (the pooled gradient's per-rank pieces) take the bytes in place
    direct = wire.spanning([t for lst in recvs for t in lst])
    out = direct if direct is not None else torch.empty(sum(out_splits), dtype=torch.uint8, device=device)
    dist.all_to_all_single(out, send, out_splits, in_splits, group=group)
    if direct is not None:
        return
    me = dist.get_rank(group)
    for r, (part, dsts) in enumerate(zip(torch.split(out, out_splits), recvs)):
        wire.scatter(part, dsts, r, me)


def _views_pairwise(
    sends: list[list[torch.Tensor]], recvs: list[list[torch.Tensor]], group: dist.ProcessGroup | None
) -> None:
    me = dist.get_rank(group)
    direct = [wire.spanning(list(lst)) for lst in recvs]
    into = [
        None
        if s == me
        else d
        if d is not None
        else torch.empty(sum(wire.nbytes(t) for t in lst), dtype=torch.uint8, device=_device_of(lst))
        for s, (d, lst) in enumerate(zip(direct, recvs))
    ]
    out = [None if d == me else wire.gather(list(lst)) for d, lst in enumerate(sends)]
    works = start_pairwise(out, into, group)
    wire.copy_own(list(sends[me]), list(recvs[me]), me)
    wait_all(works)
    for s, (d, t) in enumerate(zip(direct, into)):
        if s != me and d is None and t is not None and t.numel():
            wire.scatter(t, recvs[s], s, me)


def _device_of(ts: list[torch.Tensor]) -> torch.device:
    return ts[0].device if ts else torch.device("cpu")


def all_gather_single(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Every rank's ``x`` into ``out`` in group-rank order."""
    if x.device.type == "cpu" and out.device.type == "cpu":
        shared = shared_group(group)
        if shared is not None and shared.all_gather(out, x):
            if accounting.ON:
                accounting.record_everyone(group, wire.nbytes(x), ring=False, reduce=False)
            return
    if accounting.ON:
        accounting.record_everyone(group, wire.nbytes(x), ring=True, reduce=False)
    _dist_all_gather_single(out, x, group=group)


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """In-place sum of ``x`` over ``group``."""
    if x.device.type == "cpu":
        shared = shared_group(group)
        if shared is not None and shared.all_reduce_sum(x):
            if accounting.ON:
                accounting.record_everyone(group, wire.nbytes(x), ring=False, reduce=True)
            return
    if accounting.ON:
        accounting.record_everyone(group, wire.nbytes(x), ring=True, reduce=True)
    dist.all_reduce(x, group=group)
