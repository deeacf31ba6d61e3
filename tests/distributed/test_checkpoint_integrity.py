"""Verified checkpoints and all-or-nothing saves (issue 14, items 3 and 4), on 2 gloo processes.

- a flipped byte, a truncated or a missing shard file is a CheckpointError (an Exception) naming the file,
  the tensor and the rank, on every rank, before any wrong value is used;
- a save that fails on one rank raises on every rank within seconds, removes the partial directory and leaves
  the previous checkpoint as it was; a full disk says so with the path and the bytes needed.
"""

from __future__ import annotations

import errno
import os
import re
import time
from pathlib import Path

import pytest
import torch

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, ShardingPlan
from lightning_rec import checkpoint as ckpt
from lightning_rec.checkpoint import atomic
from lightning_rec.sharding import full_state_dict, row_wise, shard_modules, table_wise
from lightning_rec.testing import run_distributed

TABLES = [EmbeddingBagConfig(name="t", num_embeddings=40, embedding_dim=8, feature_names=["f"]),
          EmbeddingBagConfig(name="u", num_embeddings=10, embedding_dim=4, feature_names=["g"])]
PLAN = ShardingPlan({"": {"t": row_wise(), "u": table_wise(1)}})


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return shard_modules(EmbeddingBagCollection(TABLES), PLAN)


def _save_job(rank: int, ws: int, path: str) -> dict:
    model = _model()
    ckpt.save(path, model)
    return full_state_dict(model)  # collective


def _load_job(rank: int, ws: int, paths: list[str]) -> list[str]:
    out = []
    for path in paths:
        model = _model(seed=1)
        try:
            ckpt.load(path, model)
            out.append("loaded")
        except ckpt.CheckpointError as e:  # an Exception: `except Exception` sees it too
            out.append(f"{type(e).__name__}: {e}")
    return out


def _piece(path: Path, fqn: str):
    md = ckpt.directory.CheckedReader(path, 0).read_metadata()
    return next((idx, info) for idx, info in md.storage_data.items() if idx.fqn == fqn)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("ckpt") / "c"
    want = run_distributed(_save_job, 2, str(path), timeout_s=120)[0]
    return path, want


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_damage_is_named(saved, tmp_path) -> None:
    src, want = saved
    # flipped bytes inside the piece of table t held by rank 1
    flipped = _copy(src, tmp_path / "flipped")
    idx, info = _piece(flipped, "state_dict.embedding_bags.t.weight")
    with open(flipped / info.relative_path, "r+b") as f:
        f.seek(info.offset + info.length - 200)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    # a truncated file and a missing file
    truncated = _copy(src, tmp_path / "truncated")
    _, tinfo = _piece(truncated, "state_dict.embedding_bags.u.weight")
    size = (truncated / tinfo.relative_path).stat().st_size
    os.truncate(truncated / tinfo.relative_path, size - 100)
    missing = _copy(src, tmp_path / "missing")
    (missing / tinfo.relative_path).unlink()
    cases = ((flipped, rf"{info.relative_path} is damaged: tensor 'state_dict\.embedding_bags\.t\.weight'.*CRC-32"
                       r".*rank \d"),
             (truncated, rf"{tinfo.relative_path} is truncated: tensor 'state_dict\.embedding_bags\.u\.weight'"
                         r".*rank \d"),
             (missing, rf"FileNotFoundError.*{tinfo.relative_path}"),
             (src, "^loaded$"))  # the undamaged directory loads (its checksums are checked on the same path)
    results = run_distributed(_load_job, 2, [str(p) for p, _ in cases], timeout_s=120)
    for r in results:  # every rank raises, whichever rank reads the bad piece
        for (path, pattern), got in zip(cases, r):
            assert re.search(pattern, got), (path.name, got)
            assert path == src or got.startswith("CheckpointError"), got


def _failing_save_job(rank: int, ws: int, path: str, how: str) -> dict:
    import torch.distributed.checkpoint.filesystem as fs

    model = _model()
    ckpt.save(path, model)  # the previous checkpoint
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    if how == "enospc" and rank == 1:
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        fs._write_files_from_queue = full
    if how == "error" and rank == 1:
        def broken(*args, **kwargs):
            raise RuntimeError("disk controller on fire")

        fs._write_files_from_queue = broken
    if how == "rename" and rank == 0:
        def no_rename(tmp, dst):
            raise PermissionError(f"cannot rename {tmp}")

        atomic.swap_in = no_rename
    start = time.monotonic()
    try:
        ckpt.save(path, model)
        out = "saved"
    except ckpt.CheckpointError as e:
        out = f"{type(e).__name__}: {e}"
        if isinstance(e, ckpt.DiskFullError):
            out += f" | bytes={e.bytes_needed} rank={e.rank}"
    except Exception as e:  # noqa: BLE001
        out = f"{type(e).__name__}: {e}"
    return {"out": out, "seconds": time.monotonic() - start}


@pytest.mark.parametrize("how", ["enospc", "error", "rename"])
def test_failed_save_stops_every_rank_and_keeps_previous(tmp_path, how: str) -> None:
    path = tmp_path / "c"
    # a long group timeout: a rank left waiting would show as a slow test, not as a fast failure
    results = run_distributed(_failing_save_job, 2, str(path), how, timeout_s=300)
    for r in results:
        assert r["seconds"] < 20, r
        assert r["out"] != "saved", r
    if how == "enospc":
        for r in results:
            assert r["out"].startswith("DiskFullError") and "no space left on the device of" in r["out"], r
            assert ".c.partial" in r["out"] and "rank=1" in r["out"], r
            assert int(r["out"].split("bytes=")[1].split()[0]) >= 20 * 8 * 4, r  # rank 1's rows of t at least
    elif how == "error":
        assert all("disk controller on fire" in r["out"] and "rank" in r["out"] for r in results), results
    else:
        assert all("cannot rename" in r["out"] for r in results), results
    assert not (tmp_path / ".c.partial").exists(), "the partial directory was left behind"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    # the previous checkpoint is intact: it is the first save's state
    model = EmbeddingBagCollection(TABLES)
    ckpt.load(path, model)
    torch.manual_seed(0)
    want = EmbeddingBagCollection(TABLES).state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k
