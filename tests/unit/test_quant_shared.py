"""Quantized tables shared by serving processes: ``save_quantized`` writes one file, ``load_quantized_tables`` maps it
read-only; the same outputs as the model it came from, one copy of the pages for every process, writes refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_rec import EmbeddingBagCollection as FloatEBC
from lightning_rec import EmbeddingBagConfig, KeyedJaggedTensor, quantize_embeddings
from lightning_rec.quant import EmbeddingBagCollection
from lightning_rec.quant.mapped import MappedRows
from lightning_rec.quant.shared import load_quantized_tables, save_quantized

ROOT = Path(__file__).resolve().parents[2]


class Model(nn.Module):
    def __init__(self, rows: int = 300, device: str | None = None) -> None:
        super().__init__()
        tables = [
            EmbeddingBagConfig(name="user", num_embeddings=rows, embedding_dim=64, feature_names=["u"]),
            EmbeddingBagConfig(name="item.id", num_embeddings=rows, embedding_dim=32, feature_names=["i"]),
        ]
        self.sparse = FloatEBC(tables, device=device)
        self.head = nn.Linear(96, 1, device=device)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.head(self.sparse(kjt).values())


def _kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor(["u", "i"], torch.tensor([1, 299, 7, 0, 5, 5]), lengths=torch.tensor([2, 1, 0, 3]))


def _saved(tmp_path: Path, per_table: dict | None = None) -> tuple[nn.Module, Path]:
    torch.manual_seed(0)
    q = quantize_embeddings(Model(), torch.qint8, per_table_weight_dtype=per_table)
    return q, save_quantized(q, tmp_path / "model.lrq")


@pytest.mark.parametrize("mmap", [True, False], ids=["mapped", "private"])
def test_round_trip_into_a_meta_model(tmp_path: Path, mmap: bool) -> None:
    q, path = _saved(tmp_path, {"item.id": torch.quint4x2})
    with torch.device("meta"):
        skeleton = Model()
    loaded = load_quantized_tables(path, skeleton, mmap=mmap)
    assert isinstance(loaded.sparse, EmbeddingBagCollection) and not loaded.training
    assert loaded.sparse.storage_types() == q.sparse.storage_types()
    assert isinstance(loaded.sparse.embedding_bags["user"].weight, MappedRows) == mmap
    with torch.no_grad():
        assert torch.equal(loaded(_kjt()), q(_kjt()))
    for k, v in q.state_dict().items():
        if torch.is_tensor(v):
            assert torch.equal(loaded.state_dict()[k], v), k
    # into a model quantized already (its own random rows replaced)
    again = load_quantized_tables(
        path, quantize_embeddings(Model(), torch.qint8, per_table_weight_dtype={"item.id": "int4"})
    )
    with torch.no_grad():
        assert torch.equal(again(_kjt()), q(_kjt()))


def test_writes_into_mapped_tables_raise(tmp_path: Path) -> None:
    q, path = _saved(tmp_path)
    loaded = load_quantized_tables(path, Model())
    w = loaded.sparse.embedding_bags["user"].weight
    for write in (lambda: w.add_(1), lambda: w[0].copy_(w[1]), lambda: w.__setitem__((0, 5), 3), lambda: w.zero_()):
        with pytest.raises(RuntimeError, match=r"table 'user' is mapped read-only from .*model.lrq"):
            write()
    with pytest.raises(RuntimeError, match=r"table 'user' is mapped read-only"):
        loaded.load_state_dict(q.state_dict())
    with torch.no_grad():
        assert torch.equal(loaded(_kjt()), q(_kjt()))  # unchanged
    private = load_quantized_tables(path, Model(), mmap=False)
    private.sparse.embedding_bags["user"].weight.add_(0)  # a private copy is writable


def test_bad_files_name_the_file_and_table(tmp_path: Path) -> None:
    _, path = _saved(tmp_path)
    with pytest.raises(FileNotFoundError, match="no quantized tables file at .*missing.lrq"):
        load_quantized_tables(tmp_path / "missing.lrq", Model())
    junk = tmp_path / "junk.lrq"
    junk.write_bytes(b"not a table file at all")
    with pytest.raises(ValueError, match=r"junk.lrq is not a quantized tables file"):
        load_quantized_tables(junk, Model())
    cut = tmp_path / "cut.lrq"
    cut.write_bytes(path.read_bytes()[: 4096 * 7 + 100])  # the header, user (24,000 bytes), a bit of item.id
    with pytest.raises(ValueError, match=r"cut.lrq is truncated: .*tables \['item.id'\]"):
        load_quantized_tables(cut, Model())
    with pytest.raises(ValueError, match=r"table 'user' is \[300 x 64\] in the file but \[301, 64\] in the model"):
        load_quantized_tables(path, Model(rows=301))
    with pytest.raises(ValueError, match="kernel='fbgemm' copies them"):
        load_quantized_tables(path, Model(), kernel="fbgemm")
