"""The shared-memory transport's wait never hangs: a dead peer or the group's timeout ends it with an error."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from lightning_rec.sharding import shm


def _group(timeout_s: float) -> shm._SharedGroup:
    # only what _wait reads: no files, no process group
    g = object.__new__(shm._SharedGroup)
    g.seq, g.rank, g.ranks, g.timeout_s = 1, 0, [0, 5], timeout_s
    return g


def _peer(pid: int, left: int = 0) -> shm._Rank:
    ctrl = np.zeros(8, dtype=np.int64)
    ctrl[shm._LEFT] = left
    return shm._Rank(ctrl=ctrl, buffers=(None, None), pid=pid, keep=None)  # type: ignore[arg-type]


def test_a_dead_peer_is_named_within_a_second() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 5 \(pid \d+\) left the group"):
        _group(60)._wait(1, _peer(gone.pid))
    assert time.monotonic() - start < 2


def test_a_peer_that_left_is_named() -> None:
    with pytest.raises(RuntimeError, match="rank 5 .* left the group"):
        _group(60)._wait(1, _peer(os.getpid(), left=1))


def test_a_live_silent_peer_ends_at_the_group_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"waited 1 s \(the group's timeout\) for rank 5"):
        _group(1.0)._wait(1, _peer(os.getpid()))
    assert 0.9 < time.monotonic() - start < 3


def test_a_published_peer_is_not_waited_for() -> None:
    peer = _peer(os.getpid())
    peer.ctrl[shm._READY] = 1
    _group(60)._wait(1, peer)
