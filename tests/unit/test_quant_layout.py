"""The default row layout: compact (fbgemm's row, the serving trailer, 4-byte padding) and read in place by every
kernel, against the rows read back by hand; rows of the previous default (16-byte alignment) still load and map."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
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
from lightning_rec.configs import DataType
from lightning_rec.quant.mapped import MappedRows
from lightning_rec.quant.shared import load_quantized_tables, read_header, save_quantized

DTYPES = {"int8": torch.qint8, "int4": torch.quint4x2, "int2": torch.quint2x4, "fp16": torch.float16}
BITS = {"int8": 8, "int4": 4, "int2": 2}
DIMS = [4, 16, 24, 64, 100, 128]
TABLES = [EmbeddingBagConfig(name=f"t{d}", num_embeddings=37, embedding_dim=d, feature_names=[f"f{d}"]) for d in DIMS]
KEYS = [f"f{d}" for d in DIMS]


def hand_values(rows: torch.Tensor, kind: str, dim: int) -> torch.Tensor:
    if kind == "fp16":
        return rows[:, : 2 * dim].contiguous().view(torch.float16).float()
    bits = BITS[kind]
    scale = rows[:, 0:2].contiguous().view(torch.float16).float()
    bias = rows[:, 2:4].contiguous().view(torch.float16).float()
    cols = [(rows[:, 4 + j * bits // 8].long() >> ((j * bits) % 8)) & ((1 << bits) - 1) for j in range(dim)]
    return torch.stack(cols, 1).float() * scale + bias


def _kjt(seed: int, batch: int = 5) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(KEYS) * batch,), generator=g)
    lengths[0] = 0
    values = torch.randint(0, 37, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor(KEYS, values, lengths=lengths)


def _reference(rows: dict[str, torch.Tensor], kind: str, kjt: KeyedJaggedTensor) -> torch.Tensor:
    jts = kjt.to_dict()
    outs = []
    for t in TABLES:
        jt = jts[t.feature_names[0]]
        table = hand_values(rows[t.name], kind, t.embedding_dim)
        outs.append(F.embedding_bag(jt.values(), table, jt.offsets(), mode="sum", include_last_offset=True))
    return torch.cat(outs, 1)


def _rows(q: nn.Module) -> dict[str, torch.Tensor]:
    return {t.name: q.state_dict()[f"embedding_bags.{t.name}.weight"] for t in TABLES}


def test_bytes_at_dim_64_meet_the_targets() -> None:
    fp32 = 4 * 64
    assert Q.DEFAULT_ROW_ALIGNMENT is None
    assert Q.row_bytes(64, DataType.INT8) == 64 + 4 + 8 and Q.row_bytes(64, DataType.INT8) / fp32 <= 0.3
    assert Q.row_bytes(64, DataType.INT4) == 32 + 4 + 4 and Q.row_bytes(64, DataType.INT4) / fp32 <= 0.17
    assert Q.row_bytes(64, DataType.INT2) == 16 + 4 + 4
    q = quantize_embeddings(EmbeddingBagCollection(TABLES[3:4]), torch.qint8, inplace=False)
    assert q.storage_bytes() == 37 * 76


@pytest.mark.parametrize("kind", list(DTYPES))
def test_every_kernel_reads_the_compact_rows(kind: str) -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES)
    kjt = _kjt(1)
    q = quantize_embeddings(ebc, DTYPES[kind], inplace=False)
    rows = _rows(q)
    for t in TABLES:
        assert rows[t.name].shape == (37, Q.row_bytes(t.embedding_dim, DataType[kind.upper()]))
    want = _reference(rows, kind, kjt)
    torch.testing.assert_close(q(kjt).values(), want, atol=1e-5, rtol=1e-5)
    plan = q._lookup._plan
    # the row-wise kernels read every integer table in place, at every width (INT8: fbgemm's forward, in one call)
    assert [tab.kind is not None for tab in plan.tables] == [kind in BITS] * len(TABLES)
    assert all(tab.rows.data_ptr() == rows[t.name].data_ptr() for tab, t in zip(plan.tables, TABLES))
    assert (plan.flat is not None) == (kind == "int8")
    torch_q = quantize_embeddings(ebc, DTYPES[kind], inplace=False, kernel="torch")
    torch.testing.assert_close(torch_q(kjt).values(), want, atol=1e-5, rtol=1e-5)
    fb = quantize_embeddings(ebc, DTYPES[kind], inplace=False, kernel="fbgemm")
    torch.testing.assert_close(fb(kjt).values(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", list(DTYPES))
def test_fbgemm_inference_kernel_reads_the_compact_rows_themselves(kind: str) -> None:
    """fbgemm's CPU kernel reads rows of any stride: built with row_alignment = the compact row's bytes, its own
    buffer has the compact shape, and the compact rows copied in (trailer and all) read as the hand reference."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

    torch.manual_seed(0)
    q = quantize_embeddings(EmbeddingBagCollection(TABLES), DTYPES[kind], inplace=False)
    rows = _rows(q)
    kjt = _kjt(2)
    jts = kjt.to_dict()
    for t in TABLES:
        r = rows[t.name]
        m = IntNBitTableBatchedEmbeddingBagsCodegen(
            [(t.name, 37, t.embedding_dim, SparseType[kind.upper()], EmbeddingLocation.HOST)],
            device="cpu",
            output_dtype=SparseType.FP32,
            row_alignment=r.size(1),
        )
        m.initialize_weights()
        view = m.split_embedding_weights(split_scale_shifts=False)[0][0]
        assert view.shape == r.shape
        view.copy_(r)
        jt = jts[t.feature_names[0]]
        got = m(jt.values().int(), jt.offsets().int())
        want = F.embedding_bag(
            jt.values(), hand_values(r, kind, t.embedding_dim), jt.offsets(), mode="sum", include_last_offset=True
        )
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "int4", "int2"])
def test_sequence_lookups_read_the_compact_rows(kind: str) -> None:
    torch.manual_seed(0)
    tables = [EmbeddingConfig(name=f"s{d}", num_embeddings=29, embedding_dim=d, feature_names=[f"x{d}"]) for d in DIMS]
    q = quantize_embeddings(EmbeddingCollection(tables), DTYPES[kind], inplace=False)
    ids = torch.tensor([0, 28, 5, 5])
    kjt = KeyedJaggedTensor([f"x{d}" for d in DIMS], ids.repeat(len(DIMS)), lengths=torch.tensor([2, 2] * len(DIMS)))
    out = q(kjt)
    for t in tables:
        table = hand_values(q.state_dict()[f"embeddings.{t.name}.weight"], kind, t.embedding_dim)
        torch.testing.assert_close(out[t.feature_names[0]].values(), table[ids], atol=1e-6, rtol=1e-6)
    assert all(tab.kind is not None for tab in q._lookup._plan.tables)


@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
@pytest.mark.parametrize("kind", ["int8", "int4", "fp16"])
def test_a_state_dict_of_the_previous_default_loads_converted(kind: str, assign: bool) -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES)
    kjt = _kjt(3)
    old = quantize_embeddings(ebc, DTYPES[kind], inplace=False, row_alignment=16)
    state = old.state_dict()
    assert state["_extra_state"]["row_alignment"] == 16
    q = quantize_embeddings(EmbeddingBagCollection(TABLES), DTYPES[kind], inplace=False)
    q.load_state_dict(state, assign=assign)
    rows = _rows(q)
    for t in TABLES:  # the model keeps its compact rows: the bytes every kernel reads are copied across
        assert rows[t.name].shape == (37, Q.row_bytes(t.embedding_dim, DataType[kind.upper()]))
        n = Q.row_bytes(t.embedding_dim, DataType[kind.upper()], 1)
        assert torch.equal(rows[t.name][:, :n], state[f"embedding_bags.{t.name}.weight"][:, :n])
    torch.testing.assert_close(q(kjt).values(), old(kjt).values(), atol=1e-5, rtol=1e-5)
    if kind in BITS:
        assert all(tab.kind is not None for tab in q._lookup._plan.tables)
    # and back: compact rows into a model of the previous layout
    back = quantize_embeddings(EmbeddingBagCollection(TABLES), DTYPES[kind], inplace=False, row_alignment=16)
    back.load_state_dict(q.state_dict())
    torch.testing.assert_close(back(kjt).values(), old(kjt).values(), atol=1e-5, rtol=1e-5)


def test_rows_too_short_to_convert_are_refused_naming_the_table() -> None:
    q = quantize_embeddings(EmbeddingBagCollection(TABLES), torch.qint8, inplace=False)
    state = dict(q.state_dict())
    state["embedding_bags.t64.weight"] = state["embedding_bags.t64.weight"][:, :60].clone()
    with pytest.raises(RuntimeError, match=r"table 't64'.*needs 68 bytes"):
        q.load_state_dict(state)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sparse = EmbeddingBagCollection(TABLES)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.sparse(kjt).values()


def test_a_file_of_the_previous_default_still_maps(tmp_path: Path) -> None:
    torch.manual_seed(0)
    old = quantize_embeddings(Model(), torch.qint8, row_alignment=16)
    path = save_quantized(old, tmp_path / "old.lrq")
    assert read_header(path)["collections"][0]["tables"][3]["row_bytes"] == 80
    with torch.device("meta"):
        skeleton = Model()
    loaded = load_quantized_tables(path, skeleton)
    assert loaded.sparse.row_alignment == 16  # the layout the file records wins
    assert isinstance(loaded.sparse.embedding_bags["t64"].weight, MappedRows)
    kjt = _kjt(4)
    with torch.no_grad():
        torch.testing.assert_close(loaded(kjt), old(kjt), atol=1e-5, rtol=1e-5)
    compact = quantize_embeddings(Model(), torch.qint8)
    with pytest.raises(ValueError, match=r"row_alignment=16.*row_alignment=None"):
        load_quantized_tables(path, compact)


def test_save_writes_compact_rows_from_fbgemm_buffers(tmp_path: Path) -> None:
    torch.manual_seed(0)
    q = quantize_embeddings(Model(), torch.qint8, kernel="fbgemm")
    assert q.sparse.embedding_bags["t64"].weight.shape == (37, 68)  # fbgemm's CPU buffer: 4-byte alignment
    path = save_quantized(q, tmp_path / "m.lrq")
    header = read_header(path)
    assert [t["row_bytes"] for t in header["collections"][0]["tables"]] == [Q.row_bytes(d, DataType.INT8) for d in DIMS]
    assert json.loads(json.dumps(header))["collections"][0]["row_alignment"] is None
    with torch.device("meta"):
        skeleton = Model()
    loaded = load_quantized_tables(path, skeleton)
    kjt = _kjt(5)
    with torch.no_grad():
        torch.testing.assert_close(loaded(kjt), q(kjt), atol=1e-5, rtol=1e-5)
    assert all(tab.kind is not None for tab in loaded.sparse._lookup._plan.tables)
