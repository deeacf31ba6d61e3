"""Asynchronous collectives that outlive the call that issued them: awaited before the process exits.

A gloo collective runs on its process group's worker threads, which let go of the work (and of its tensors)
a moment after ``wait()`` returns. When Python dropped a tensor first, that last release from the worker
touches a Python object and needs the GIL. A finalizing interpreter no longer hands the GIL out: the worker
is ended with ``pthread_exit``, whose unwinding meets a ``noexcept`` frame, and the whole process aborts with
"terminate called without an active exception" after a job that succeeded.

So the library's asynchronous collectives that a caller may stop awaiting (the loaders' per-batch status
exchange, the SIGTERM flags) go through :func:`track`: the work and its tensors stay referenced until the
work is waited for *and* a few later ones have been (by then the worker let go long ago), so Python's release
is always the last one and happens on a Python thread. :func:`drain` waits for whatever is still outstanding:
strategy teardown calls it, and so does an exit handler that runs before Lightning's own (which destroys
the process groups) and before the interpreter finalizes.

Collectives torch and Lightning issue themselves (a checkpoint's object broadcasts, on one of gloo's two worker
threads, then a barrier on the other) have the same race, which no caller can close: a worker preempted after
completing a broadcast can still hold its tensors when the barrier has returned and the script ends. So the
exit handler then also lets the process's native threads settle (:func:`quiesce`): it releases the GIL in
short sleeps until none of them is running, for at most a fifth of a second.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch

_EXIT_WAIT = timedelta(seconds=60)  # a peer that issued the same collective answers in milliseconds

_outstanding: dict[int, Tracked] = {}
_retired: collections.deque[Tracked] = collections.deque(maxlen=4)
_exit_hook = False


class Tracked:
    """An asynchronous collective's work and every tensor it reads or writes, kept together."""

    def __init__(self, work: Any, tensors: tuple[torch.Tensor | list[torch.Tensor], ...]) -> None:
        self._work, self._tensors = work, tensors

    def wait(self, timeout: timedelta | None = None) -> None:
        """Wait for the work (once; later calls return at once). Raises what the work raised."""
        if id(self) not in _outstanding:
            return
        try:
            if self._work is not None:
                self._work.wait() if timeout is None else self._work.wait(timeout)
        finally:
            _outstanding.pop(id(self), None)
            _retired.append(self)  # the oldest retired one is released now, long after its worker let go

    def settle(self, timeout: timedelta | None = None) -> None:
        """:meth:`wait`, dropping a failure quietly: for the way out (a stopped loop, teardown), where a peer's
        failure is raised on that peer and the error that stopped this rank is already on its way."""
        with contextlib.suppress(Exception):
            self.wait(timeout)


def install_exit_hook() -> None:
    """Drain and quiesce at exit (once per process). Call it after the process group exists: exit handlers run
    last-in first-out, so this one then runs before Lightning's, which destroys the process groups."""
    global _exit_hook
    if not _exit_hook:
        atexit.register(_at_exit)
        _exit_hook = True


def _at_exit() -> None:
    drain(_EXIT_WAIT)
    quiesce()


def track(work: Any, *tensors: torch.Tensor | list[torch.Tensor]) -> Tracked:
    """Register an asynchronous collective (``work``; None when it already completed) and its tensors."""
    install_exit_hook()
    t = Tracked(work, tensors)
    _outstanding[id(t)] = t
    return t


def outstanding() -> int:
    """How many tracked collectives are not yet waited for."""
    return len(_outstanding)


def drain(timeout: timedelta | None = None) -> int:
    """Wait for every tracked collective still outstanding (each peer issued it too); returns how many there were.

    A work that fails (a peer died) is dropped quietly (:meth:`Tracked.settle`).
    """
    pending = list(_outstanding.values())
    for t in pending:
        t.settle(timeout)
    return len(pending)


def _running_threads() -> int:
    """How many of this process's threads other than this one are running or runnable (Linux; else 0)."""
    me = threading.get_native_id()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return 0
    running = 0
    for tid in tids:
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        running += state == "R"
    return running


def quiesce(limit_s: float = 0.2) -> None:
    """Sleep (the GIL free meanwhile) until no other thread of the process has run for three short checks in
    a row, or ``limit_s`` passed: a collective's worker still letting go of its tensors finishes first."""
    deadline = time.monotonic() + limit_s
    calm = 0
    while calm < 3 and time.monotonic() < deadline:
        time.sleep(0.002)
        calm = calm + 1 if _running_threads() == 0 else 0
