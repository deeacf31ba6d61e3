"""Quantized managed-collision collections against an independent reference: the raw ids remapped by the float
model's own MC modules (in ``eval()``), then the quantized rows read back by hand (fbgemm's row-wise layout) and
pooled with ``F.embedding_bag`` / gathered with ``F.embedding``."""

from __future__ import annotations

import copy
import io
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_rec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    checkpoint,
    load_quantized,
    quantize_embeddings,
)
from lightning_rec import quant as Q
from lightning_rec.mc import (
    LFU_EvictionPolicy,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
    MCHManagedCollisionModule,
)
from tests.unit.test_quant_modules import DTYPES, stored_values

# one process saving a checkpoint directory: DCP's notice that no process group exists is the intent here
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

BIG = 1 << 40  # raw ids: far beyond any table
POOLED = [
    EmbeddingBagConfig(name="user.id", num_embeddings=64, embedding_dim=8, feature_names=["u"]),
    EmbeddingBagConfig(name="item", num_embeddings=32, embedding_dim=16, feature_names=["i", "hist"], pooling="mean"),
    EmbeddingBagConfig(name="geo", num_embeddings=9, embedding_dim=4, feature_names=["g"]),  # not managed
]
SEQUENCE = [
    EmbeddingConfig(name="tok.en", num_embeddings=48, embedding_dim=8, feature_names=["a", "b"]),
    EmbeddingConfig(name="pos", num_embeddings=11, embedding_dim=4, feature_names=["c"]),  # not managed
]
MANAGED = {"user.id": 4, "item": 2, "tok.en": 3}  # buckets


def _mcc(tables) -> ManagedCollisionCollection:
    mods = {
        t.name: MCHManagedCollisionModule(
            t.num_embeddings,
            num_buckets=MANAGED[t.name],
            eviction_policy=LFU_EvictionPolicy() if t.name == "item" else None,
        )
        for t in tables
        if t.name in MANAGED
    }
    return ManagedCollisionCollection(mods, tables)


def _kjt(tables, batch: int, g: torch.Generator, pool: torch.Tensor | None = None) -> KeyedJaggedTensor:
    """Raw ids for the managed features (with ``pool``: half of them drawn from it, ids seen before), table ids for
    the others."""
    keys = [f for t in tables for f in t.feature_names]
    rows = {f: t.num_embeddings for t in tables for f in t.feature_names}
    managed = {f for t in tables if t.name in MANAGED for f in t.feature_names}
    lengths = torch.randint(0, 4, (len(keys) * batch,), generator=g)
    values = []
    for k, n in zip(keys, lengths.view(len(keys), batch).sum(1).tolist()):
        if k not in managed:
            values.append(torch.randint(0, rows[k], (n,), generator=g))
        else:
            fresh = torch.randint(0, BIG, (n,), generator=g)
            if pool is not None:
                old = pool[torch.randint(0, pool.numel(), (n,), generator=g)]
                fresh = torch.where(torch.rand(n, generator=g) < 0.5, old, fresh)
            values.append(fresh)
    return KeyedJaggedTensor(keys, torch.cat(values), lengths=lengths)


def _trained(module, tables, steps: int = 6, seed: int = 0):
    """Train-mode forwards over raw ids (more distinct ids than rows: admissions, evictions, fallbacks); returns
    the module in eval() and every id it saw."""
    g = torch.Generator().manual_seed(seed)
    seen = []
    module.train()
    for _ in range(steps):
        kjt = _kjt(tables, 24, g)
        module(kjt)
        seen.append(kjt.values())
    return module.eval(), torch.cat(seen)


def _query(tables, seen: torch.Tensor, seed: int = 7) -> KeyedJaggedTensor:
    """About half the managed ids seen in training, half never seen."""
    return _kjt(tables, 12, torch.Generator().manual_seed(seed), pool=seen)


def _reference_remap(float_mc, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    # the float model's own MC modules, remapping read-only (eval), on a copy so nothing is shared
    mcc = copy.deepcopy(float_mc._managed_collision_collection).eval()
    return mcc(kjt)


def _states_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


@pytest.mark.parametrize("kind", ["int8", "int4", "fp16"])
def test_pooled_equals_float_remap_then_quantized_rows(kind: str) -> None:
    torch.manual_seed(0)
    float_mc, seen = _trained(
        ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(POOLED), _mcc(POOLED)), POOLED
    )
    query = _query(POOLED, seen)
    remapped = _reference_remap(float_mc, query)
    jts, raw = remapped.to_dict(), query.to_dict()
    # the query holds ids that hold a row and ids that do not (they share their bucket's fallback row)
    held = {int(i) for m in float_mc._managed_collision_collection.modules_by_table().values() for i in m._mch_raw_ids}
    assert any(int(i) in held for i in raw["u"].values()) and any(int(i) not in held for i in raw["u"].values())
    float_state = copy.deepcopy(float_mc.state_dict())
    for kernel in ("fbgemm", "torch"):
        q = quantize_embeddings(float_mc, DTYPES[kind], inplace=False, kernel=kernel)
        assert isinstance(q, Q.QuantManagedCollisionEmbeddingBagCollection) and isinstance(q, Q.EmbeddingBagCollection)
        state = copy.deepcopy(q.state_dict())
        for mode in ("eval", "train"):  # serving never admits an id, whatever the mode
            getattr(q, mode)()
            out, none = q(query)
            assert none is None
            outs = []
            for t in POOLED:
                table = stored_values(q.state_dict()[f"embedding_bags.{t.name}.weight"], kind, t.embedding_dim)
                for f in t.feature_names:
                    jt = jts[f]
                    o = F.embedding_bag(jt.values(), table, jt.offsets(), mode="sum", include_last_offset=True)
                    if t.pooling.name == "MEAN":
                        o = o / jt.lengths().clamp(min=1).unsqueeze(1)
                    outs.append(o)
            assert out.keys() == ["u", "i", "hist", "g"]
            torch.testing.assert_close(out.values(), torch.cat(outs, 1), atol=1e-5, rtol=1e-5)
            assert _states_equal(q.state_dict(), state), f"{kernel} {mode}: remapping changed the quantized state"
    assert _states_equal(float_mc.state_dict(), float_state), "quantizing a copy changed the float model"
    # near the float model itself (which remaps the same way in eval)
    tol = {"int8": 0.05, "int4": 0.5, "fp16": 1e-3}[kind]
    assert (out.values() - float_mc(query)[0].values()).abs().max() < tol


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_sequence_equals_float_remap_then_quantized_rows(kind: str) -> None:
    torch.manual_seed(0)
    ec = EmbeddingCollection(SEQUENCE, need_indices=True)
    float_mc, seen = _trained(
        ManagedCollisionEmbeddingCollection(ec, _mcc(SEQUENCE), return_remapped_features=True), SEQUENCE
    )
    query = _query(SEQUENCE, seen, seed=3)
    remapped = _reference_remap(float_mc, query)
    jts = remapped.to_dict()
    for kernel in ("fbgemm", "torch"):
        q = quantize_embeddings(float_mc, DTYPES[kind], inplace=False, kernel=kernel)
        assert isinstance(q, Q.QuantManagedCollisionEmbeddingCollection)
        state = copy.deepcopy(q.state_dict())
        out, kjt = q(query)
        assert kjt is not None and torch.equal(kjt.values(), remapped.values())  # return_remapped_features
        assert list(out) == ["a", "b", "c"]
        for t in SEQUENCE:
            table = stored_values(q.state_dict()[f"embeddings.{t.name}.weight"], kind, t.embedding_dim)
            for f in t.feature_names:
                torch.testing.assert_close(out[f].values(), F.embedding(jts[f].values(), table), atol=1e-6, rtol=0)
                assert torch.equal(out[f].lengths(), jts[f].lengths())
                assert torch.equal(out[f].weights(), jts[f].values())  # need_indices: the rows looked up
        assert _states_equal(q.state_dict(), state)


def test_in_a_model_state_dict_round_trip_and_maps_loaded() -> None:
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.mc, _ = _trained(ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(POOLED), _mcc(POOLED)), POOLED)
    model.head = torch.nn.Linear(2, 1)
    query = _query(POOLED, torch.arange(5), seed=1)
    q1 = quantize_embeddings(model, torch.quint4x2, inplace=False)
    assert isinstance(model.mc, ManagedCollisionEmbeddingBagCollection)  # inplace=False: the model is unchanged
    assert isinstance(q1.mc, Q.QuantManagedCollisionEmbeddingBagCollection)
    keys = q1.state_dict().keys()
    assert "mc._managed_collision_collection._managed_collision_modules.user.id._mch_raw_ids" in keys
    assert not any("_sorted" in k for k in keys)  # derived, rebuilt on load
    # another model: other weights and other maps; loading q1's state gives q1's outputs (maps included)
    other = torch.nn.Module()
    other.mc, _ = _trained(
        ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(POOLED), _mcc(POOLED)), POOLED, seed=5
    )
    other.head = torch.nn.Linear(2, 1)
    q2 = quantize_embeddings(other, torch.quint4x2)
    assert q2 is other and not torch.equal(q2.mc(query)[0].values(), q1.mc(query)[0].values())
    buf = io.BytesIO()
    torch.save(q1.state_dict(), buf)
    buf.seek(0)
    q2.load_state_dict(torch.load(buf, weights_only=True))
    assert torch.equal(q2.mc(query)[0].values(), q1.mc(query)[0].values())
    # a map that is not one (an id in two rows) is refused naming the table
    bad = copy.deepcopy(q1.state_dict())
    ids = bad["mc._managed_collision_collection._managed_collision_modules.item._mch_raw_ids"]
    ids[ids.numel() // 2 :] = -1
    ids[1] = ids[0] = 12345 if int(ids[0]) < 0 else int(ids[0])
    with pytest.raises(RuntimeError, match=r"managed collision table 'item': inconsistent id -> row map"):
        q2.load_state_dict(bad)


def test_load_quantized_from_a_checkpoint_directory(tmp_path: Path) -> None:
    torch.manual_seed(0)

    def build() -> torch.nn.Module:
        m = torch.nn.Module()
        m.mc = ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(POOLED), _mcc(POOLED))
        return m

    trained = build()
    trained.mc, seen = _trained(trained.mc, POOLED)
    checkpoint.save(tmp_path / "ckpt", trained)
    query = _query(POOLED, seen)
    want = quantize_embeddings(trained, torch.qint8, inplace=False)
    got = load_quantized(tmp_path / "ckpt", build(), torch.qint8)
    assert isinstance(got.mc, Q.QuantManagedCollisionEmbeddingBagCollection) and not got.training
    assert _states_equal(got.state_dict(), want.state_dict())
    assert torch.equal(got.mc(query)[0].values(), want.mc(query)[0].values())


def test_errors_name_the_table_or_feature() -> None:
    float_mc, _ = _trained(ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(POOLED), _mcc(POOLED)), POOLED)
    q = quantize_embeddings(float_mc, torch.qint8, inplace=False)
    bad = KeyedJaggedTensor(
        ["u", "i", "hist", "g"], torch.tensor([-3, 1, 2, 3]), lengths=torch.ones(4, dtype=torch.long)
    )
    with pytest.raises(
        ValueError, match=r"feature 'u' \(managed collision table 'user.id'\): raw ids must be non-negative"
    ):
        q(bad)
    float_mc._managed_collision_collection.modules_by_table()["item"].set_target_num_buckets(4)
    with pytest.raises(
        ValueError, match=r"table 'item': its state was written with 2 buckets but the module is set to 4"
    ):
        quantize_embeddings(float_mc, torch.qint8, inplace=False)
    with pytest.raises(TypeError, match="from_float expects a lightning_rec ManagedCollisionEmbeddingBagCollection"):
        Q.QuantManagedCollisionEmbeddingBagCollection.from_float(EmbeddingBagCollection(POOLED), dtype=torch.qint8)  # type: ignore[arg-type]
    odd = [EmbeddingBagConfig(name="user.id", num_embeddings=64, embedding_dim=6, feature_names=["u"])]
    with pytest.raises(ValueError, match=r"table 'user.id' \(embedding_dim=6\) cannot be stored as INT2"):
        quantize_embeddings(
            ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(odd), _mcc(odd)), torch.quint2x4
        )
