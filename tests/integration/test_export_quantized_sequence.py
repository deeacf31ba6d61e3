"""Quantized sequence collections (``EmbeddingCollection``) and quantized managed-collision collections exported
with ``torch.export``: each program is served by a fresh process in which lightning_rec and Lightning cannot be
imported, and scores as the quantized model in memory (fbgemm's kernel, the maps remapping eagerly) does."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lightning_rec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    quantize_embeddings,
)
from lightning_rec import quant as Q
from lightning_rec.export import SIGNATURE_FILE, export_program
from lightning_rec.mc import (
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
    MCHManagedCollisionModule,
)
from tests.integration.test_export_quantized import _serve

# widths 8 and 4 (one fbgemm kernel each in memory); dotted names, as users name tables
SEQUENCE = [
    EmbeddingConfig(name="tok.en", num_embeddings=48, embedding_dim=8, feature_names=["a", "b"]),
    EmbeddingConfig(name="pos", num_embeddings=11, embedding_dim=4, feature_names=["c"]),
]
POOLED = [
    EmbeddingBagConfig(name="user.id", num_embeddings=64, embedding_dim=8, feature_names=["u"]),
    EmbeddingBagConfig(name="geo", num_embeddings=9, embedding_dim=8, feature_names=["g"], pooling="mean"),
]
MANAGED = {"tok.en": 3, "user.id": 4}  # table: buckets
BIG = 1 << 40  # raw ids
# (batch size, longest bag): a batch of one, bags all empty, long bags
SHAPES = [(1, 3), (2, 0), (17, 5), (6, 2)]


class SequenceScorer(nn.Module):
    """Called as ``model(kjt)``: each feature's looked-up rows (in order) through a projection, summed per sample."""

    def __init__(self, collection: nn.Module, widths: dict[str, int]) -> None:
        super().__init__()
        self.collection = collection
        self.proj = nn.ModuleDict({f: nn.Linear(d, 3) for f, d in widths.items()})
        self.head = nn.Linear(3 * len(widths), 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        out = self.collection(kjt)
        jts = out[0] if isinstance(out, tuple) else out  # managed collision: (embeddings, remapped or None)
        pooled = []
        for f, proj in self.proj.items():
            jt = jts[f]
            rows = torch.tanh(proj(jt.values()))
            ids = torch.arange(rows.size(0), device=rows.device)
            pooled.append(F.embedding_bag(ids, rows, jt.offsets(), mode="sum", include_last_offset=True))
        return self.head(torch.cat(pooled, 1)).squeeze(1)


class PooledScorer(nn.Module):
    """Called as ``model(kjt)`` over a ``ManagedCollisionEmbeddingBagCollection``."""

    def __init__(self, mc: nn.Module) -> None:
        super().__init__()
        self.mc = mc
        self.head = nn.Linear(16, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        pooled, _ = self.mc(kjt)
        return self.head(pooled.values()).squeeze(1)


def _mcc(tables) -> ManagedCollisionCollection:
    mods = {
        t.name: MCHManagedCollisionModule(t.num_embeddings, num_buckets=MANAGED[t.name])
        for t in tables
        if t.name in MANAGED
    }
    return ManagedCollisionCollection(mods, tables)


def _inputs(
    tables, b: int, n: int, seed: int, managed: bool, pool: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, lengths)``, key-major; with ``managed``, managed features take raw ids (half of them from ``pool``:
    ids seen before)."""
    g = torch.Generator().manual_seed(seed)
    keys = [(f, t) for t in tables for f in t.feature_names]
    lengths = torch.randint(0, n + 1, (len(keys) * b,), generator=g)
    values = []
    for (_, t), k in zip(keys, lengths.view(len(keys), b).sum(1).tolist()):
        if not managed or t.name not in MANAGED:
            values.append(torch.randint(0, t.num_embeddings, (k,), generator=g))
            continue
        v = torch.randint(0, BIG, (k,), generator=g)
        if pool is not None:
            v = torch.where(
                torch.rand(k, generator=g) < 0.5, pool[torch.randint(0, pool.numel(), (k,), generator=g)], v
            )
        values.append(v)
    return torch.cat(values), lengths


def _trained(model: nn.Module, tables, managed: bool) -> tuple[nn.Module, torch.Tensor | None]:
    """Weights unlike a fresh model's; with managed collision, train-mode forwards first (ids take rows)."""
    torch.manual_seed(3)
    seen = None
    if managed:
        keys = [f for t in tables for f in t.feature_names]
        batches = [_inputs(tables, 16, 3, 100 + s, True) for s in range(4)]
        model.train()
        with torch.no_grad():
            for values, lengths in batches:
                model(KeyedJaggedTensor(keys, values, lengths=lengths))
        seen = torch.cat([v for v, _ in batches])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    return model.eval(), seen


def _check_served(model: nn.Module, tables, tmp_path: Path, name: str, seen: torch.Tensor | None = None) -> Path:
    """Export ``model`` int8 (quantized by export_program) and int4 (quantized in memory); the served scores equal
    the in-memory quantized model's on every batch shape, and are not the float model's."""
    keys = [f for t in tables for f in t.feature_names]
    inputs = [_inputs(tables, b, n, seed, seen is not None, seen) for seed, (b, n) in enumerate(SHAPES)]
    want = {
        "int8": quantize_embeddings(model, torch.qint8, inplace=False),
        "int4": quantize_embeddings(model, torch.quint4x2, inplace=False),
    }
    paths = [
        export_program(model, tmp_path / f"{name}_int8.pt2", num_dense=None, quantize=torch.qint8),
        export_program(want["int4"], tmp_path / f"{name}_int4.pt2", num_dense=None),
    ]
    served = _serve(paths, inputs, tmp_path)
    with torch.no_grad():
        floats = [model(KeyedJaggedTensor(keys, v, lengths=n)) for v, n in inputs]
        for (kind, q), outs in zip(want.items(), served):
            for (v, n), got, b in zip(inputs, outs, [b for b, _ in SHAPES]):
                assert got.shape == (b,)
                torch.testing.assert_close(got, q(KeyedJaggedTensor(keys, v, lengths=n)), msg=f"{name} {kind}")
            assert any(not torch.equal(g, f) for g, f in zip(outs, floats)), f"{name} {kind}: float tables served"
    extra = {SIGNATURE_FILE: ""}
    program = torch.export.load(paths[1], extra_files=extra)
    assert "fbgemm" not in str(program.graph)
    sig = json.loads(extra[SIGNATURE_FILE])
    assert sig["keys"] == keys and set(sig["quantized"].values()) == {"INT4"}
    return paths[1]


def test_quantized_sequence_collection_program(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, _ = _trained(
        SequenceScorer(EmbeddingCollection(SEQUENCE, need_indices=True), {"a": 8, "b": 8, "c": 4}), SEQUENCE, False
    )
    path = _check_served(model, SEQUENCE, tmp_path, "seq")
    tables = {n: t for n, t in torch.export.load(path).state_dict.items() if ".embeddings." in n}
    assert len(tables) == 2 and all(t.dtype == torch.uint8 for t in tables.values()), "stored rows"


def test_quantized_managed_collision_sequence_program(tmp_path: Path) -> None:
    torch.manual_seed(0)
    mc = ManagedCollisionEmbeddingCollection(EmbeddingCollection(SEQUENCE), _mcc(SEQUENCE))
    model, seen = _trained(SequenceScorer(mc, {"a": 8, "b": 8, "c": 4}), SEQUENCE, True)
    assert isinstance(
        quantize_embeddings(model, torch.qint8, inplace=False).collection, Q.QuantManagedCollisionEmbeddingCollection
    )
    state = {k: v.clone() for k, v in mc.state_dict().items() if torch.is_tensor(v)}
    path = _check_served(model, SEQUENCE, tmp_path, "mc_seq", seen)
    assert all(torch.equal(v, mc.state_dict()[k]) for k, v in state.items()), "exporting changed the float model"
    held = {n: t for n, t in torch.export.load(path).state_dict.items() if n.endswith("_mch_raw_ids")}
    assert len(held) == 1 and torch.equal(
        next(iter(held.values())), state["_managed_collision_collection._managed_collision_modules.tok.en._mch_raw_ids"]
    )


def test_quantized_managed_collision_pooled_program(tmp_path: Path) -> None:
    torch.manual_seed(0)
    mc = ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(POOLED), _mcc(POOLED))
    model, seen = _trained(PooledScorer(mc), POOLED, True)
    _check_served(model, POOLED, tmp_path, "mc_pooled", seen)
