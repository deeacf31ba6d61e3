"""The DLRM main job as a Fabric loop (examples/dlrm_fabric.py), on two processes."""

from __future__ import annotations

from pathlib import Path

from lightning_rec.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--train-rows", "16384", "--val-rows", "4096", "--size", "0.0001", "--embedding-dim", "8"]


def _job(rank: int, ws: int, root: str) -> dict:
    import contextlib
    import io
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    import dlrm_fabric

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        metrics = dlrm_fabric.main([*TINY, "--devices", str(ws), "--root", root])
    return {"metrics": metrics, "stdout": out.getvalue()}


def test_fabric_main_job_learns_and_writes_a_checkpoint_directory(tmp_path: Path) -> None:
    r0, r1 = run_distributed(_job, 2, str(tmp_path), init_process_group=False, timeout_s=300)
    assert r0["metrics"]["val_auroc"] > 0.6, r0["metrics"]
    assert r0["metrics"] == r1["metrics"]  # synced over ranks
    final = [line for line in r0["stdout"].splitlines() if line.startswith("final: ")]
    assert final and f"val AUC {r0['metrics']['val_auroc']:.4f}" in final[-1]
    assert not [line for line in r1["stdout"].splitlines() if line.startswith("final: ")]
    assert (tmp_path / "checkpoints" / "dlrm-final.ckpt" / "meta.pt").exists()
