"""Faults: a dead rank that its parent has not reaped ends the others quickly, and leaves nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from lightning_rec.sharding import shm

ROOT = Path(__file__).resolve().parents[2]


def _ours() -> set[str]:
    return {n for n in os.listdir(shm._DIR) if n.startswith(shm._PREFIX)} if os.path.isdir(shm._DIR) else set()


def test_a_zombie_rank_makes_its_peer_raise_within_seconds_naming_it(tmp_path: Path) -> None:
    before = _ours()
    out = tmp_path / "rank0.json"
    subprocess.run([sys.executable, str(ROOT / "tests" / "distributed" / "zombie_rank.py"), str(out)], cwd=ROOT,
                   timeout=300, check=True)
    got = json.loads(out.read_text())
    assert got["peer_state"] == "Z", got  # the probe really had a zombie peer
    # every group the library made waits what the world waits (60 s), not torch's default 30 min
    assert got["timeouts"] == [60.0, 60.0], got
    assert got["error"], "the forward after the peer died must raise"
    assert "rank 1" in got["error"], got["error"]
    if got["shared"]:
        # noticed by the liveness check (every 0.5 s), not by waiting out the 60 s timeout ("waited 60 s ...")
        assert "left the group" in got["error"], got["error"]
    assert _ours() <= before, "files left in /dev/shm"
