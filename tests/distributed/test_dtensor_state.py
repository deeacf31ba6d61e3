"""Sharded state as DTensors (issue 15, item 3), on gloo processes.

- every sharding type's ``state_dict()`` entry is a DTensor whose placements tell the truth where the tiling maps
  (``full_tensor()`` gives the unsharded table), local pieces with offsets otherwise, sharing the live storage;
- optimizer state in a checkpoint (fused element-wise and one-value-per-row) is DTensors laid out the same way;
- plain ``torch.distributed.checkpoint`` saves and loads them across plans, and lightning_rec checkpoints round
  trip from 4 processes to 2 and to 1 across plans (grid and table-row-wise included), weights and fused state exactly;
- nothing warns about ShardedTensor: the whole path runs with warnings as errors.
"""

from __future__ import annotations

import copy
import io
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, ShardingPlan, _compat
from lightning_rec import checkpoint as ckpt
from lightning_rec.export import export_state_dict
from lightning_rec.sharding import (
    column_wise,
    data_parallel,
    full_state_dict,
    fused_optimizer,
    grid_shard,
    row_wise,
    shard_modules,
    table_row_wise,
    table_wise,
)
from lightning_rec.testing import run_distributed
from tests.fbgemm_marks import FBGEMM

if FBGEMM:  # imported before the checks run: fbgemm warns about optional CUDA kernels on its first import
    import fbgemm_gpu.split_table_batched_embeddings_ops_training  # noqa: F401

DIMS = {
    "rw": (10, 4),
    "rw5": (5, 4),
    "rwc": (10, 4),
    "cw": (6, 8),
    "cwr": (6, 8),
    "tw": (5, 4),
    "twrw": (7, 4),
    "grid": (9, 8),
    "dp": (3, 4),
}
TABLES = [
    EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=[f"f_{n}"])
    for n, (r, d) in DIMS.items()
]
TWO = {
    "rw": row_wise(),
    "rw5": row_wise(),
    "rwc": row_wise([3, 7]),
    "cw": column_wise(ranks=[0, 1]),
    "cwr": column_wise(ranks=[1, 0]),
    "tw": table_wise(1),
    "twrw": table_row_wise(0),
    "grid": grid_shard([0]),
    "dp": data_parallel(),
}


def _model(seed: int = 0) -> EmbeddingBagCollection:
    torch.manual_seed(seed)
    return EmbeddingBagCollection(TABLES)


def _kjt(rank: int, tables: list[EmbeddingBagConfig] = TABLES) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(rank)
    keys = [t.feature_names[0] for t in tables]
    lengths = torch.randint(0, 3, (2 * len(keys),), generator=g)
    values = torch.cat(
        [
            torch.randint(0, t.num_embeddings, (int(n),), generator=g)
            for t, pair in zip(tables, lengths.view(-1, 2))
            for n in pair
        ]
    )
    return KeyedJaggedTensor(keys, values, lengths=lengths)


def _describe(v) -> dict:
    if not _compat.is_sharded(v):
        return {"kind": "tensor"}
    pieces = _compat.local_pieces(v)
    names = [f"Shard({p.dim})" if isinstance(p, Shard) else type(p).__name__ for p in v.placements]
    return {
        "kind": type(v).__name__,
        "placements": "local pieces" if _uses_pieces(v) else names,
        "mesh": v.device_mesh.mesh.tolist(),
        "pieces": [(off, list(t.shape)) for off, t in pieces],
        "size": list(v.size()),
        "dtype": _compat.sharded_dtype(v),
    }


def _layout_job(rank: int, ws: int, path: str) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a ShardedTensor (or any) warning anywhere below fails the test
        model = shard_modules(_model(), ShardingPlan({"": TWO}))
        sd = model.state_dict()
        params = dict(model.named_parameters())
        full = full_state_dict(model)
        truthful, shared = {}, {}
        for k, v in sd.items():
            if not _compat.is_sharded(v):
                continue
            shared[k] = all(t.data_ptr() == params[k].data_ptr() for _, t in _compat.local_pieces(v))
            if isinstance(v.placements[0], Shard) and not _uses_pieces(v):
                truthful[k] = torch.equal(v.full_tensor(), full[k])  # a collective over the shard group
            elif isinstance(v.placements[0], Replicate) and v.device_mesh.get_coordinate() is not None:
                truthful[k] = torch.equal(v.to_local(), full[k])
        refused = {}
        for k in ("rwc", "cwr"):  # local pieces: DTensor collectives refuse, on every rank (no hang, no abort)
            try:
                sd[f"embedding_bags.{k}.weight"].full_tensor()
                refused[k] = "gathered"
            except RuntimeError as e:
                refused[k] = str(e)
        # plain DCP, no lightning_rec code: save in this plan, load into another one
        dcp.save({"model": sd}, checkpoint_id=path)
        other = shard_modules(
            _model(seed=5),
            ShardingPlan({"": {**TWO, "rw": table_wise(0), "cw": row_wise(), "tw": column_wise(ranks=[0, 1])}}),
        )
        target = {"model": other.state_dict()}
        dcp.load(target, checkpoint_id=path)
        reloaded = full_state_dict(other)
        # fused optimizer state in a checkpoint: element-wise sums laid out like the table, row-wise ones per row
        small = [TABLES[0], TABLES[1], TABLES[5]]
        fused = shard_modules(
            EmbeddingBagCollection(small),
            ShardingPlan({"": {"rw": row_wise(), "rw5": row_wise([1, 4]), "tw": table_wise(0)}}),
            embedding_optimizer={"kind": "rowwise_adagrad", "lr": 0.1},
        )
        fused(_kjt(rank, small)).values().sum().backward()
        state = ckpt.optimizer_state(fused, fused_optimizer(fused))["tensors"]
        export_state_dict(model, path + ".pt")
        # half precision: every DTensor says float16 (torch's LocalShardsWrapper alone would say float32)
        half = shard_modules(_model(), ShardingPlan({"": TWO})).half()
        dtypes = {k: v.dtype for k, v in half.state_dict().items()}
    return {
        "dtypes": dtypes,
        "refused": refused,
        "described": {k: _describe(v) for k, v in sd.items()},
        "truthful": truthful,
        "shared": shared,
        "reloaded": all(torch.equal(reloaded[k], full[k]) for k in full),
        "state": {k: _describe(v) for k, v in state.items()},
        "full": full,
    }


def _uses_pieces(v) -> bool:
    return isinstance(v._local_tensor, LocalShardsWrapper)


def test_state_dict_is_dtensors_with_truthful_placements_and_dcp_reshards(tmp_path) -> None:
    path = str(tmp_path / "plain_dcp")
    results = run_distributed(_layout_job, 2, path)
    r0, r1 = results
    kinds = {k.split(".")[1]: v for k, v in r0["described"].items()}
    assert kinds["dp"] == {"kind": "tensor"}
    for k in ("rw", "rw5", "cw", "cwr", "rwc", "tw", "twrw", "grid"):
        assert kinds[k]["kind"] == "DTensor", k
    assert kinds["rw"]["placements"] == ["Shard(0)"] and kinds["rw"]["mesh"] == [0, 1]
    assert kinds["rw5"]["placements"] == ["Shard(0)"] and kinds["rw5"]["pieces"] == [([0, 0], [3, 4])]
    assert r1["described"]["embedding_bags.rw5.weight"]["pieces"] == [([3, 0], [2, 4])]
    assert kinds["cw"]["placements"] == ["Shard(1)"]
    assert kinds["twrw"]["placements"] == ["Shard(0)"]  # one host: the whole group
    assert kinds["grid"]["placements"] == ["Shard(0)"]  # one column block on one host
    assert kinds["tw"]["placements"] == ["Replicate"] and kinds["tw"]["mesh"] == [1] and kinds["tw"]["pieces"] == []
    assert r1["described"]["embedding_bags.tw.weight"]["pieces"] == [([0, 0], [5, 4])]
    # tilings DTensor placements cannot say: local pieces with their offsets
    assert all(kinds[k]["placements"] == "local pieces" for k in ("rwc", "cwr")), kinds
    assert kinds["rwc"]["pieces"] == [([0, 0], [3, 4])]
    assert r1["described"]["embedding_bags.rwc.weight"]["pieces"] == [([3, 0], [7, 4])]
    assert kinds["cwr"]["pieces"] == [([0, 4], [6, 4])]
    for r in results:
        for k, v in r["described"].items():
            if v["kind"] == "DTensor":
                assert v["size"] == list(DIMS[k.split(".")[1]]) and v["dtype"] == torch.float32
        assert r["shared"] and all(r["shared"].values()), r["shared"]
        assert all(r["truthful"].values()), r["truthful"]
        assert r["reloaded"]
    # placements checked against torch's own gather for every table that maps (the owner checks "tw")
    assert set(r0["truthful"]) == {f"embedding_bags.{k}.weight" for k in ("rw", "rw5", "cw", "twrw", "grid")}
    assert "embedding_bags.tw.weight" in r1["truthful"]
    s0, s1 = r0["state"], r1["state"]
    rows = "fused/embedding_bags.rw.weight/sum"
    assert s0[rows]["placements"] == ["Shard(0)"] and s0[rows]["size"] == [10, 1]
    assert s0[rows]["pieces"] == [([0, 0], [5, 1])] and s1[rows]["pieces"] == [([5, 0], [5, 1])]
    uneven = "fused/embedding_bags.rw5.weight/sum"
    assert s0[uneven]["pieces"] == [([0, 0], [1, 1])] and s1[uneven]["pieces"] == [([1, 0], [4, 1])]
    assert s0["fused/embedding_bags.tw.weight/sum"]["placements"] == ["Replicate"]
    for r in results:
        assert all("not supported" in e or "full_state_dict" in e for e in r["refused"].values()), r["refused"]
    assert all(d == torch.float16 for r in results for d in r["dtypes"].values()), r0["dtypes"]
    exported = torch.load(path + ".pt", weights_only=True)
    for k, v in r0["full"].items():
        assert torch.equal(exported[k], v), k


def _chunked_job(rank: int, ws: int, path: str) -> dict:
    model = shard_modules(_model(), ShardingPlan({"": TWO}))
    sd = model.state_dict()
    # state_dicts of DTensors still pickle and deep-copy (the record lightning_rec keeps on them is plain values)
    copied = copy.deepcopy(sd)
    torch.save(sd, io.BytesIO())
    same_copy = all(
        torch.equal(a, b)
        for k in sd
        if _compat.is_sharded(sd[k])
        for (_, a), (_, b) in zip(_compat.local_pieces(sd[k]), _compat.local_pieces(copied[k]))
    )
    old, ckpt.placement.CHUNK_BYTES = ckpt.placement.CHUNK_BYTES, 40  # pieces of at most 2 rows of 4 floats
    try:
        ckpt.save(path, model)
    finally:
        ckpt.placement.CHUNK_BYTES = old
    other = shard_modules(_model(seed=9), ShardingPlan({"": {**TWO, "rw": row_wise([7, 3]), "twrw": table_wise(0)}}))
    ckpt.load(path, other)
    want, got = full_state_dict(model), full_state_dict(other)
    return {"same_copy": same_copy, "loaded": all(torch.equal(want[k], got[k]) for k in want)}


def test_checkpoint_pieces_are_written_in_row_blocks_and_state_dicts_copy(tmp_path) -> None:
    path = tmp_path / "chunked"
    for r in run_distributed(_chunked_job, 2, str(path)):
        assert r["same_copy"] and r["loaded"]
    md = ckpt.storage.CheckedReader(path, 0).read_metadata().state_dict_metadata
    for k, v in md.items():
        if k.startswith("state_dict.") and "dp" not in k:
            pieces = [tuple(c.sizes) for c in v.chunks if c.sizes.numel()]
            assert len(pieces) > 1 and all(r * c * 4 <= 40 for r, c in pieces), (k, pieces)
            assert sum(c.sizes.numel() for c in v.chunks) == v.size.numel(), k


# -- lightning_rec checkpoints through DTensors: 4 -> 2 -> 1 processes, grid and table-row-wise -------------

FOUR = {
    "rw": row_wise([1, 2, 3, 4]),
    "rw5": row_wise(),
    "rwc": table_wise(3),
    "cw": column_wise(ranks=[2, 1]),
    "cwr": column_wise(ranks=[3, 0]),
    "tw": table_row_wise(1),
    "twrw": table_row_wise(0),
    "grid": grid_shard([1, 0]),
    "dp": data_parallel(),
}
SPEC = {"kind": "adagrad", "lr": 0.2}


def _full_fused(model) -> dict[str, torch.Tensor]:
    """The fused sums of every table, assembled over ranks from the local pieces."""
    places = ckpt.placement.placements(model)
    local = {}
    for name, st in fused_optimizer(model).state_dict()["tables"].items():
        place = places.get(f"embedding_bags.{name}.weight")  # None: a data-parallel table, whole everywhere
        local[name] = ([0, 0] if place is None else place.local_offsets, st["sum"].clone())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    out = {}
    for g in gathered:
        for name, ((r, c), v) in g.items():
            full = out.setdefault(name, torch.full(DIMS[name], float("nan")))
            full[r : r + v.shape[0], c : c + v.shape[1]] = v
    return out


def _save_job(rank: int, ws: int, plan: dict, path: str) -> dict:
    model = shard_modules(_model(), ShardingPlan({"": plan}), local_size=2, embedding_optimizer=SPEC)
    opt = fused_optimizer(model)
    for step in range(2):
        model(_kjt(10 * step + rank)).values().pow(2).sum().backward()
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.save(path, model, [opt])
    return {"weights": full_state_dict(model), "sums": _full_fused(model)}


def _load_job(rank: int, ws: int, plan: dict, path: str) -> dict:
    model = shard_modules(_model(seed=3), ShardingPlan({"": plan}), local_size=min(ws, 2), embedding_optimizer=SPEC)
    opt = fused_optimizer(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.load(path, model, [opt])
    return {"weights": full_state_dict(model), "sums": _full_fused(model)}


def test_checkpoints_reshard_four_to_two_and_one(tmp_path) -> None:
    path = str(tmp_path / "at4")
    want = run_distributed(_save_job, 4, FOUR, path, timeout_s=240)[0]
    assert all(not v.isnan().any() and v.abs().sum() > 0 for v in want["sums"].values()) and len(want["sums"]) == 9
    at2 = run_distributed(_load_job, 2, TWO, path)
    (at1,) = run_distributed(_load_job, 1, {k: table_wise(0) for k in TWO if k != "dp"} | {"dp": data_parallel()}, path)
    for got in [*at2, at1]:
        for k, v in want["weights"].items():
            assert torch.equal(got["weights"][k], v), k
        for k, v in want["sums"].items():
            assert torch.equal(got["sums"][k], v), k
