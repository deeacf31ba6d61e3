"""Exported programs served by a fresh process that imports torch only, and the DLRM main job's --export_program."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, checkpoint
from lightning_rec.export import SIGNATURE_FILE, export_program
from lightning_rec.models import DLRM
from lightning_rec.testing import run_distributed
from tests.integration.test_export_program import CARDS, DENSE, SHAPES, _batch, _dlrm

# the serving process imports torch only, and reports what else got imported
SERVE = """
import json, sys, torch
programs, inputs = sys.argv[1].split(","), torch.load(sys.argv[2])
outs = [[torch.export.load(p).module()(*x) for x in inputs[i]] for i, p in enumerate(programs)]
torch.save(outs, sys.argv[3])
print(json.dumps(sorted(m for m in sys.modules if m.startswith(("lightning", "fbgemm")))))
"""


def _serve(programs: list[Path], inputs: list[list[tuple]], tmp: Path) -> list[list]:
    torch.save(inputs, tmp / "inputs.pt")
    proc = subprocess.run(
        [sys.executable, "-c", SERVE, ",".join(map(str, programs)), str(tmp / "inputs.pt"), str(tmp / "outs.pt")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = json.loads(proc.stdout.strip().splitlines()[-1])
    assert imported == [], f"the serving process imported {imported}"
    return torch.load(tmp / "outs.pt")


def test_dlrm_and_weighted_collection_round_trip_through_a_fresh_process(tmp_path: Path) -> None:
    model = _dlrm()
    p1 = export_program(model, tmp_path / "dlrm.pt2")
    # a weighted collection (one table read by two features) with MEAN pooling, and no dense input
    ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(name="t1", num_embeddings=11, embedding_dim=3, feature_names=["a", "b"]),
            EmbeddingBagConfig(name="t2", num_embeddings=5, embedding_dim=2, feature_names=["c"], pooling="mean"),
        ],
        is_weighted=True,
    )
    p2 = export_program(ebc, tmp_path / "ebc.pt2", num_dense=None, weighted=True)
    assert p1.is_file() and p2.is_file() and not list(tmp_path.glob(".*partial*"))

    keys, rows = list(CARDS), list(CARDS.values())
    in1 = [_batch(keys, rows, b, n, seed) for seed, (b, n) in enumerate(SHAPES)]
    ebc_keys, ebc_rows = ["a", "b", "c"], [11, 11, 5]
    in2 = [_batch(ebc_keys, ebc_rows, b, n, 10 + s, dense=None, weighted=True) for s, (b, n) in enumerate(SHAPES)]
    out1, out2 = _serve([p1, p2], [in1, in2], tmp_path)

    model.eval()
    with torch.no_grad():
        for (dense, values, lengths), got in zip(in1, out1):
            ref = model(dense, KeyedJaggedTensor(keys, values, lengths=lengths))
            assert got.shape == (dense.size(0),)
            torch.testing.assert_close(got, ref)
        for values, lengths, weights, got in ((*x, o) for x, o in zip(in2, out2)):
            ref = ebc(KeyedJaggedTensor(ebc_keys, values, lengths=lengths, weights=weights)).values()
            torch.testing.assert_close(got, ref)
    # the program is plain aten: no fbgemm op, and the signature travels with it
    extra = {SIGNATURE_FILE: ""}
    program = torch.export.load(p1, extra_files=extra)
    assert "fbgemm" not in str(program.graph)
    sig = json.loads(extra[SIGNATURE_FILE])
    assert sig["inputs"] == ["dense", "values", "lengths"] and sig["keys"] == keys and sig["num_dense"] == DENSE


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
    reference = DLRM(
        num_dense=sig["num_dense"],
        feature_names=sig["keys"],
        num_embeddings_per_feature=[sig["rows"][k] for k in sig["keys"]],
        embedding_dim=8,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[16, 1],
    )
    fresh = reference.over_arch.model[1].weight.clone()
    checkpoint.load(tmp_path / "checkpoints" / "dlrm-final.ckpt", reference)
    assert not torch.equal(fresh, reference.over_arch.model[1].weight), "the checkpoint was not loaded"
    reference.eval()
    g = torch.Generator().manual_seed(0)
    keys, f = sig["keys"], len(sig["keys"])
    for b in (1, 7, 64):
        lengths = torch.randint(0, 3, (f * b,), generator=g)
        values = torch.cat(
            [torch.randint(0, sig["rows"][k], (int(n),), generator=g) for k, n in zip(keys, lengths.view(f, b).sum(1))]
        )
        dense = torch.randn(b, sig["num_dense"], generator=g)
        with torch.no_grad():
            ref = reference(dense, KeyedJaggedTensor(keys, values, lengths=lengths))
        torch.testing.assert_close(program(dense, values, lengths), ref)
