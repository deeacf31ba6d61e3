"""Named cases users hit in TorchRec, plus state_dict, checkpoint and bad-input behaviour of sharded modules."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, _compat
from lightning_rec.sharding import (
    ShardingPlan,
    column_wise,
    data_parallel,
    full_state_dict,
    grid_shard,
    row_wise,
    shard_modules,
    table_row_wise,
    table_wise,
)
from lightning_rec.testing import run_distributed


def _zero(w: torch.Tensor) -> None:
    w.zero_()


# -- (a) row-wise gradients are not divided by the world size -------------------------------------------
# the CUDA variants share one GPU between 2 ranks over gloo (NCCL refuses two ranks on one GPU)
_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
_DEVICES = ["cpu", pytest.param("cuda", marks=_CUDA)]


def _rowwise_grad_job(rank: int, ws: int, mode: str, device: str = "cpu") -> list[float]:
    t = EmbeddingBagConfig(name="t", num_embeddings=8, embedding_dim=4, feature_names=["f"], init_fn=_zero)
    ebc = shard_modules(
        EmbeddingBagCollection([t]), ShardingPlan({"": {"t": row_wise()}}), embedding_grad=mode, device=device
    )
    opt = torch.optim.SGD(ebc.parameters(), lr=1.0)
    ids = torch.tensor([0, 1]) if rank == 0 else torch.tensor([2, 3])
    kjt = KeyedJaggedTensor(["f"], ids, lengths=torch.tensor([1, 1])).to(device)  # two bags of one id each
    loss = ebc(kjt).values().sum(1).mean()  # mean over the local batch of the pooled sum
    loss.backward()
    opt.step()
    return full_state_dict(ebc)["embedding_bags.t.weight"][:, 0].tolist()


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("mode, step", [("sum", 0.5), ("mean", 0.25)])
def test_a_rowwise_rows_move_by_local_mean_gradient(mode: str, step: float, device: str) -> None:
    for rows in run_distributed(_rowwise_grad_job, 2, mode, device):
        assert rows == pytest.approx([-step] * 4 + [0.0] * 4)


# -- (b) row-wise MEAN divides by the full bag length, once -------------------------------------------
def _rowwise_mean_job(rank: int, ws: int, device: str) -> tuple[list[float], list[float]]:
    t = EmbeddingBagConfig(name="t", num_embeddings=8, embedding_dim=4, feature_names=["f"], pooling="mean")
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection([t])
    full = ebc.embedding_bags["t"].weight.detach().clone()
    sharded = shard_modules(ebc, ShardingPlan({"": {"t": row_wise()}}), device=device)
    # one bag: ids 1 and 2 on rank 0's block (rows 0-3), 5 on rank 1's block (rows 4-7)
    kjt = KeyedJaggedTensor(["f"], torch.tensor([1, 2, 5]), lengths=torch.tensor([3])).to(device)
    return sharded(kjt).values()[0].tolist(), full[[1, 2, 5]].mean(0).tolist()


@pytest.mark.parametrize("device", _DEVICES)
def test_b_rowwise_mean_spanning_shards_is_true_mean(device: str) -> None:
    for got, want in run_distributed(_rowwise_mean_job, 2, device):
        assert got == pytest.approx(want, abs=1e-6)


# -- (c) data-parallel tables: leaf parameters, updates visible in state_dict, bf16 -----------------
def _dp_job(rank: int, ws: int) -> dict:
    t = EmbeddingBagConfig(name="t", num_embeddings=6, embedding_dim=4, feature_names=["f"], dtype=torch.bfloat16)
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection([t])
    ref = copy.deepcopy(ebc)
    sharded = shard_modules(ebc, ShardingPlan({"": {"t": data_parallel()}}))
    ((name, p),) = list(sharded.named_parameters())
    info = {"name": name, "leaf": p.is_leaf, "dtype": str(p.dtype)}
    opt = torch.optim.SGD(sharded.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    batches = [
        KeyedJaggedTensor(["f"], torch.tensor([0, 1, 1]), lengths=torch.tensor([2, 1])),
        KeyedJaggedTensor(["f"], torch.tensor([1, 4]), lengths=torch.tensor([1, 1])),
    ]
    for _ in range(2):
        opt.zero_grad()
        sharded(batches[rank]).values().float().sum().backward()
        opt.step()
        ref_opt.zero_grad()
        sum(ref(b).values().float().sum() for b in batches).backward()
        ref_opt.step()
    sd = sharded.state_dict()["embedding_bags.t.weight"]
    info.update(
        same_storage=sd.data_ptr() == p.data_ptr(),
        sd_dtype=str(sd.dtype),
        equal_to_param=torch.equal(sd, p.detach()),
        max_err=float((sd.float() - ref.state_dict()["embedding_bags.t.weight"].float()).abs().max()),
        moved=float((sd.float() - ref.embedding_bags["t"].weight.detach().float()).abs().max()),
    )
    # a dtype conversion after sharding carries the parameter along: the optimizer still updates what
    # state_dict returns
    sharded.to(torch.float32)
    before = sharded.state_dict()["embedding_bags.t.weight"].clone()
    opt.zero_grad()
    sharded(batches[rank]).values().sum().backward()
    opt.step()
    after = sharded.state_dict()["embedding_bags.t.weight"]
    info.update(
        after_to_dtype=str(after.dtype),
        after_to_moved=not torch.equal(before, after),
        after_to_shared=after.data_ptr() == next(sharded.parameters()).data_ptr(),
    )
    return info


def test_c_data_parallel_parameters_are_leaves_and_train_in_bf16() -> None:
    for info in run_distributed(_dp_job, 2):
        assert info["name"] == "embedding_bags.t.weight"
        assert info["leaf"] and info["dtype"] == "torch.bfloat16" and info["sd_dtype"] == "torch.bfloat16"
        assert info["same_storage"] and info["equal_to_param"]
        assert info["max_err"] <= 2e-2  # bf16 has 8 bits of mantissa
        assert info["after_to_dtype"] == "torch.float32"
        assert info["after_to_moved"] and info["after_to_shared"]


# -- (d) an explicit per-table placement puts weights exactly where asked ----------------------------
def _placement_job(rank: int, ws: int) -> list[str]:
    tables = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=4, embedding_dim=4, feature_names=[f"f{i}"]) for i in range(5)
    ]
    plan = {f"t{i}": table_wise(rank=0 if i < 3 else 1) for i in range(5)}
    sharded = shard_modules(EmbeddingBagCollection(tables), ShardingPlan({"": plan}))
    return [n for n, _ in sharded.named_parameters()]


def test_d_custom_table_wise_plan_places_tables_on_exactly_those_ranks() -> None:
    r0, r1 = run_distributed(_placement_job, 2)
    assert r0 == [f"embedding_bags.t{i}.weight" for i in range(3)]
    assert r1 == [f"embedding_bags.t{i}.weight" for i in (3, 4)]


# -- state_dict: same keys, global shape, shared storage, write-through, DCP ---------------------------
def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="rw", num_embeddings=5, embedding_dim=4, feature_names=["a"]),
        EmbeddingBagConfig(name="cw", num_embeddings=6, embedding_dim=4, feature_names=["b"]),
        EmbeddingBagConfig(name="dp", num_embeddings=3, embedding_dim=4, feature_names=["c"]),
        EmbeddingBagConfig(name="tw", num_embeddings=4, embedding_dim=4, feature_names=["d"]),
        EmbeddingBagConfig(name="grid", num_embeddings=7, embedding_dim=4, feature_names=["e"]),
        EmbeddingBagConfig(name="twrw", num_embeddings=3, embedding_dim=4, feature_names=["g"]),
    ]


def _plan(ws: int) -> ShardingPlan:
    return ShardingPlan(
        {
            "": {
                "rw": row_wise(),
                "cw": column_wise([ws - 1, 0]),
                "dp": data_parallel(),
                "tw": table_wise(ws - 1),
                "grid": grid_shard([0]),
                "twrw": table_row_wise(0),
            }
        }
    )


def _state_job(rank: int, ws: int, path: str, device: str = "cpu") -> dict:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(_tables())
    unsharded_keys = list(ebc.state_dict())
    sharded = shard_modules(ebc, _plan(ws), device=device)
    sd = sharded.state_dict()
    shapes = {k: list(v.size()) for k, v in sd.items()}
    shared = []
    params = dict(sharded.named_parameters())
    for k, v in sd.items():
        if _compat.is_sharded(v):
            for _, t in _compat.local_pieces(v):
                shared.append(t.data_ptr() == params[k].data_ptr())
    # write-through: load full tensors, then read them back gathered
    new = {k: torch.arange(math.prod(v.size()), dtype=torch.float32).view(list(v.size())) for k, v in sd.items()}
    sharded.load_state_dict(new)
    back = full_state_dict(sharded)
    roundtrip = all(torch.equal(back[k].cpu(), new[k]) for k in new)
    dcp.save(sharded.state_dict(), checkpoint_id=path)
    return dict(keys=list(sd), unsharded_keys=unsharded_keys, shapes=shapes, shared=shared, roundtrip=roundtrip)


@pytest.mark.parametrize("ws, device", [(2, "cpu"), (3, "cpu"), pytest.param(2, "cuda", marks=_CUDA)])
def test_state_dict_keys_shapes_storage_and_dcp(ws: int, device: str, tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    results = run_distributed(_state_job, ws, str(tmp_path / "ckpt"), device)
    for res in results:
        assert sorted(res["keys"]) == sorted(res["unsharded_keys"])
        for t in _tables():
            assert res["shapes"][f"embedding_bags.{t.name}.weight"] == [t.num_embeddings, t.embedding_dim]
        assert res["shared"] and all(res["shared"])
        assert res["roundtrip"]
    # the DCP directory written by the sharded ranks loads into plain full tensors on one process
    target = {k: torch.zeros(v.shape) for k, v in EmbeddingBagCollection(_tables()).state_dict().items()}
    dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    for k, v in target.items():
        assert torch.equal(v, torch.arange(v.numel(), dtype=torch.float32).view(v.shape)), k


def _bad_state_job(rank: int, ws: int) -> str:
    sharded = shard_modules(EmbeddingBagCollection(_tables()), _plan(ws))
    sd = {k: torch.zeros(v.size()) for k, v in sharded.state_dict().items()}
    sd["embedding_bags.rw.weight"] = torch.zeros(6, 4)
    try:
        sharded.load_state_dict(sd)
    except ValueError as e:
        return str(e)
    return "no error"


def test_load_state_dict_with_wrong_shape_names_table_and_shapes() -> None:
    for msg in run_distributed(_bad_state_job, 2):
        assert "'rw'" in msg and "[6, 4]" in msg and "[5, 4]" in msg


# -- bad input on one rank: every rank raises, none hangs ----------------------------------------------
def _bad_input_job(rank: int, ws: int) -> str:
    sharded = shard_modules(EmbeddingBagCollection(_tables()), _plan(ws))
    keys = [f for t in _tables() for f in t.feature_names]
    ids = torch.zeros(len(keys), dtype=torch.long)
    if rank == 1:
        ids[0] = 99  # feature "a", table "rw" has 5 rows
    try:
        sharded(KeyedJaggedTensor(keys, ids, lengths=torch.ones(len(keys), dtype=torch.long)))
    except ValueError as e:
        return str(e)
    return "no error"


def test_bad_ids_on_one_rank_raise_everywhere_without_hanging() -> None:
    msgs = run_distributed(_bad_input_job, 3, timeout_s=60)
    assert "'a'" in msgs[1] and "'rw'" in msgs[1] and "99" in msgs[1] and "[0, 4]" in msgs[1]
    for m in (msgs[0], msgs[2]):
        assert "ranks [1] rejected their input" in m
