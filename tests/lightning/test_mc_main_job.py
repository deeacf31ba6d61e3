"""The DLRM main job (examples/dlrm.py) on raw ids through managed collision, at 1 and 2 processes.

The same global batches (batch 2B on one process, B per rank on two): the remap decisions depend on the ids
alone, so the per-epoch hit rates and evictions are equal exactly; the weights (and so the validation
metrics) agree to float rounding (embedding_grad=mean: sharded training equals one process).
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


def _job(rank: int, ws: int, config: str) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import dlrm  # the example is a script, not a package module

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        metrics = dlrm.main(["--config", config, "--trainer.devices", str(ws)])
    return {"metrics": metrics, "stdout": out.getvalue()}


def _config(tmp_path: Path, name: str, policy: str, batch: int) -> str:
    root = tmp_path / name
    root.mkdir()
    path = root / "config.yaml"
    path.write_text(CONFIG.format(root=root, policy=policy, batch=batch))
    return str(path)


@pytest.mark.slow
def test_main_job_raw_ids_two_processes_match_one(tmp_path, policy: str = "lfu") -> None:
    (one,) = run_distributed(_job, 1, _config(tmp_path, "one", policy, 128), init_process_group=False, timeout_s=300)
    r0, r1 = run_distributed(_job, 2, _config(tmp_path, "two", policy, 64), init_process_group=False, timeout_s=300)
    want, got = one["metrics"], r0["metrics"]
    mc = sorted(k for k in want if k.startswith("mc/"))
    assert "mc/hit_rate" in mc and "mc/evicted" in mc and len(mc) == 2 + 2 * 26
    for k in mc:  # ids alone decide: exact, on every rank
        assert got[k] == want[k] == r1["metrics"][k], k
    assert 0.0 < want["mc/hit_rate"] < 1.0 and want["mc/evicted"] > 0  # tables filled up and evicted
    for k in ("val_loss", "val_auroc", "val_ne"):
        assert got[k] == pytest.approx(want[k], abs=1e-4), k
    # the summary: one line per epoch and the final line, printed by rank 0 only
    lines = [ln for ln in r0["stdout"].splitlines() if ln.startswith("managed collision, epoch")]
    assert [ln.split(":")[0] for ln in lines] == ["managed collision, epoch 0", "managed collision, epoch 1"]
    assert f"hit rate {want['mc/hit_rate']:.4f}" in lines[-1]
    final = [ln for ln in r0["stdout"].splitlines() if ln.startswith("final: ")]
    assert final and f"mc hit rate {want['mc/hit_rate']:.4f} evicted {int(want['mc/evicted']):,}" in final[-1]
    assert not [ln for ln in r1["stdout"].splitlines() if ln.startswith(("final: ", "managed collision"))]
    assert (tmp_path / "two" / "checkpoints" / "dlrm-final.ckpt").exists()
