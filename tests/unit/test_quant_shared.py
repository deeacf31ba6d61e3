"""Quantized tables shared by serving processes: ``save_quantized`` writes one file, ``load_quantized_tables`` maps it
read-only; the same outputs as the model it came from, one copy of the pages for every process, writes refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


_CHILD = """
import json, sys, torch
from tests.unit.test_quant_shared import Model, _kjt
from lightning_rec.quant.shared import load_quantized_tables
path = sys.argv[1]
m = load_quantized_tables(path, Model(rows=20000))
with torch.no_grad():
    out = m(_kjt())
sums = {n: int(t.weight.sum()) for n, t in m.sparse.embedding_bags.named_children()}  # reads every page
entry, lines = {}, open("/proc/self/smaps").read().splitlines()
for i, line in enumerate(lines):
    if line.endswith(path):
        entry["perms"] = line.split()[1]
        for more in lines[i + 1 :]:
            k, _, v = more.partition(":")
            if " " in k:  # the next mapping's first line
                break
            if v.strip().endswith("kB"):
                entry[k] = int(v.split()[0]) * 1024
print(json.dumps({"out": out.flatten().tolist(), "sums": sums, "map": entry}))
sys.stdout.flush()
sys.stdin.read()  # hold the mapping until the parent has looked
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/smaps")
def test_two_processes_share_one_read_only_copy(tmp_path: Path) -> None:
    torch.manual_seed(0)
    q = quantize_embeddings(Model(rows=20000), torch.qint8)
    path = str(save_quantized(q, tmp_path / "model.lrq").resolve())
    table_bytes = q.sparse.storage_bytes()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs: list[subprocess.Popen] = []
    try:
        got = []
        for _ in range(2):  # the second starts once the first holds the mapping, every page read
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _CHILD, path],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    cwd=ROOT,
                    env=env,
                )
            )
            got.append(json.loads(procs[-1].stdout.readline()))
        with torch.no_grad():
            want = q(_kjt()).flatten().tolist()
        for g in got:
            assert g["out"] == pytest.approx(want, abs=0) and g["sums"] == got[0]["sums"]
            m = g["map"]
            assert m["perms"] == "r--s", m  # read-only, shared
            assert m["Rss"] >= table_bytes * 0.9, m  # every page read...
            assert m["Anonymous"] == 0, m  # ...none copied (a private mapping copies the pages written)
        # the pages the second process read are the first one's: shared, not its own
        second = got[1]["map"]
        assert second["Shared_Clean"] + second["Shared_Dirty"] >= table_bytes * 0.9, second
        assert second["Private_Clean"] + second["Private_Dirty"] < table_bytes * 0.1, second
    finally:
        for p in procs:
            p.communicate("", timeout=60)
