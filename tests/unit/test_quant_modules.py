"""Quantized collections against an independent reference: the stored rows read back by hand from fbgemm's
documented row-wise layout (fp16 scale, fp16 bias, packed values), pooled with ``F.embedding_bag``."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch.ao.quantization import PlaceholderObserver

from lightning_rec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    quantize_embeddings,
)
from lightning_rec import quant as Q
from lightning_rec.configs import DataType

DTYPES = {"int8": torch.qint8, "int4": torch.quint4x2, "int2": torch.quint2x4, "fp16": torch.float16}
BITS = {"int8": 8, "int4": 4, "int2": 2}
# user-chosen names are data: dots and spaces
POOLED = [
    EmbeddingBagConfig(name="user.id", num_embeddings=23, embedding_dim=8, feature_names=["u"]),
    EmbeddingBagConfig(
        name="item list", num_embeddings=31, embedding_dim=16, feature_names=["i", "hist"], pooling="mean"
    ),
    EmbeddingBagConfig(name="geo", num_embeddings=9, embedding_dim=4, feature_names=["g"]),
]
SEQUENCE = [
    EmbeddingConfig(name="tok.en", num_embeddings=17, embedding_dim=8, feature_names=["a", "b"]),
    EmbeddingConfig(name="pos", num_embeddings=11, embedding_dim=4, feature_names=["c"]),
]


def stored_values(rows: torch.Tensor, kind: str, dim: int) -> torch.Tensor:
    """fbgemm's rows read element by element: bytes 0-1 the fp16 scale, 2-3 the fp16 bias, then value j in bits
    ``(j * bits) % 8`` and up of byte ``4 + j * bits // 8``; FP16 rows are the values."""
    if kind == "fp16":
        return rows[:, : 2 * dim].contiguous().view(torch.float16).float()
    bits = BITS[kind]
    scale = rows[:, 0:2].contiguous().view(torch.float16).float()
    bias = rows[:, 2:4].contiguous().view(torch.float16).float()
    cols = [(rows[:, 4 + j * bits // 8].long() >> ((j * bits) % 8)) & ((1 << bits) - 1) for j in range(dim)]
    return torch.stack(cols, 1).float() * scale + bias


def _kjt(keys, rows: dict[str, int], batch: int, seed: int, weighted: bool = False) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(keys) * batch,), generator=g)
    lengths[0] = 0  # an empty bag
    per_key = lengths.view(len(keys), batch).sum(1).tolist()
    values = torch.cat([torch.randint(0, rows[k], (n,), generator=g) for k, n in zip(keys, per_key)])
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor(list(keys), values, lengths=lengths, weights=weights)


def _rows(configs) -> dict[str, int]:
    return {f: t.num_embeddings for t in configs for f in t.feature_names}


def _pooled_reference(q: Q.EmbeddingBagCollection, kjt: KeyedJaggedTensor, kind: dict[str, str]) -> torch.Tensor:
    jts = kjt.to_dict()
    outs = []
    for t in q.embedding_bag_configs():
        table = stored_values(q.state_dict()[f"embedding_bags.{t.name}.weight"], kind[t.name], t.embedding_dim)
        for f in t.feature_names:
            jt = jts[f]
            out = F.embedding_bag(
                jt.values(),
                table,
                jt.offsets(),
                mode="sum",
                include_last_offset=True,
                per_sample_weights=jt.weights() if q.is_weighted() else None,
            )
            if t.pooling.name == "MEAN":
                out = out / jt.lengths().clamp(min=1).unsqueeze(1)
            outs.append(out)
    return torch.cat(outs, 1)


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("kind", list(DTYPES))
def test_pooled_matches_hand_dequantized_rows(kind: str, weighted: bool) -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(POOLED, is_weighted=weighted)
    kjt = _kjt(["u", "i", "hist", "g"], _rows(POOLED), batch=5, seed=1, weighted=weighted)
    for kernel in ("fbgemm", "torch"):
        q = quantize_embeddings(ebc, DTYPES[kind], inplace=False, kernel=kernel)
        assert isinstance(q, Q.EmbeddingBagCollection)
        out = q(kjt)
        assert out.keys() == ["u", "i", "hist", "g"] and out.values().dtype == torch.float32
        want = _pooled_reference(q, kjt, dict.fromkeys(q.storage_types(), kind))
        torch.testing.assert_close(out.values(), want, atol=1e-5, rtol=1e-5, msg=lambda m: f"{kernel}: {m}")
    # and near the float model (int2 keeps 4 levels per row: only a sanity bound)
    tol = {"int8": 0.02, "int4": 0.3, "int2": 1.0, "fp16": 1e-3}[kind]
    assert (out.values() - ebc(kjt).values()).abs().max() < tol


def test_mixed_storage_types_and_output_dtype() -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(POOLED)
    per_table = {"user.id": torch.quint2x4, "geo": torch.float16}
    q = quantize_embeddings(ebc, torch.quint4x2, inplace=False, per_table_weight_dtype=per_table)
    kinds = {"user.id": "int2", "item list": "int4", "geo": "fp16"}
    assert {n: t.name.lower() for n, t in q.storage_types().items()} == kinds
    assert [c.data_type for c in q.embedding_bag_configs()] == [DataType.INT2, DataType.INT4, DataType.FP16]
    kjt = _kjt(["u", "i", "hist", "g"], _rows(POOLED), batch=4, seed=2)
    torch.testing.assert_close(q(kjt).values(), _pooled_reference(q, kjt, kinds), atol=1e-5, rtol=1e-5)
    half = quantize_embeddings(
        ebc, torch.quint4x2, inplace=False, output_dtype=torch.float16, per_table_weight_dtype=per_table
    )
    assert half(kjt).values().dtype == torch.float16
    torch.testing.assert_close(half(kjt).values().float(), q(kjt).values(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("kind", list(DTYPES))
def test_sequence_matches_hand_dequantized_rows(kind: str) -> None:
    torch.manual_seed(0)
    ec = EmbeddingCollection(SEQUENCE, need_indices=True)  # widths 8 and 4: one fbgemm kernel each
    kjt = _kjt(["a", "b", "c"], _rows(SEQUENCE), batch=4, seed=3)
    jts = kjt.to_dict()
    for kernel in ("fbgemm", "torch"):
        q = quantize_embeddings(ec, DTYPES[kind], inplace=False, kernel=kernel)
        out = q(kjt)
        assert list(out) == ["a", "b", "c"]
        for t in q.embedding_configs():
            table = stored_values(q.state_dict()[f"embeddings.{t.name}.weight"], kind, t.embedding_dim)
            for f in t.feature_names:
                torch.testing.assert_close(out[f].values(), F.embedding(jts[f].values(), table), atol=1e-6, rtol=0)
                assert torch.equal(out[f].lengths(), jts[f].lengths())
                assert torch.equal(out[f].weights(), jts[f].values())  # need_indices


@pytest.mark.parametrize("kind", ["int8", "int4", "int2"])
def test_rows_within_half_a_step_of_the_float_rows(kind: str) -> None:
    """Each stored value is the float one rounded to the row's grid: at most scale / 2 away (fp32 arithmetic
    aside), including each row's largest and smallest value and rows of tiny range (subnormal fp16 scales)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 16, generator=g) * torch.logspace(-5, 1, 300).unsqueeze(1)
    w[0] = 0.25  # a constant row
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", num_embeddings=300, embedding_dim=16)])
    ebc.load_state_dict({"embedding_bags.t.weight": w})
    q = quantize_embeddings(ebc, DTYPES[kind], inplace=False)
    rows = q.state_dict()["embedding_bags.t.weight"]
    scale = rows[:, 0:2].contiguous().view(torch.float16).float()
    bias = rows[:, 2:4].contiguous().view(torch.float16).float()
    err = (stored_values(rows, kind, 16) - w).abs()
    assert bool((err <= scale / 2 + 1e-6 * (w.abs() + bias.abs())).all()), float((err / scale).max())
    assert torch.equal(stored_values(rows[:1], kind, 16), w[:1])  # a constant row is exact
    # and the step is the row's span over the levels, up to the fp16 rounding of scale (up) and bias (down)
    span = (w.amax(1, keepdim=True) - w.amin(1, keepdim=True) + bias.abs() / 1024) / ((1 << BITS[kind]) - 1)
    assert bool((scale[1:] <= span[1:] * (1 + 1 / 1024) + 6e-8).all())


def test_fp16_storage_is_the_rounded_weights() -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(POOLED)
    q = quantize_embeddings(ebc, torch.float16, inplace=False, row_alignment=1)
    for t in POOLED:
        got = stored_values(q.state_dict()[f"embedding_bags.{t.name}.weight"], "fp16", t.embedding_dim)
        assert torch.equal(got, ebc.embedding_bags[t.name].weight.detach().half().float())


def test_bytes_per_row() -> None:
    kinds = [DataType[k] for k in ("INT8", "INT4", "INT2", "FP16", "FP32")]
    # the default: fbgemm's row plus the serving trailer (int8: 8 bytes, int4 / int2: 4), padded to 4 (the README's)
    assert [Q.row_bytes(64, k) for k in kinds] == [76, 40, 24, 128, 256]
    assert [Q.row_bytes(64, k, 16) for k in kinds] == [80, 48, 32, 128, 256]  # the previous default, TorchRec's
    assert [Q.row_bytes(64, k, 1) for k in kinds] == [68, 36, 20, 128, 256]
    q = quantize_embeddings(EmbeddingBagCollection(POOLED), torch.qint8, inplace=False)
    assert q.state_dict()["embedding_bags.item list.weight"].shape == (31, 28)  # 4 + 16 + 8 bytes
    assert q.storage_bytes() == 23 * 20 + 31 * 28 + 9 * 16


def test_from_float_with_torchrec_qconfig_and_quantize_in_a_model() -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(POOLED)
    ebc.qconfig = Q.QuantConfig(
        activation=PlaceholderObserver.with_args(dtype=torch.float),
        weight=PlaceholderObserver.with_args(dtype=torch.qint8),
        per_table_weight_dtype={"geo": torch.float16},
    )
    q = Q.EmbeddingBagCollection.from_float(ebc)
    assert q.storage_types()["geo"] == DataType.FP16 and q.storage_types()["user.id"] == DataType.INT8
    model = torch.nn.Module()
    model.ebc, model.seq = EmbeddingBagCollection(POOLED), EmbeddingCollection(SEQUENCE)
    model.head = torch.nn.Linear(2, 1)
    out = quantize_embeddings(model, torch.qint8, inplace=False)
    assert isinstance(model.ebc, EmbeddingBagCollection) and isinstance(model.seq, EmbeddingCollection)
    assert isinstance(out.ebc, Q.EmbeddingBagCollection) and isinstance(out.seq, Q.EmbeddingCollection)
    assert out.head is not model.head and torch.equal(out.head.weight, model.head.weight)
    assert quantize_embeddings(model, torch.qint8) is model and isinstance(model.seq, Q.EmbeddingCollection)


def test_state_dict_round_trip_and_rebinding() -> None:
    torch.manual_seed(0)
    q1 = quantize_embeddings(EmbeddingBagCollection(POOLED), torch.quint4x2, inplace=False)
    q2 = quantize_embeddings(EmbeddingBagCollection(POOLED), torch.quint4x2, inplace=False)  # other weights
    kjt = _kjt(["u", "i", "hist", "g"], _rows(POOLED), batch=3, seed=4)
    buf = io.BytesIO()
    torch.save(q1.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    q2.load_state_dict(state)  # copies into the kernel's own rows
    assert torch.equal(q2(kjt).values(), q1(kjt).values())
    q3 = quantize_embeddings(EmbeddingBagCollection(POOLED), torch.quint4x2, inplace=False)
    q3.load_state_dict({k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}, assign=True)
    assert torch.equal(q3(kjt).values(), q1(kjt).values())  # new tensors: the kernel was rebuilt from them
    assert torch.equal(copy.deepcopy(q1)(kjt).values(), q1(kjt).values())


def test_errors_name_the_table_or_feature() -> None:
    odd = [EmbeddingBagConfig(name="odd.one", num_embeddings=5, embedding_dim=6), *POOLED[1:]]
    with pytest.raises(
        ValueError, match=r"table 'odd.one' \(embedding_dim=6\) cannot be stored as INT2: .* multiple of 4"
    ):
        quantize_embeddings(EmbeddingBagCollection(odd), torch.quint2x4)
    five = [EmbeddingBagConfig(name="five", num_embeddings=5, embedding_dim=5)]
    with pytest.raises(ValueError, match=r"table 'five' \(embedding_dim=5\) cannot be stored as INT4"):
        quantize_embeddings(EmbeddingBagCollection(five), torch.quint4x2)
    with pytest.raises(ValueError, match="cannot store embeddings as torch.bfloat16"):
        quantize_embeddings(EmbeddingBagCollection(POOLED), torch.bfloat16)
    with pytest.raises(ValueError, match=r"per_table_weight_dtype names tables \['nope'\]"):
        quantize_embeddings(EmbeddingBagCollection(POOLED), torch.qint8, per_table_weight_dtype={"nope": torch.qint8})
    big = EmbeddingBagCollection(POOLED)
    with torch.no_grad():
        big.embedding_bags["geo"].weight[3, 1] = 1e6
    with pytest.raises(ValueError, match=r"table 'geo': row 3 holds 1000000.0"):
        quantize_embeddings(big, torch.qint8)
    assert isinstance(big.embedding_bags, torch.nn.Module) and type(big) is EmbeddingBagCollection  # unchanged

    q = quantize_embeddings(EmbeddingBagCollection(POOLED, strict_features=True), torch.qint8)
    keys = ["u", "i", "hist", "g"]
    bad = KeyedJaggedTensor(keys, torch.tensor([0, 1, 2, 9]), lengths=torch.tensor([1, 1, 1, 1]))
    with pytest.raises(ValueError, match=r"feature 'g' \(table 'geo'\) has id 9, outside the valid range \[0, 8\]"):
        q(bad)
    with pytest.raises(ValueError, match=r"missing \['g'\]"):
        q(KeyedJaggedTensor(keys[:3], torch.tensor([0, 1, 2]), lengths=torch.tensor([1, 1, 1])))
    with pytest.raises(ValueError, match=r"unexpected \['x'\]"):
        q(KeyedJaggedTensor([*keys, "x"], torch.tensor([0, 1, 2, 3, 4]), lengths=torch.tensor([1] * 5)))
    # rows of another type never load as these; float weights never load as bytes
    other = quantize_embeddings(
        EmbeddingBagCollection(POOLED), torch.qint8, per_table_weight_dtype={"geo": torch.quint4x2}
    )
    with pytest.raises(ValueError, match=r"table 'geo' is stored as INT4 \[9 x 4\] in the state_dict but as INT8"):
        q.load_state_dict(other.state_dict())
    state = {**q.state_dict(), "embedding_bags.geo.weight": torch.zeros(9, 16)}
    with pytest.raises(RuntimeError, match=r"embedding_bags.geo.weight: a quantized table holds its stored rows"):
        q.load_state_dict(state)
    with pytest.raises(TypeError, match="expects an unsharded lightning_rec EmbeddingBagCollection"):
        Q.EmbeddingBagCollection.from_float(EmbeddingCollection(SEQUENCE), dtype=torch.qint8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs the module's qconfig"):
        Q.EmbeddingBagCollection.from_float(EmbeddingBagCollection(POOLED))
