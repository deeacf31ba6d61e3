"""The row-wise CPU lookups (``kernel="auto"`` on CPU) against an independent reference: the stored rows read back
by hand from fbgemm's layout (fp16 scale and bias first, packed values), pooled with ``F.embedding_bag``; and
against fbgemm's inference kernel, which stays available as ``kernel="fbgemm"``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_rec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    quantize_embeddings,
)
from lightning_rec.quant.lookup import resolve

DTYPES = {"int8": torch.qint8, "int4": torch.quint4x2, "int2": torch.quint2x4, "fp16": torch.float16}
BITS = {"int8": 8, "int4": 4, "int2": 2}
# the default (compact) rows carry the trailer at every width; at alignment 16, int8 rows of dim 8 (12 -> 16 bytes)
# have no room for it and dequantize in torch
TABLES = [
    EmbeddingBagConfig(name="a", num_embeddings=50, embedding_dim=16, feature_names=["fa", "fa2"]),
    EmbeddingBagConfig(name="b.x", num_embeddings=70, embedding_dim=64, feature_names=["fb"], pooling="mean"),
    EmbeddingBagConfig(name="c", num_embeddings=20, embedding_dim=8, feature_names=["fc"]),
]
KEYS = ["fa", "fa2", "fb", "fc"]


def hand_values(rows: torch.Tensor, kind: str, dim: int) -> torch.Tensor:
    if kind == "fp16":
        return rows[:, : 2 * dim].contiguous().view(torch.float16).float()
    bits = BITS[kind]
    scale = rows[:, 0:2].contiguous().view(torch.float16).float()
    bias = rows[:, 2:4].contiguous().view(torch.float16).float()
    cols = [(rows[:, 4 + j * bits // 8].long() >> ((j * bits) % 8)) & ((1 << bits) - 1) for j in range(dim)]
    return torch.stack(cols, 1).float() * scale + bias


def _kjt(seed: int, batch: int = 6, weighted: bool = False) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    rows = {"fa": 50, "fa2": 50, "fb": 70, "fc": 20}
    lengths = torch.randint(0, 4, (len(KEYS) * batch,), generator=g)
    lengths[1] = 0
    per_key = lengths.view(len(KEYS), batch).sum(1).tolist()
    values = torch.cat([torch.randint(0, rows[k], (n,), generator=g) for k, n in zip(KEYS, per_key)])
    w = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor(KEYS, values, lengths=lengths, weights=w)


def _reference(q, kjt: KeyedJaggedTensor, kinds: dict[str, str]) -> torch.Tensor:
    jts, outs = kjt.to_dict(), []
    for t in TABLES:
        table = hand_values(q.state_dict()[f"embedding_bags.{t.name}.weight"], kinds[t.name], t.embedding_dim)
        for f in t.feature_names:
            jt = jts[f]
            psw = jt.weights() if q.is_weighted() else None
            out = F.embedding_bag(
                jt.values(), table, jt.offsets(), mode="sum", include_last_offset=True, per_sample_weights=psw
            )
            if t.pooling.name == "MEAN":
                out = out / jt.lengths().clamp(min=1).unsqueeze(1)
            outs.append(out)
    return torch.cat(outs, 1)


def test_auto_is_rowwise_on_cpu() -> None:
    assert resolve("auto", torch.device("cpu")) == "rowwise"
    assert resolve("fbgemm", torch.device("cpu")) == "fbgemm"


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("kind", list(DTYPES))
def test_pooled_rowwise_matches_hand_dequantized_rows_and_fbgemm(kind: str, weighted: bool) -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES, is_weighted=weighted)
    kjt = _kjt(1, weighted=weighted)
    q = quantize_embeddings(ebc, DTYPES[kind], inplace=False)
    want = _reference(q, kjt, dict.fromkeys(["a", "b.x", "c"], kind))
    torch.testing.assert_close(q(kjt).values(), want, atol=1e-5, rtol=1e-5)
    fb = quantize_embeddings(ebc, DTYPES[kind], inplace=False, kernel="fbgemm")
    torch.testing.assert_close(q(kjt).values(), fb(kjt).values(), atol=1e-5, rtol=1e-5)
    if kind in BITS:  # every table is read by the row-wise kernels, in place
        plan = q._lookup._plan
        assert plan is not None and [t.kind is not None for t in plan.tables] == [True, True, True]
        assert plan.tables[1].rows.data_ptr() == q.embedding_bags["b.x"].weight.data_ptr()
        assert (plan.flat is not None) == (kind == "int8")


def test_mixed_types_and_half_output() -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES)
    per_table = {"a": torch.quint4x2, "c": torch.float16}
    kinds = {"a": "int4", "b.x": "int8", "c": "fp16"}
    kjt = _kjt(2)
    q = quantize_embeddings(ebc, torch.qint8, inplace=False, per_table_weight_dtype=per_table)
    torch.testing.assert_close(q(kjt).values(), _reference(q, kjt, kinds), atol=1e-5, rtol=1e-5)
    half = quantize_embeddings(
        ebc, torch.qint8, inplace=False, per_table_weight_dtype=per_table, output_dtype=torch.float16
    )
    assert half(kjt).values().dtype == torch.float16
    torch.testing.assert_close(half(kjt).values().float(), q(kjt).values(), atol=2e-3, rtol=2e-3)


def test_rows_without_trailer_and_rows_replaced() -> None:
    """Rows from elsewhere (zero padding) get the trailer before the kernels read them; rows written after a
    lookup (load_state_dict copies, assign=True replaces) are read as written."""
    torch.manual_seed(0)
    kjt = _kjt(3)
    q1 = quantize_embeddings(EmbeddingBagCollection(TABLES), torch.qint8, inplace=False)
    q2 = quantize_embeddings(EmbeddingBagCollection(TABLES), torch.qint8, inplace=False)
    q2(kjt)  # a plan over q2's first rows
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in q1.state_dict().items()}
    bare = state["embedding_bags.b.x.weight"]
    bare[:, 4 + 64 :] = 0  # no trailer: what fbgemm's own quantizer or TorchRec writes
    q2.load_state_dict(state)
    torch.testing.assert_close(q2(kjt).values(), q1(kjt).values(), atol=0, rtol=0)
    q3 = quantize_embeddings(EmbeddingBagCollection(TABLES), torch.qint8, inplace=False)
    q3.load_state_dict(
        {k: v.clone() if torch.is_tensor(v) else v for k, v in q1.state_dict().items()}, assign=True
    )  # no longer one buffer
    torch.testing.assert_close(q3(kjt).values(), q1(kjt).values(), atol=0, rtol=0)
    assert q3._lookup._plan.flat is None


def test_empty_batch_and_no_ids() -> None:
    q = quantize_embeddings(EmbeddingBagCollection(TABLES), torch.qint8, inplace=False)
    empty = KeyedJaggedTensor(KEYS, torch.zeros(0, dtype=torch.long), lengths=torch.zeros(8, dtype=torch.long))
    assert torch.equal(q(empty).values(), torch.zeros(2, 16 * 2 + 64 + 8))


@pytest.mark.parametrize("kind", list(DTYPES))
def test_sequence_rowwise_matches_hand_dequantized_rows(kind: str) -> None:
    torch.manual_seed(0)
    tables = [
        EmbeddingConfig(name="s", num_embeddings=40, embedding_dim=16, feature_names=["x", "y"]),
        EmbeddingConfig(name="t", num_embeddings=30, embedding_dim=32, feature_names=["z"]),
    ]
    ec = EmbeddingCollection(tables)
    q = quantize_embeddings(ec, DTYPES[kind], inplace=False)
    kjt = KeyedJaggedTensor(
        ["x", "y", "z"], torch.tensor([1, 39, 0, 5, 29, 3, 3]), lengths=torch.tensor([2, 0, 1, 1, 2, 1])
    )
    out = q(kjt)
    for t in tables:
        table = hand_values(q.state_dict()[f"embeddings.{t.name}.weight"], kind, t.embedding_dim)
        for f in t.feature_names:
            torch.testing.assert_close(out[f].values(), table[kjt[f].values()], atol=1e-6, rtol=1e-6)
