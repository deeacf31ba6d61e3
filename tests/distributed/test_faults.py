"""Faults: a dead rank that its parent has not reaped ends the others quickly; a rank killed while the
shared-memory transport is being set up leaves nothing behind (and its peers raise, naming the failure)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_rec.transport import shm

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not shm._wanted(), reason="the shared-memory transport needs Linux x86-64")


def _in_dev_shm() -> set[str]:
    """What lightning_rec keeps in /dev/shm (other processes of the machine may come and go there)."""
    return {n for n in os.listdir("/dev/shm") if "lightning_rec" in n} if os.path.isdir("/dev/shm") else set()


def _fds_of_ours() -> int:
    """Memory files of the transport this process holds (none: the test's processes are its children)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += shm._PREFIX in os.readlink(f"/proc/self/fd/{fd}")
    return n


def _run(tmp_path: Path, scenario: str) -> dict:
    out = tmp_path / "rank0.json"
    subprocess.run(
        [sys.executable, str(ROOT / "tests" / "distributed" / "fault_ranks.py"), scenario, str(out)],
        cwd=ROOT,
        timeout=300,
        check=True,
    )
    return json.loads(out.read_text())


def test_a_zombie_rank_makes_its_peer_raise_naming_it(tmp_path: Path) -> None:
    before = _in_dev_shm()
    got = _run(tmp_path, "zombie")
    assert got["peer_state"] == "Z", got  # the probe really had a zombie peer
    # every group the library made waits what the world waits (60 s), not torch's default 30 min
    assert got["timeouts"] == [60.0, 60.0], got
    assert got["error"], "the forward after the peer died must raise"
    assert "rank 1" in got["error"], got["error"]
    assert got["shared"]
    # noticed by the liveness check (every 0.5 s), not by waiting out the 60 s timeout ("waited 60 s ...")
    assert "left the group" in got["error"], got["error"]
    assert _in_dev_shm() <= before


@pytest.mark.parametrize("moment", ["after_create", "after_connect"])
def test_a_rank_killed_while_the_transport_is_set_up_leaves_nothing_behind(tmp_path: Path, moment: str) -> None:
    before = _in_dev_shm()
    got = _run(tmp_path, f"setup_{moment}")
    assert got["killed_at"] == moment, got  # rank 1 died at that point of the set-up, by SIGKILL
    assert got["error"], "rank 0 must raise, not hang"
    assert got["open_memory_files"] == 0, got  # rank 0 closed its own buffers when the set-up failed
    assert _in_dev_shm() <= before, "files left in /dev/shm"
    assert _fds_of_ours() == 0
