"""A quantized model's torch.export program, served by a fresh process in which lightning_rec and Lightning cannot
be imported: the same scores as the quantized model in memory (int8, int4; pooled DLRM), from the API and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_rec import KeyedJaggedTensor, checkpoint, quantize_embeddings
from lightning_rec.cli import main
from lightning_rec.export import SIGNATURE_FILE, export_program
from tests.integration.test_export_program import CARDS, SHAPES, _batch, _dlrm
from tests.lightning.models import ClickModule, Clicks, collate

# one process saving a checkpoint directory (the CLI case): DCP's notice that no process group exists is the intent
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# the serving process: importing lightning_rec or lightning raises; it scores every batch with every program
SERVE = """
import importlib.abc, sys

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("lightning_rec", "lightning", "pytorch_lightning"):
            raise ImportError(f"{name} must not be imported by the serving process")
        return None

sys.meta_path.insert(0, Blocked())
import torch
try:
    import lightning_rec  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("the import block does not work")
programs, inputs = sys.argv[1].split(","), torch.load(sys.argv[2])
with torch.no_grad():
    outs = [[torch.export.load(p).module()(*x) for x in inputs] for p in programs]
torch.save(outs, sys.argv[3])
"""


def _serve(programs: list[Path], inputs: list[tuple], tmp: Path) -> list[list[torch.Tensor]]:
    torch.save(inputs, tmp / "inputs.pt")
    proc = subprocess.run(
        [sys.executable, "-c", SERVE, ",".join(map(str, programs)), str(tmp / "inputs.pt"), str(tmp / "outs.pt")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp,  # not the project root: nothing of it is importable by path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(tmp / "outs.pt")


def _trained():
    model = _dlrm()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))  # "training": weights unlike a fresh model's
    return model.eval()


def test_quantized_programs_score_as_the_quantized_model_without_lightning_rec(tmp_path: Path) -> None:
    trained = _trained()
    keys, rows = list(CARDS), list(CARDS.values())
    inputs = [_batch(keys, rows, b, n, seed) for seed, (b, n) in enumerate(SHAPES)]
    # int8 from the float model (export_program quantizes its copy); int4 from a model quantized in memory
    want = {
        "int8": quantize_embeddings(trained, torch.qint8, inplace=False),
        "int4": quantize_embeddings(trained, torch.quint4x2, inplace=False),
    }
    paths = [
        export_program(trained, tmp_path / "int8.pt2", quantize=torch.qint8),
        export_program(want["int4"], tmp_path / "int4.pt2"),
    ]
    served = _serve(paths, inputs, tmp_path)
    for (kind, model), outs in zip(want.items(), served):
        with torch.no_grad():
            float_scores = [trained(x[0], KeyedJaggedTensor(keys, x[1], lengths=x[2])) for x in inputs]
            for x, got in zip(inputs, outs):
                ref = model(x[0], KeyedJaggedTensor(keys, x[1], lengths=x[2]))  # fbgemm's inference kernel
                assert got.shape == (x[0].size(0),)
                torch.testing.assert_close(got, ref, msg=kind)
            # (bags of no ids score the same either way)
            assert any(not torch.equal(got, f) for got, f in zip(outs, float_scores)), f"{kind}: float tables served"
    extra = {SIGNATURE_FILE: ""}
    program = torch.export.load(paths[1], extra_files=extra)
    assert "fbgemm" not in str(program.graph)
    sig = json.loads(extra[SIGNATURE_FILE])
    assert sig["keys"] == keys and list(sig["quantized"].values()) == ["INT4"] * len(CARDS)
    tables = {n: t for n, t in program.state_dict.items() if "embedding_bags" in n}
    assert len(tables) == len(CARDS) and all(t.dtype == torch.uint8 for t in tables.values()), "stored rows"


def test_quantize_argument_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="per_table_weight_dtype needs quantize"):
        export_program(_dlrm(), tmp_path / "a.pt2", per_table_weight_dtype={"item": "fp16"})
    with pytest.raises(ValueError, match="int3"):
        export_program(_dlrm(), tmp_path / "b.pt2", quantize="int3")
    assert list(tmp_path.iterdir()) == []


def test_cli_writes_a_quantized_program(tmp_path: Path) -> None:
    # a RecModule called as model(kjt) (no num_dense attribute): the program takes values and lengths only
    trained = ClickModule()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in trained.parameters():
            p.normal_()
    checkpoint.save(tmp_path / "ckpt", trained)
    out = tmp_path / "clicks.pt2"
    args = ["export", str(tmp_path / "ckpt"), "--model", "tests.lightning.models:ClickModule", "--quantize", "int4"]
    assert main([*args, "--table-dtype", "geo=int8", "--program", "-o", str(out)]) == 0
    want = quantize_embeddings(trained, torch.quint4x2, inplace=False, per_table_weight_dtype={"geo": torch.qint8})
    program = torch.export.load(out).module()
    kjt, _ = collate([Clicks(8)[i] for i in range(8)])
    with torch.no_grad():
        torch.testing.assert_close(program(kjt.values(), kjt.lengths()), want.eval()(kjt))
