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
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from lightning_rec.data import ClickDataModule
from lightning_rec.models.lightning_dlrm import managed_tables, tables_from_cardinalities
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
        _job, ws, config, list(extra), init_process_group=False, timeout_s=300
    )
    (one,) = run(1, _config(tmp_path, "one", policy, 128), "--trainer.max_epochs", "3")
    r0, r1 = run(2, _config(tmp_path, "two", policy, 64))
    ckpt = tmp_path / "two" / "checkpoints" / "dlrm-final.ckpt"
    assert ckpt.exists()
    (resumed,) = run(
        1, _config(tmp_path, "resumed", policy, 128), "--trainer.max_epochs", "3", "--ckpt_path", str(ckpt)
    )
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


RESIZE_CALLBACK = """    - class_path: lightning_rec.ManagedCollisionCallback
      init_args: {{print_stats: true, resize_by: {{1: 2}}}}
"""


def _bucket_counts(ckpt: Path) -> dict[str, int]:
    """Each managed table's bucket count in a checkpoint directory (read with torch.distributed.checkpoint)."""
    keys = [
        k for k in dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata if k.endswith("._mch_num_buckets")
    ]
    state = {k: torch.zeros((), dtype=torch.int64) for k in keys}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized": one process is meant
        dcp.load(state, storage_reader=dcp.FileSystemReader(ckpt))
    return {k.split("._managed_collision_modules.")[1].rsplit(".", 1)[0]: int(v) for k, v in state.items()}


@pytest.mark.slow
def test_main_job_resizes_tables_with_different_bucket_counts(tmp_path) -> None:
    """``resize_by={1: 2}`` doubles every table's (capped, so differing) bucket count at epoch 1, from the CLI:
    2 processes print the same per-epoch remap totals as 1, and every table ends with twice its buckets."""
    configs = []
    for name, batch in (("one", 128), ("two", 64)):
        path = Path(_config(tmp_path, name, "lru", batch))
        lines = path.read_text().splitlines(keepends=True)
        at = next(i for i, ln in enumerate(lines) if "filename: dlrm-final" in ln) + 1
        path.write_text("".join(lines[:at]) + RESIZE_CALLBACK.format() + "".join(lines[at:]))
        configs.append(str(path))
    (one,) = run_distributed(_job, 1, configs[0], [], init_process_group=False, timeout_s=300)
    r0, _ = run_distributed(_job, 2, configs[1], [], init_process_group=False, timeout_s=300)
    want = _epoch_lines(one["stdout"])
    assert len(want) == 2 and _epoch_lines(r0["stdout"]) == want
    before, rows = _bucket_counts_at_start(tmp_path)
    after = _bucket_counts(tmp_path / "one" / "checkpoints" / "dlrm-final.ckpt")
    assert len(set(before.values())) > 1  # the tables' counts differ: one count for all could not resize them
    # doubled where the table's rows split into twice the buckets (tiny tables keep theirs, with a warning)
    fits = {t: 2 * n if rows[t] % (2 * n) == 0 else n for t, n in before.items()}
    assert after == fits and sum(after[t] != before[t] for t in after) >= 20
    assert _bucket_counts(tmp_path / "two" / "checkpoints" / "dlrm-final.ckpt") == after


def _bucket_counts_at_start(tmp_path) -> tuple[dict[str, int], dict[str, int]]:
    """The bucket counts and rows the job's tables start with (the DLRM's managed_tables rule for this config)."""

    cfg = yaml.safe_load(CONFIG.format(root=tmp_path, policy="lru", batch=64))
    dm = ClickDataModule(**cfg["data"])
    names = [f"cat_{i}" for i in range(26)]
    _, mods = managed_tables(tables_from_cardinalities(names, dm.cardinalities, 8), cfg["model"]["managed_collision"])
    return {t: m.num_buckets for t, m in mods.items()}, {t: m.zch_size for t, m in mods.items()}
