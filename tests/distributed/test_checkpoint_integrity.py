"""Verified checkpoints and all-or-nothing saves (issue 14, items 3 and 4), on 2 gloo processes.

- a flipped byte, a truncated or a missing shard file is a CheckpointError (an Exception) naming the file,
  the tensor and the rank, on every rank, before any wrong value is used;
- a save that fails on one rank raises on every rank (not at the group's timeout), removes the partial directory and leaves
  the previous checkpoint as it was; a full disk says so with the path and the bytes needed.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import pytest
import torch

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, ShardingPlan
from lightning_rec import checkpoint as ckpt
from lightning_rec.checkpoint import atomic
from lightning_rec.sharding import row_wise, shard_modules, table_wise
from lightning_rec.testing import run_distributed

TABLES = [
    EmbeddingBagConfig(name="t", num_embeddings=40, embedding_dim=8, feature_names=["f"]),
    EmbeddingBagConfig(name="u", num_embeddings=10, embedding_dim=4, feature_names=["g"]),
]
PLAN = ShardingPlan({"": {"t": row_wise(), "u": table_wise(1)}})


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return shard_modules(EmbeddingBagCollection(TABLES), PLAN)


def _load(path: str) -> str:
    model = _model(seed=1)
    try:
        ckpt.load(path, model)
    except ckpt.CheckpointError as e:  # an Exception: `except Exception` sees it too
        return f"{type(e).__name__}: {e}"
    return "loaded"


def _piece(path: Path, fqn: str):
    md = ckpt.directory.CheckedReader(path, 0).read_metadata()
    return next((idx, info) for idx, info in md.storage_data.items() if idx.fqn == fqn)


def _damage(root: Path) -> dict[str, str]:
    """Three damaged copies of ``root / "c"``; returns the damaged file of each."""
    import shutil

    src = root / "c"
    flipped, truncated, missing = (shutil.copytree(src, root / n) for n in ("flipped", "truncated", "missing"))
    _, info = _piece(flipped, "state_dict.embedding_bags.t.weight")  # a flipped byte in table t's piece
    with open(flipped / info.relative_path, "r+b") as f:
        f.seek(info.offset + info.length - 200)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    _, tinfo = _piece(truncated, "state_dict.embedding_bags.u.weight")
    os.truncate(truncated / tinfo.relative_path, (truncated / tinfo.relative_path).stat().st_size - 100)
    (missing / tinfo.relative_path).unlink()
    return {"flipped": info.relative_path, "truncated": tinfo.relative_path, "missing": tinfo.relative_path}


def _integrity_job(rank: int, ws: int, root: str) -> dict:
    """Save, damage copies (rank 0), load each on every rank; then the failing saves. One spawn for the file."""
    model = _model()
    ckpt.save(Path(root) / "c", model)
    files = _damage(Path(root)) if rank == 0 else None
    obj = [files]
    torch.distributed.broadcast_object_list(obj, src=0)
    out = {"files": obj[0], "loads": {n: _load(str(Path(root) / n)) for n in ("flipped", "truncated", "missing", "c")}}
    for how in ("enospc", "short_write", "meta_full", "metadata_full", "error", "optimizer", "rename"):
        out[how] = _failing_save(rank, str(Path(root) / how / "c"), how)
    out["export"] = _failing_export(rank, str(Path(root) / "export" / "model.pt"))
    return out


class _FullDisk:
    """A file whose writes fail as on a full disk."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def seek(self, *a):
        return self.handle.seek(*a)

    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self):
        self.handle.close()


def _failing_export(rank: int, path: str) -> dict:
    from lightning_rec import export

    original = export._skeleton
    if rank == 0:
        export._skeleton = lambda *a: (lambda h, off: (_FullDisk(h), off))(*original(*a))
    try:
        export.export_state_dict(_model(), path)
        out = "exported"
    except ckpt.CheckpointError as e:
        out = f"{type(e).__name__}: {e}"
    export._skeleton = original
    return {"out": out}


def test_failed_export_stops_every_rank_and_leaves_no_file(results) -> None:
    root, res = results
    out = [r["export"] for r in res]
    assert out[0]["out"].startswith("DiskFullError") and ".model.pt.partial" in out[0]["out"], out
    assert out[1]["out"].startswith("DiskFullError") and "rank 0" in out[1]["out"], out  # every rank alike
    assert sorted(p.name for p in (root / "export").iterdir()) == []


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("integrity")
    # every rank's error must name the failing rank's cause; a rank left waiting would end at the group's
    # timeout with a timeout message instead, so the messages catch it without a wall-clock bound
    return root, run_distributed(_integrity_job, 2, str(root), timeout_s=300)


def test_damage_is_named(results) -> None:
    _, res = results
    files = res[0]["files"]
    patterns = {
        "flipped": rf"{files['flipped']} is damaged: tensor 'state_dict\.embedding_bags\.t\.weight'.*CRC-32.*rank \d",
        "truncated": rf"{files['truncated']} is truncated: tensor 'state_dict\.embedding_bags\.u\.weight'.*rank \d",
        "missing": rf"FileNotFoundError.*{files['missing']}",
        "c": "^loaded$",  # the undamaged directory loads (its checksums are checked on the same path)
    }
    for r in res:  # every rank raises, whichever rank reads the bad piece
        for name, pattern in patterns.items():
            got = r["loads"][name]
            assert re.search(pattern, got), (name, got)
            assert name == "c" or got.startswith("CheckpointError"), got


def _failing_save(rank: int, path: str, how: str) -> dict:
    import torch.distributed.checkpoint.filesystem as fs

    original_write, original_swap = fs._write_files_from_queue, atomic.swap_in
    original_flatten = ckpt.optim_state._flatten
    original_meta, original_finish = ckpt.directory._write_file, fs.FileSystemWriter.finish
    original_free = ckpt.errors.free_bytes
    model = _model()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    ckpt.save(path, model, [opt])  # the previous checkpoint
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    if how == "enospc" and rank == 1:

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        fs._write_files_from_queue = full
    if how == "short_write" and rank == 1:  # torch's zip writer when the disk fills under it

        def short(*args, **kwargs):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

        fs._write_files_from_queue = short
        ckpt.errors.free_bytes = lambda path: 0  # the disk is full: no real one here
    if how == "meta_full" and rank == 0:

        def no_room(path, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        ckpt.directory._write_file = no_room
    if how == "metadata_full" and rank == 0:  # DCP's own .metadata, written by rank 0 after every piece

        def no_room_for_metadata(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        fs.FileSystemWriter.finish = no_room_for_metadata
    if how == "error" and rank == 1:

        def broken(*args, **kwargs):
            raise RuntimeError("disk controller on fire")

        fs._write_files_from_queue = broken
    if how == "optimizer" and rank == 1:

        def bad_state(*args, **kwargs):
            raise ValueError("optimizer state of an unexpected shape")

        ckpt.optim_state._flatten = bad_state
    if how == "rename" and rank == 0:

        def no_rename(tmp, dst):
            raise PermissionError(f"cannot rename {tmp}")

        atomic.swap_in = no_rename
    try:
        ckpt.save(path, model, [opt])
        out = "saved"
    except ckpt.CheckpointError as e:
        out = f"{type(e).__name__}: {e}"
        if isinstance(e, ckpt.DiskFullError):
            out += f" | bytes={e.bytes_needed} rank={e.rank}"
    except Exception as e:
        out = f"{type(e).__name__}: {e}"
    fs._write_files_from_queue, atomic.swap_in = original_write, original_swap
    ckpt.optim_state._flatten = original_flatten
    ckpt.directory._write_file, fs.FileSystemWriter.finish = original_meta, original_finish
    ckpt.errors.free_bytes = original_free
    return {"out": out}


@pytest.mark.parametrize("how", ["enospc", "short_write", "meta_full", "metadata_full", "error", "optimizer", "rename"])
def test_failed_save_stops_every_rank_and_keeps_previous(results, how: str) -> None:
    root, res = results
    tmp_path = root / how
    path = tmp_path / "c"
    results = [r[how] for r in res]
    for r in results:
        assert r["out"] != "saved", r
    if how == "enospc":
        for r in results:
            assert r["out"].startswith("DiskFullError") and "no space left on the device of" in r["out"], r
            assert ".c.partial" in r["out"] and "rank=1" in r["out"], r
            assert int(r["out"].split("bytes=")[1].split()[0]) >= 20 * 8 * 4, r  # rank 1's rows of t at least
    elif how in ("short_write", "meta_full", "metadata_full"):
        failing = 1 if how == "short_write" else 0
        for r in results:  # every rank: a DiskFullError naming the failing rank, what it needed and what was free
            assert r["out"].startswith("DiskFullError") and "no space left on the device of" in r["out"], r
            assert f"rank={failing}" in r["out"] and "bytes are free" in r["out"], r
        if how != "metadata_full":
            assert int(r["out"].split("bytes=")[1].split()[0]) > 0, r
    elif how == "error":
        assert all("disk controller on fire" in r["out"] and "rank" in r["out"] for r in results), results
    elif how == "optimizer":
        assert results[1]["out"].startswith("ValueError: optimizer state of an unexpected shape"), results
        assert results[0]["out"].startswith("CheckpointError") and "on rank 1" in results[0]["out"], results
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
