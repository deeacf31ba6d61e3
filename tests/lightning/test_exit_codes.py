"""How every rank of a short job exits: 0, with no abort, and no collective left running at exit; a rank that
fails after rank 0 finished makes the launching process fail too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_rec.lightning import child_exits
from tests.lightning.exit_flows import RANK_1_FAILS, aborted, run_once

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("flow", ["fit_save", "fit_eval"])
def test_every_rank_exits_0_with_no_collective_left_running(tmp_path: Path, flow: str) -> None:
    # each rank's script checks that no asynchronous collective is outstanding once its last call returned (fit
    # stops after 3 of 8 batches and validation after 1: the loaders' status exchanges of the next batch were
    # in flight), then exits; both ranks are started here, so both exit codes and stderrs are read
    codes, errs = run_once(flow, "external", str(tmp_path))
    for rank, (code, err) in enumerate(zip(codes, errs)):
        assert code == 0 and not aborted(err), f"rank {rank} exited {code}:\n{err[-3000:]}"
    assert (tmp_path / "ckpt").is_dir() or flow != "fit_save"


def test_a_rank_failing_after_rank_0_finished_fails_the_launching_process(tmp_path: Path) -> None:
    codes, errs = run_once(RANK_1_FAILS, "lightning", str(tmp_path))
    # rank 0 reports rank 1's exit code 5 (or, if Lightning's own watcher saw it first, it killed rank 0)
    assert codes[0] != 0, errs[0][-3000:]
    if codes[0] == 1:
        assert "local rank 1" in errs[0] and "exited with code 5" in errs[0], errs[0][-3000:]


def test_report_children_names_each_failed_rank_and_skips_stopped_ones() -> None:
    class Launcher:
        stopped_children = False

        def __init__(self, *codes: int) -> None:
            self.procs = [subprocess.Popen([sys.executable, "-c", f"raise SystemExit({c})"]) for c in codes]

    ok, failing, stopped = Launcher(0, 0), Launcher(0, 3), Launcher(4)
    stopped.stopped_children = True
    child_exits._launchers[:] = [ok, failing, stopped]
    try:
        failed = child_exits.report_children(wait_s=30)
    finally:
        child_exits._launchers.clear()
    assert failed == [f"local rank 2 (pid {failing.procs[1].pid}) exited with code 3"]
