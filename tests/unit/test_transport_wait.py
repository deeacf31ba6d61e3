"""The shared-memory transport's wait never hangs: a dead peer or the group's timeout ends it with an error.

The wait reads ``time.monotonic``; these tests give it a fake clock that advances a fixed step per reading, so
how long it waited is exact and no assertion depends on the machine's load.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from lightning_rec.transport import shm


def _group(timeout_s: float) -> shm._SharedGroup:
    # only what _wait reads: no files, no process group
    g = object.__new__(shm._SharedGroup)
    g.seq, g.rank, g.ranks, g.timeout_s = 1, 0, [0, 5], timeout_s
    return g


def _peer(pid: int, left: int = 0) -> shm._Rank:
    ctrl = np.zeros(8, dtype=np.int64)
    ctrl[shm._LEFT] = left
    return shm._Rank(ctrl=ctrl, buffers=(None, None), pid=pid, keep=None)  # type: ignore[arg-type]


class _Clock:
    """Stands in for the ``time`` module inside shm: every reading advances 10 ms, sleeping is free."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 0.01
        return self.now

    def sleep(self, seconds: float) -> None:
        pass


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(shm, "time", fake)
    return fake


def test_a_dead_peer_is_named_within_a_second(clock: _Clock) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with pytest.raises(RuntimeError, match=r"rank 5 \(pid \d+\) left the group"):
        _group(60)._wait(1, _peer(gone.pid))
    assert clock.now < 1  # found at the first liveness check, long before the group's timeout


def test_a_peer_that_left_is_named() -> None:
    with pytest.raises(RuntimeError, match="rank 5 .* left the group"):
        _group(60)._wait(1, _peer(os.getpid(), left=1))


def test_a_live_silent_peer_ends_at_the_group_timeout(clock: _Clock) -> None:
    with pytest.raises(RuntimeError, match=r"waited 60 s \(the group's timeout\) for rank 5"):
        _group(60.0)._wait(1, _peer(os.getpid()))
    assert 60 <= clock.now < 61


def test_a_published_peer_is_not_waited_for() -> None:
    peer = _peer(os.getpid())
    peer.ctrl[shm._READY] = 1
    _group(60)._wait(1, peer)
