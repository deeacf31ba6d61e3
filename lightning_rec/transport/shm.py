"""Shared-memory collectives among the ranks of one same-host gloo group (what :mod:`transport` uses there).

Protocol, per group and per collective number ``k`` (every rank issues the same collectives in the same
order, as torch.distributed requires):

1. Rank r writes its bytes into its buffer ``k % 2``, with the byte range each rank reads, then publishes
   ``k`` in its control words.
2. It waits until every rank published ``k``, then reads its range of every rank's buffer.

A collective completes on its rank before the next starts, so a rank that published ``k - 1`` has read
everything of ``k - 2``: buffer ``k % 2`` is free again without a second flag, and its owner may grow it
(nobody maps past the old end until it reads ``k``). A rank that cannot get the space says so in its
control words, and then every rank runs that collective through torch.distributed, so the choice is the
same everywhere. The buffers are anonymous memory files (``memfd_create``) that the other ranks open through
``/proc/<pid>/fd``: they have no name in ``/dev/shm`` at any moment, so a crash, whenever it comes, leaves
nothing behind, and the kernel frees them when the last rank holding one closes it or exits. x86-64 only:
its stores become visible in program order, which makes "bytes, then control word" safe without explicit
fences.
"""

from __future__ import annotations

import atexit
import mmap
import os
import platform
import socket
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar, cast

import numpy as np
import torch
import torch.distributed as dist

from lightning_rec import _compat
from lightning_rec.transport import wire
from lightning_rec.transport.wire import describe, pieces_dtype, signature

T = TypeVar("T")
_ENV = "LIGHTNING_REC_SHM"
_PREFIX = "lightning_rec-shm"  # the memory files' names, as /proc/<pid>/fd shows them (no file system holds them)
_ALIGN = 64
# one rank's control words: [last collective published, status of the last even / odd one, pid, magic, left
# the group, what the last even / odd one was]. Per parity: a rank may publish k + 1 while a slower one still
# reads the status of k.
_READY, _STATUS, _PID, _MAGIC, _LEFT, _SIG = 0, 1, 3, 4, 5, 6
_CTRL_BYTES = 64
_OK, _FALLBACK, _FAILED = 0, 1, 2
_MIN_CAPACITY = 1 << 20
_SPIN = 2000  # busy polls before yielding the core
_LIVENESS_S = 0.5  # how often a waiting rank checks that the ranks it waits for are alive


def _identity() -> tuple[str, str, int]:
    """What two processes must share to open each other's descriptors: one host and one pid space."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return socket.gethostname(), boot, os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return socket.gethostname(), "", -1


def _wanted() -> bool:
    return (
        os.environ.get(_ENV, "1") != "0"
        and platform.system() == "Linux"
        and platform.machine() in ("x86_64", "AMD64")
        and hasattr(os, "memfd_create")
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a rank that died but whose parent has not reaped it yet (a zombie) still answers signal 0
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split(maxsplit=1)[0]
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")


class _File:
    """A shared memory file held open by descriptor and mapped."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.view = torch.empty(0, dtype=torch.uint8, device="cpu")
        self.remap()

    def remap(self) -> None:
        size = os.fstat(self.fd).st_size
        if size != self.view.numel():
            self.view = torch.frombuffer(mmap.mmap(self.fd, size), dtype=torch.uint8) if size else self.view

    def grow(self, nbytes: int) -> None:
        """Room for ``nbytes``, reserved now: a full tmpfs fails here (OSError), not with a fault on a write."""
        os.posix_fallocate(self.fd, 0, nbytes)
        self.remap()

    def close(self) -> None:
        """Release the descriptor and this view of the mapping (the mmap holds a descriptor of its own until
        the last tensor viewing it goes)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.view = torch.empty(0, dtype=torch.uint8, device="cpu")


@dataclass
class _Rank:
    ctrl: np.ndarray  # its control words (int64), polled: numpy indexing is the cheapest read of shared memory
    buffers: tuple[_File, _File]  # one per collective parity
    pid: int
    keep: _File


class _SharedGroup:
    """Shared-memory collectives among the ranks of one same-host group (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup | None, tag: str) -> None:
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.size))
        self.timeout_s = _timeout_s(group)
        self.tag = tag
        self.magic = int(uuid.UUID(tag).int % (1 << 62))
        self.seq = 0
        self.peers: list[_Rank] = []
        files: list[_File] = []
        try:
            for what in ("ctrl", "buf0", "buf1"):
                files.append(_File(os.memfd_create(f"{_PREFIX}-{tag}-{self.rank}-{what}")))
                files[-1].grow(_CTRL_BYTES if what == "ctrl" else _header_bytes(self.size) + _MIN_CAPACITY)
        except OSError:
            for f in files:
                f.close()
            raise
        ctrl = files[0].view.numpy().view(np.int64)
        ctrl[_PID], ctrl[_MAGIC] = os.getpid(), self.magic
        self.me = _Rank(ctrl=ctrl, buffers=(files[1], files[2]), pid=os.getpid(), keep=files[0])

    @property
    def address(self) -> tuple[int, list[int]]:
        """What another rank needs to open this rank's files: its pid and descriptors."""
        return self.me.pid, [f.fd for f in (self.me.keep, *self.me.buffers)]

    def connect(self, addresses: list[tuple[int, list[int]]]) -> None:
        """Open every other rank's files through ``/proc/<pid>/fd`` and check they hold what it wrote."""
        for r, (pid, fds) in enumerate(addresses):
            if r == self.rank:
                self.peers.append(self.me)
                continue
            files: list[_File] = []
            try:
                for fd in fds:
                    files.append(_File(os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)))
                ctrl = files[0].view.numpy().view(np.int64)
                if int(ctrl[_MAGIC]) != self.magic or int(ctrl[_PID]) != pid:
                    raise OSError(f"rank {self.ranks[r]}'s shared segment is not the one it wrote")
            except OSError:
                for f in files:
                    f.close()
                raise
            self.peers.append(_Rank(ctrl=ctrl, buffers=(files[1], files[2]), pid=pid, keep=files[0]))

    def close(self) -> None:
        """Leave the group: ranks waiting for this one raise instead of waiting out the timeout."""
        if os.getpid() != self.me.pid:  # a forked child (a DataLoader worker) never speaks for its parent
            return
        _OPEN.discard(self)
        self.me.ctrl[_LEFT] = 1
        for rank in [self.me] + [p for p in self.peers if p is not self.me]:
            for f in (*rank.buffers, rank.keep):
                f.close()
            rank.ctrl = np.zeros(_CTRL_BYTES // 8, dtype=np.int64)  # its view kept the mapping alive
        self.peers = []

    # one collective -------------------------------------------------------------------------------

    def _publish(self, pieces: list[torch.Tensor], ranges: list[tuple[int, int]], sig: int) -> None:
        """Step 1: this rank's bytes (``pieces``, back to back) and, per destination, the byte range it reads.

        ``sig`` says which collective this is (:func:`signature`): a peer running another one raises, and
        so does every rank. A failure here still publishes (as failed), so the peers raise instead of waiting.
        """
        self.seq += 1
        self.me.ctrl[_SIG + self.seq % 2] = sig
        try:
            self._write(pieces, ranges)
        except BaseException:
            self.me.ctrl[_STATUS + self.seq % 2] = _FAILED
            self.me.ctrl[_READY] = self.seq
            raise

    def _write(self, pieces: list[torch.Tensor], ranges: list[tuple[int, int]]) -> None:
        buf = self.me.buffers[self.seq % 2]
        header = _header_bytes(self.size)
        nbytes = header + sum(wire.nbytes(p) for p in pieces)
        status = _OK
        if nbytes > buf.view.numel():
            try:
                buf.grow(max(nbytes, 2 * buf.view.numel()))
            except OSError:
                status = _FALLBACK
        if status == _OK:
            buf.view[: 16 * self.size].view(torch.int64).copy_(
                torch.tensor([v for r in ranges for v in r], dtype=torch.int64, device="cpu")
            )
            dtype = pieces[0].dtype if pieces else None
            if len(pieces) > 1 and all(p.dtype == dtype and p.is_contiguous() for p in pieces):
                # one op for many pieces (they all start aligned to their element size)
                torch.cat([p.view(-1) for p in pieces], out=buf.view[header:nbytes].view(cast(torch.dtype, dtype)))
            else:
                wire.put_all(buf.view[header:nbytes], pieces)
        ctrl = self.me.ctrl
        ctrl[_STATUS + self.seq % 2] = status
        ctrl[_READY] = self.seq  # last: the data above is visible before this word (x86-64 store order)

    def _wait_all(self) -> bool:
        """Step 2's wait: until every rank published this collective; False if one could not (fall back)."""
        ok, parity = True, self.seq % 2
        mine = int(self.me.ctrl[_SIG + parity])
        for r, peer in enumerate(self.peers):
            if r != self.rank:
                self._wait(r, peer)
            status = int(peer.ctrl[_STATUS + parity])
            if status == _FAILED:
                raise RuntimeError(
                    f"rank {self.ranks[r]} failed in collective #{self.seq} of its group "
                    f"(shared-memory transport; see the error raised there): stopping rank "
                    f"{self.ranks[self.rank]} too"
                )
            theirs = int(peer.ctrl[_SIG + parity])
            if theirs != mine:
                raise RuntimeError(
                    f"the ranks issued different collectives as #{self.seq} of their group: rank "
                    f"{self.ranks[self.rank]} runs {describe(mine)}, rank {self.ranks[r]} runs {describe(theirs)} "
                    "(every rank must run the same collectives in the same order, e.g. every sharded forward)"
                )
            ok = ok and status == _OK
        return ok

    def _wait(self, r: int, peer: _Rank) -> None:
        ctrl, seq = peer.ctrl, self.seq
        spins = 0
        next_check = deadline = 0.0
        while ctrl[_READY] < seq:
            spins += 1
            if spins < _SPIN:
                continue
            now = time.monotonic()
            if not deadline:
                deadline, next_check = now + self.timeout_s, now + _LIVENESS_S
            elif now >= next_check:
                next_check = now + _LIVENESS_S
                if ctrl[_READY] >= seq:
                    break
                if ctrl[_LEFT] or not _pid_alive(peer.pid):
                    raise RuntimeError(
                        f"rank {self.ranks[r]} (pid {peer.pid}) left the group (it exited or destroyed its process "
                        f"group) while rank {self.ranks[self.rank]} waited for it in collective #{seq} "
                        "(shared-memory transport)"
                    )
                if now >= deadline:
                    raise RuntimeError(
                        f"rank {self.ranks[self.rank]} waited {self.timeout_s:.0f} s (the group's timeout) for rank "
                        f"{self.ranks[r]} in collective #{seq} of their group (shared-memory transport): the ranks "
                        "issued different collectives, or one is stuck"
                    )
            time.sleep(0 if spins < 4 * _SPIN else 5e-5)

    def _part(self, r: int) -> torch.Tensor:
        """This rank's byte range of rank r's buffer of the current collective."""
        buf = self.peers[r].buffers[self.seq % 2]
        lo, hi = buf.view[16 * self.rank : 16 * self.rank + 16].view(torch.int64).tolist()
        header = _header_bytes(self.size)
        if header + hi > buf.view.numel():  # the owner grew it since this rank last looked
            buf.remap()
        return buf.view[header + lo : header + hi]

    def all_to_all(self, out: torch.Tensor, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> bool:
        """``dist.all_to_all_single`` (splits in rows of dim 0); False: run it through torch.distributed."""
        row = wire.row_bytes(x)
        in_splits = list(in_splits) or [x.shape[0] // self.size] * self.size
        out_splits = list(out_splits) or [out.shape[0] // self.size] * self.size
        # this rank's own rows go straight from x to out, the rest through its buffer
        sent = torch.split(wire.as_bytes(x), [n * row for n in in_splits])
        ranges, at = [], 0
        for r, piece in enumerate(sent):
            n = 0 if r == self.rank else piece.numel()
            ranges.append((at, at + n))
            at += n
        self._publish([p for r, p in enumerate(sent) if r != self.rank], ranges, signature("all_to_all", x.dtype))
        if not self._wait_all():
            return False
        parts = [sent[r] if r == self.rank else self._part(r) for r in range(self.size)]
        for r, part in enumerate(parts):
            if part.numel() != out_splits[r] * row:
                raise RuntimeError(
                    f"all_to_all: rank {self.ranks[self.rank]} expected {out_splits[r]} rows from rank "
                    f"{self.ranks[r]}, which sent {part.numel() // max(row, 1)}"
                )
        wire.write_back_to_back(out, parts)
        return True

    def _publish_lists(self, sends: list[list[torch.Tensor]], sig: int) -> bool:
        """Steps 1 and 2's wait for a list of tensors per destination (this rank's own stay where they are);
        False: some rank could not, run it through torch.distributed."""
        pieces, ranges, at = [], [], 0
        for r, lst in enumerate(sends):
            n = 0 if r == self.rank else sum(wire.nbytes(t) for t in lst)
            ranges.append((at, at + n))
            at += n
            if r != self.rank:
                pieces += lst
        self._publish(pieces, ranges, sig)
        return self._wait_all()

    def exchange(self, sends: list[list[torch.Tensor]], recvs: list[list[torch.Tensor]]) -> bool:
        """:func:`all_to_all_views` through the buffers; False: run it through torch.distributed."""
        if not self._publish_lists(sends, signature("all_to_all_views", None)):
            return False
        for r, dsts in enumerate(recvs):
            if r == self.rank:
                wire.copy_own(sends[r], dsts, self.ranks[r])
            else:
                wire.scatter(self._part(r), dsts, self.ranks[r], self.ranks[self.rank])
        return True

    def pieces(
        self,
        sends: list[list[torch.Tensor]],
        recv_sizes: list[list[int]],
        consume: Callable[[list[list[torch.Tensor]]], T],
    ) -> tuple[T] | None:
        """:func:`all_to_all_pieces` through the buffers; None: run it through torch.distributed."""
        if not self._publish_lists(sends, signature("all_to_all_pieces", None)):
            return None
        got, dtype = [], pieces_dtype(sends)
        for r, sizes in enumerate(recv_sizes):
            if r == self.rank:
                got.append(list(sends[r]))
                continue
            part = self._part(r)
            want = sum(sizes) * dtype.itemsize
            if part.numel() != want:
                raise RuntimeError(
                    f"all_to_all: rank {self.ranks[self.rank]} expected {want} bytes from rank "
                    f"{self.ranks[r]}, which sent {part.numel()}"
                )
            got.append(list(torch.split(part.view(dtype), sizes)))
        return (consume(got),)  # while every rank still reads its buffers: nobody overwrites them

    def _everyones(self, x: torch.Tensor, op: str) -> list[torch.Tensor] | None:
        """Every rank's whole ``x`` as bytes, in rank order; None: run it through torch.distributed."""
        payload = wire.as_bytes(x)
        self._publish([payload], [(0, payload.numel())] * self.size, signature(op, x.dtype, payload.numel()))
        if not self._wait_all():
            return None
        return [payload if r == self.rank else self._part(r) for r in range(self.size)]

    def all_gather(self, out: torch.Tensor, x: torch.Tensor) -> bool:
        """``all_gather_into_tensor`` (every rank's ``x`` in rank order into ``out``)."""
        parts = self._everyones(x, "all_gather")
        if parts is None:
            return False
        wire.write_back_to_back(out, parts)
        return True

    def all_reduce_sum(self, x: torch.Tensor) -> bool:
        """In-place sum over the ranks, added in rank order on every rank, so every rank gets the same bits."""
        parts = self._everyones(x, "all_reduce_sum")
        if parts is None:
            return False
        total = parts[0].view(x.dtype).clone()
        for part in parts[1:]:
            total += part.view(x.dtype)
        x.copy_(total.view(x.shape))
        return True


def _header_bytes(size: int) -> int:
    return -(-(16 * size) // _ALIGN) * _ALIGN


def _timeout_s(group: dist.ProcessGroup | None) -> float:
    """The group's own timeout (what gloo would wait)."""
    return _compat.group_timeout(group).total_seconds()


_GROUPS: dict[int, tuple[weakref.ref, _SharedGroup | None]] = {}
_OPEN: set[_SharedGroup] = set()  # every group not yet closed, whatever became of its process group


def shared_group(group: dist.ProcessGroup | None) -> _SharedGroup | None:
    """The shared-memory transport of ``group``, set up on first use (collectively), or None to use gloo."""
    pg = group if group is not None else dist.group.WORLD
    cached = _GROUPS.get(id(pg))
    if cached is not None:
        if cached[0]() is pg:
            return cached[1]
        if cached[1] is not None:  # a dead group's entry, its id now reused
            cached[1].close()
    shared = _setup(group)
    _GROUPS[id(pg)] = (weakref.ref(pg), shared)
    if shared is not None:
        _OPEN.add(shared)
        weakref.finalize(pg, shared.close)
    return shared


def close_all() -> None:
    """Leave every shared-memory group of this process (before ``destroy_process_group``): peers still
    waiting in a collective raise at once, as they do when gloo's connections close."""
    _GROUPS.clear()
    for shared in list(_OPEN):
        shared.close()


atexit.register(close_all)


def _setup(group: dist.ProcessGroup | None) -> _SharedGroup | None:
    if dist.get_world_size(group) == 1 or "gloo" not in str(dist.get_backend(group)).lower():
        return None  # the same answer on every rank, without a collective
    n = dist.get_world_size(group)
    everyone: list = [None] * n
    dist.all_gather_object(everyone, (_wanted(), _identity(), uuid.uuid4().hex), group=group)
    if not all(want for want, _, _ in everyone) or len({ident for _, ident, _ in everyone}) != 1:
        return None
    shared: _SharedGroup | None = None
    try:
        try:
            shared = _SharedGroup(group, everyone[0][2])
        except (OSError, RuntimeError):
            shared = None
        made: list = [None] * n
        dist.all_gather_object(made, None if shared is None else shared.address, group=group)
        ok = shared is not None and all(a is not None for a in made)
        if ok:
            assert shared is not None  # ok says so
            try:
                shared.connect(made)
            except (OSError, RuntimeError):
                ok = False
        connected: list = [None] * n
        dist.all_gather_object(connected, ok, group=group)
    except BaseException:  # a peer died during set-up: gloo raises here, and this rank's files go with it
        if shared is not None:
            shared.close()
        raise
    if not all(connected):
        if shared is not None:
            shared.close()
        return None
    return shared
