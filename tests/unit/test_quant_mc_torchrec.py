"""TorchRec's quantized serving code, imports from ``torchrec.*`` resolved by ``tests/torchrec_alias.py``: the
snippet below is written as a TorchRec user writes it (``quantize_embeddings`` from ``torchrec.inference.modules``;
``torch.ao.quantization.quantize_dynamic`` with ``torchrec.quant.embedding_modules``' classes, including a managed-
collision collection), and its outputs are checked against the stored rows read back by hand."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from lightning_rec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from lightning_rec.mc import ManagedCollisionCollection, ManagedCollisionEmbeddingCollection, MCHManagedCollisionModule
from tests import torchrec_alias
from tests.unit.test_quant_modules import stored_values

SNIPPET = """
import torch
import torch.quantization as quant
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, KeyedJaggedTensor
from torchrec.inference.modules import quantize_embeddings
from torchrec.modules.embedding_configs import QuantConfig
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
from torchrec.quant.embedding_modules import (
    EmbeddingBagCollection as QuantEmbeddingBagCollection,
    EmbeddingCollection as QuantEmbeddingCollection,
    QuantManagedCollisionEmbeddingCollection,
)

ebc = EmbeddingBagCollection(
    tables=[
        EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=100, feature_names=["f1"]),
        EmbeddingBagConfig(name="t2", embedding_dim=16, num_embeddings=50, feature_names=["f2"]),
    ],
    device=torch.device("cpu"),
)
features = KeyedJaggedTensor.from_lengths_sync(
    keys=["f1", "f2"],
    values=torch.tensor([1, 2, 99, 3, 4, 7, 49]),
    lengths=torch.tensor([2, 0, 1, 1, 2, 1]),
)
float_pooled = ebc(features).values()
qebc = quantize_embeddings(ebc, dtype=torch.qint8, inplace=False, output_dtype=torch.float)
assert isinstance(qebc, QuantEmbeddingBagCollection)
pooled = qebc(features)

# TorchRec's own flow for sequence and managed-collision tables: torch.ao's quantize_dynamic with a QuantConfig
qconfig = QuantConfig(
    activation=quant.PlaceholderObserver.with_args(dtype=torch.float),
    weight=quant.PlaceholderObserver.with_args(dtype=torch.quint4x2),
)
quantized = quant.quantize_dynamic(
    model,
    qconfig_spec={EmbeddingCollection: qconfig, ManagedCollisionEmbeddingCollection: qconfig},
    mapping={
        EmbeddingCollection: QuantEmbeddingCollection,
        ManagedCollisionEmbeddingCollection: QuantManagedCollisionEmbeddingCollection,
    },
    inplace=False,
)
assert isinstance(quantized.mc_ec, QuantManagedCollisionEmbeddingCollection)
assert isinstance(quantized.ec, QuantEmbeddingCollection)
embeddings, remapped = quantized.mc_ec(raw_features)
sequence = quantized.ec(seq_features)
"""


@pytest.fixture
def torchrec_names():
    before = set(sys.modules)
    torchrec_alias.install()
    yield
    for name in set(sys.modules) - before:
        if name == "torchrec" or name.startswith("torchrec.") or name == "parameterized":
            del sys.modules[name]


def test_torchrec_serving_snippet_runs_through_the_aliases(torchrec_names) -> None:
    torch.manual_seed(0)
    seq_tables = [EmbeddingConfig(name="tok", num_embeddings=32, embedding_dim=8, feature_names=["a"])]
    model = torch.nn.Module()
    model.ec = EmbeddingCollection(seq_tables)
    # the float model is built and trained outside the snippet: the snippet is TorchRec's serving side
    mcc = ManagedCollisionCollection({"tok": MCHManagedCollisionModule(32, num_buckets=2)}, seq_tables)
    model.mc_ec = ManagedCollisionEmbeddingCollection(
        EmbeddingCollection(seq_tables), mcc, return_remapped_features=True
    )
    admit = KeyedJaggedTensor(["a"], torch.tensor([10**12, 7, 10**15, 42]), lengths=torch.tensor([2, 2]))
    model.mc_ec(admit)  # training: these ids take rows
    model.eval()
    raw = KeyedJaggedTensor(["a"], torch.tensor([7, 123456789, 10**12]), lengths=torch.tensor([1, 2]))
    seq = KeyedJaggedTensor(["a"], torch.tensor([0, 31, 5]), lengths=torch.tensor([2, 1]))
    ns = {"model": model, "raw_features": raw, "seq_features": seq}
    exec(compile(SNIPPET, "<torchrec snippet>", "exec"), ns)

    # pooled int8: the stored rows by hand, pooled with F.embedding_bag
    qebc, features = ns["qebc"], ns["features"]
    jts = features.to_dict()
    want = []
    for name, f in (("t1", "f1"), ("t2", "f2")):
        dim = 8 if name == "t1" else 16
        table = stored_values(qebc.state_dict()[f"embedding_bags.{name}.weight"], "int8", dim)
        want.append(F.embedding_bag(jts[f].values(), table, jts[f].offsets(), mode="sum", include_last_offset=True))
    assert ns["pooled"].keys() == ["f1", "f2"]
    torch.testing.assert_close(ns["pooled"].values(), torch.cat(want, 1), atol=1e-5, rtol=1e-5)
    assert (ns["pooled"].values() - ns["float_pooled"]).abs().max() < 0.02

    # torch.ao's flow quantized the inner collection first; the MC collection kept those rows and the maps
    quantized = ns["quantized"]
    rows = stored_values(quantized.state_dict()["mc_ec.embeddings.tok.weight"], "int4", 8)
    held = model.mc_ec._managed_collision_collection.modules_by_table()["tok"]._mch_raw_ids.tolist()
    remapped = model.mc_ec._managed_collision_collection(raw).values()  # the float model's own remap (eval)
    assert held.index(7) == int(remapped[0]) and held.index(10**12) == int(remapped[2])
    assert torch.equal(ns["remapped"].values(), remapped)
    torch.testing.assert_close(ns["embeddings"]["a"].values(), F.embedding(remapped, rows), atol=1e-6, rtol=0)
    seq_rows = stored_values(quantized.state_dict()["ec.embeddings.tok.weight"], "int4", 8)
    torch.testing.assert_close(ns["sequence"]["a"].values(), F.embedding(seq.values(), seq_rows), atol=1e-6, rtol=0)
    assert isinstance(model.mc_ec, ManagedCollisionEmbeddingCollection)  # inplace=False
