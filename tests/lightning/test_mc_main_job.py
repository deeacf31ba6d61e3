"""The DLRM main job (examples/dlrm.py) on raw ids through managed collision, at 1 and 2 processes.

The same global batches (batch 2B on one process, B per rank on two): the remap decisions depend on the ids
alone, so the per-epoch hit rates and evictions are equal exactly; the weights (and so the validation
metrics) agree to float rounding (embedding_grad=mean: sharded training equals one process). A checkpoint
written by 2 processes resumes on 1.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import pytest

from lightning_rec.testing import run_distributed

CONFIG = """
trainer:
  default_root_dir: {root}
  logger: false
  max_epochs: 2
  val_check_interval: 1.0
  enable_progress_bar: false
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: {root}/checkpoints, filename: dlrm-final}}
  strategy:
    class_path: lightning_rec.RecShardedStrategy
    init_args: {{embedding_grad: mean}}
model:
  embedding_dim: 8
  dense_arch_layer_sizes: [16, 8]
  over_arch_layer_sizes: [16, 1]
  managed_collision: {{num_buckets: 8, eviction_policy: {policy}, zch_size: {{cat_0: 64, cat_9: 32}}}}
data:
  batch_size: {batch}
  train_rows: 1536
  val_rows: 256
  size: 0.0001
  raw_ids: true
"""


def _job(rank: int, ws: int, config: str, extra: list[str]) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import dlrm  # the example is a script, not a package module

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        metrics = dlrm.main(["--config", config, "--trainer.devices", str(ws), *extra])
    return {"metrics": metrics, "stdout": out.getvalue()}


def _config(tmp_path: Path, name: str, policy: str, batch: int) -> str:
    root = tmp_path / name
    root.mkdir()
    path = root / "config.yaml"
    path.write_text(CONFIG.format(root=root, policy=policy, batch=batch))
    return str(path)


def _epoch_lines(stdout: str) -> list[str]:
    return [ln for ln in stdout.splitlines() if ln.startswith("managed collision, epoch")]


@pytest.mark.slow
def test_main_job_raw_ids_two_processes_match_one_and_resume_on_one(tmp_path, policy: str = "lfu") -> None:
    """2 processes == 1 process for 2 epochs; the 2-process checkpoint resumed on 1 process for a third epoch ==
    the third epoch of the 1-process run: remap state, optimizer state and data position all come back."""
    run = lambda ws, config, *extra: run_distributed(  # noqa: E731
        _job, ws, config, list(extra), init_process_group=False, timeout_s=300)
    (one,) = run(1, _config(tmp_path, "one", policy, 128), "--trainer.max_epochs", "3")
    r0, r1 = run(2, _config(tmp_path, "two", policy, 64))
    ckpt = tmp_path / "two" / "checkpoints" / "dlrm-final.ckpt"
    assert ckpt.exists()
    (resumed,) = run(1, _config(tmp_path, "resumed", policy, 128), "--trainer.max_epochs", "3", "--ckpt_path",
                     str(ckpt))
    # ids alone decide the remap: the per-epoch hit rates and evictions are equal exactly
    want = _epoch_lines(one["stdout"])
    assert [ln.split(":")[0] for ln in want] == [f"managed collision, epoch {e}" for e in range(3)]
    assert _epoch_lines(r0["stdout"]) == want[:2] and _epoch_lines(resumed["stdout"]) == want[2:]
    assert not _epoch_lines(r1["stdout"])  # rank 0 prints
    mc = sorted(k for k in one["metrics"] if k.startswith("mc/"))
    assert "mc/hit_rate" in mc and "mc/evicted" in mc and len(mc) == 2 + 2 * 26
    for k in mc:
        assert resumed["metrics"][k] == one["metrics"][k], k
        assert r0["metrics"][k] == r1["metrics"][k], k
    assert 0.0 < one["metrics"]["mc/hit_rate"] < 1.0 and one["metrics"]["mc/evicted"] > 0  # tables evict
    for k in ("val_loss", "val_auroc", "val_ne"):  # float rounding of 2 vs 1 process, then one more epoch
        assert resumed["metrics"][k] == pytest.approx(one["metrics"][k], abs=2e-3), k
    final = [ln for ln in r0["stdout"].splitlines() if ln.startswith("final: ")]
    m = r0["metrics"]
    assert final and f"mc hit rate {m['mc/hit_rate']:.4f} evicted {int(m['mc/evicted']):,}" in final[-1]
    assert not [ln for ln in r1["stdout"].splitlines() if ln.startswith("final: ")]
