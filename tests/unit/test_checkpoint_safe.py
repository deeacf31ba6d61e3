"""Checkpoint building blocks without processes: the allowlisted unpicklers and the row-wise state forms."""

from __future__ import annotations

import argparse
import io
import os
import pickle
from pathlib import Path

import pytest
import torch

from lightning_rec import EmbeddingBagConfig
from lightning_rec.checkpoint import CheckpointError, UnsafeCheckpointError, read_meta
from lightning_rec.checkpoint.optim_state import _column_weights, _restore
from lightning_rec.checkpoint.safe import load_dcp_metadata, load_meta
from lightning_rec.checkpoint.storage import crc32_range

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "v1_checkpoint"


class _Evil:
    def __reduce__(self):
        return os.system, ("echo pwned",)


def test_dcp_metadata_allowlist(tmp_path) -> None:
    md = load_dcp_metadata(FIXTURE / ".metadata")  # DCP's own classes, torch.Size, dtypes, paths: accepted
    assert "state_dict.ebc.embedding_bags.user.weight" in md.state_dict_metadata
    md.planner_data = _Evil()
    bad = tmp_path / ".metadata"
    bad.write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeCheckpointError, match=r"refers to the Python global 'posix\.system'") as e:
        load_dcp_metadata(bad)
    assert e.value.path == str(bad)
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(CheckpointError, match="cannot read the checkpoint metadata"):
        load_dcp_metadata(garbage)


def test_meta_allowlist(tmp_path) -> None:
    meta = read_meta(FIXTURE)
    assert meta["format"] == "lightning_rec.dcp/1"
    ok = tmp_path / "ok.pt"
    tables = [EmbeddingBagConfig(name="t", num_embeddings=3, embedding_dim=4, feature_names=["f"], pooling="mean")]
    hp = {"lr": 0.1, "root": Path("/data"), "args": argparse.Namespace(a=1), "dtype": torch.bfloat16, "tables": tables}
    torch.save({"hyper_parameters": hp, "x": torch.ones(2)}, ok)
    assert load_meta(ok)["hyper_parameters"] == hp
    bad = tmp_path / "bad.pt"
    torch.save({"hyper_parameters": {"x": _Evil()}}, bad)
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system.*trusted=True"):
        load_meta(bad)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(ok.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated.pt"):
        load_meta(truncated)


def test_rowwise_state_forms() -> None:
    rows = torch.tensor([[1.0, 3.0], [2.0, 6.0]])  # two column pieces of a 8-wide table: [0, 4) and [4, 8)
    assert _column_weights([0, 4], 8, None).tolist() == [4.0, 4.0]
    assert torch.equal(_restore(("rows", rows, torch.tensor([0.0, 4.0]))), rows[:, 1])  # own piece: bitwise
    merged = _restore(("rows", rows, torch.tensor([4.0, 4.0])))  # a whole-row shard: the width-weighted mean
    assert torch.equal(merged, torch.tensor([2.0, 4.0]))
    spread = torch.tensor([[0.1] * 4, [1.0, 1.0, 3.0, 3.0]])  # the v1 form: broadcast over columns
    assert torch.equal(_restore(("rowwise", spread)), torch.tensor([0.1, 2.0]))


def test_crc32_range_reads_in_blocks() -> None:
    import zlib

    data = os.urandom(10_000)
    assert crc32_range(io.BytesIO(data), 100, 5000) == zlib.crc32(data[100:5100])
