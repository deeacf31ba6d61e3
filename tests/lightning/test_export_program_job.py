"""The DLRM main job (examples/dlrm.py, 2 processes, sharded) exports its final model with --export_program."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from lightning_rec import KeyedJaggedTensor, checkpoint
from lightning_rec.export import SIGNATURE_FILE
from lightning_rec.models import DLRM
from lightning_rec.testing import run_distributed

TINY = """
trainer:
  default_root_dir: {root}
  logger: false
  max_steps: 6
  val_check_interval: 1.0
  enable_progress_bar: false
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: {root}/checkpoints, filename: dlrm-final}}
model:
  embedding_dim: 8
  dense_arch_layer_sizes: [16, 8]
  over_arch_layer_sizes: [16, 1]
data:
  batch_size: 64
  train_rows: 768
  val_rows: 256
  size: 0.0001
"""


def _job(rank: int, ws: int, config: str, program: str) -> dict:
    # the example is a script: imported from its folder, in the worker
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import dlrm

    return dlrm.main(["--config", config, "--export_program", program])


@pytest.mark.slow
def test_main_job_exports_a_program_that_serves_the_final_model(tmp_path: Path) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY.format(root=tmp_path))
    program_path = tmp_path / "serve" / "dlrm.pt2"
    run_distributed(_job, 2, str(config), str(program_path), init_process_group=False, timeout_s=300)

    extra = {SIGNATURE_FILE: ""}
    program = torch.export.load(program_path, extra_files=extra).module()
    sig = json.loads(extra[SIGNATURE_FILE])
    assert sig["inputs"] == ["dense", "values", "lengths"]
    # the reference: the job's final checkpoint (written at the last validation, the end of training)
    # loaded into an unsharded DLRM of the same shape
    reference = DLRM(num_dense=sig["num_dense"], feature_names=sig["keys"],
                     num_embeddings_per_feature=[sig["rows"][k] for k in sig["keys"]], embedding_dim=8,
                     dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1])
    fresh = reference.over_arch.model[1].weight.clone()
    checkpoint.load(tmp_path / "checkpoints" / "dlrm-final.ckpt", reference)
    assert not torch.equal(fresh, reference.over_arch.model[1].weight), "the checkpoint was not loaded"
    reference.eval()
    g = torch.Generator().manual_seed(0)
    keys, f = sig["keys"], len(sig["keys"])
    for b in (1, 7, 64):
        lengths = torch.randint(0, 3, (f * b,), generator=g)
        values = torch.cat([torch.randint(0, sig["rows"][k], (int(n),), generator=g)
                            for k, n in zip(keys, lengths.view(f, b).sum(1))])
        dense = torch.randn(b, sig["num_dense"], generator=g)
        with torch.no_grad():
            ref = reference(dense, KeyedJaggedTensor(keys, values, lengths=lengths))
        torch.testing.assert_close(program(dense, values, lengths), ref)
