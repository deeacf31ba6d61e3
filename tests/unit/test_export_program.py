"""torch.export of the unsharded model: export -> torch.export.save -> load in a fresh process -> eager outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.fx

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, checkpoint
from lightning_rec.export import SIGNATURE_FILE, TensorInputs, export_program, inference_model
from lightning_rec.models import DLRM
from lightning_rec.models.dlrm import DLRM as TorchRecDLRM

CARDS = {"user id": 23, "item": 31, "geo.city": 7}  # any string is a feature name
DENSE = 3

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
    proc = subprocess.run([sys.executable, "-c", SERVE, ",".join(map(str, programs)), str(tmp / "inputs.pt"),
                           str(tmp / "outs.pt")], capture_output=True, text=True, timeout=120, cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = json.loads(proc.stdout.strip().splitlines()[-1])
    assert imported == [], f"the serving process imported {imported}"
    return torch.load(tmp / "outs.pt")


def _batch(keys: list[str], rows: list[int], b: int, max_len: int, seed: int, dense: int | None = DENSE,
           weighted: bool = False) -> tuple:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (len(keys) * b,), generator=g)
    values = torch.cat([torch.randint(0, n, (int(k),), generator=g)
                        for n, k in zip(rows, lengths.view(len(keys), b).sum(1))])
    out = ([] if dense is None else [torch.randn(b, dense, generator=g)]) + [values, lengths]
    return tuple(out + ([torch.rand(values.numel(), generator=g)] if weighted else []))


def _dlrm() -> DLRM:
    torch.manual_seed(0)
    return DLRM(num_dense=DENSE, feature_names=list(CARDS), num_embeddings_per_feature=list(CARDS.values()),
                embedding_dim=4, dense_arch_layer_sizes=[8, 4], over_arch_layer_sizes=[8, 1])


# batch sizes 1 (no special case), 2, 17; bags of 0 (all empty), up to 1, up to 6 ids
SHAPES = [(1, 2), (2, 0), (17, 6), (5, 1)]


def test_dlrm_and_weighted_collection_round_trip_through_a_fresh_process(tmp_path: Path) -> None:
    model = _dlrm()
    p1 = export_program(model, tmp_path / "dlrm.pt2")
    # a weighted collection (one table read by two features) with MEAN pooling, and no dense input
    ebc = EmbeddingBagCollection([
        EmbeddingBagConfig(name="t1", num_embeddings=11, embedding_dim=3, feature_names=["a", "b"]),
        EmbeddingBagConfig(name="t2", num_embeddings=5, embedding_dim=2, feature_names=["c"], pooling="mean"),
    ], is_weighted=True)
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


def test_export_from_a_checkpoint_directory_matches_the_trained_model(tmp_path: Path) -> None:
    trained = _dlrm()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p))  # "training": every weight differs from a fresh model's
    checkpoint.save(tmp_path / "ckpt", trained)
    fresh = _dlrm()
    before = [p.clone() for p in fresh.parameters()]
    path = export_program(fresh, tmp_path / "m.pt2", checkpoint_dir=tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters())), "the given model must not change"
    program = torch.export.load(path).module()
    trained.eval()
    for seed, (b, n) in enumerate(SHAPES):
        dense, values, lengths = _batch(list(CARDS), list(CARDS.values()), b, n, seed)
        with torch.no_grad():
            ref = trained(dense, KeyedJaggedTensor(list(CARDS), values, lengths=lengths))
        torch.testing.assert_close(program(dense, values, lengths), ref)


def test_inference_model_is_an_independent_torch_kernel_copy() -> None:
    model = _dlrm()
    copy = inference_model(model)
    assert copy is not model and not copy.training
    ebc = copy.sparse_arch.embedding_bag_collection
    assert ebc.kernel == "torch" and not ebc.sparse_grad
    for a, b in zip(model.parameters(), copy.parameters()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()


def test_bad_requests_raise_and_leave_no_file(tmp_path: Path) -> None:
    model = _dlrm()
    with pytest.raises(ValueError, match="not features of the model"):
        export_program(model, tmp_path / "a.pt2", keys=["user id", "nope"])
    with pytest.raises(ValueError, match="num_dense"):
        export_program(model.sparse_arch, tmp_path / "b.pt2")
    assert list(tmp_path.iterdir()) == []


def test_fx_symbolic_trace_of_the_tensor_signature_matches_eager() -> None:
    # TorchRec's DLRM (the Lightning DLRM's parts) behind the plain-tensor signature that export_program serves
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="ta", num_embeddings=10, embedding_dim=4, feature_names=["a"]),
                                  EmbeddingBagConfig(name="tb", num_embeddings=20, embedding_dim=4, feature_names=["b"],
                                                     pooling="mean")])
    wrapper = TensorInputs(TorchRecDLRM(ebc, DENSE, [8, 4], [8, 1]), ["a", "b"], num_dense=DENSE)
    gm = torch.fx.symbolic_trace(wrapper)
    assert "embedding_bag" in gm.code
    for seed, (b, n) in enumerate(SHAPES):
        x = _batch(["a", "b"], [10, 20], b, n, seed)
        torch.testing.assert_close(gm(*x), wrapper(*x))
