"""Every tensor the sharded pipeline makes lives on the module's device.

Without a GPU the check runs on CPU with another *default* device: a tensor created without ``device=``
then lands on the meta device and the next op that mixes it with the CPU data fails. The CUDA variants
run the same training against the single-process CPU reference where a GPU is present.
"""

from __future__ import annotations

import copy
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, KeyedJaggedTensor, _compat
from lightning_rec.sharding import ShardingPlan, full_state_dict, row_wise, shard_modules
from lightning_rec.testing import run_distributed
from tests.distributed.cases import ALL_TYPES, batch, loss_coefficients, random_case

_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _build(case: dict, sequence: bool):
    torch.manual_seed(case["seed"])
    if sequence:
        return EmbeddingCollection(case["tables"], sparse_grad=case["sparse_grad"])
    return EmbeddingBagCollection(
        case["tables"], is_weighted=case["weighted"], kernel="torch", sparse_grad=case["sparse_grad"]
    )


def _values(out, sequence: bool) -> torch.Tensor:
    return torch.cat([out[k].values().reshape(-1) for k in sorted(out)]) if sequence else out.values().reshape(-1)


def _default_device_job(rank: int, ws: int, seeds: list[int], sequence: bool) -> float:
    worst = 0.0
    for seed in seeds:
        case = random_case(seed, ws, sequence=sequence, types=ALL_TYPES)
        model = _build(case, sequence)
        ref = copy.deepcopy(model)
        kjt = batch(case, rank, 0)
        with torch.device("meta"):  # anything created without device= lands here and breaks the job
            sharded = shard_modules(
                model,
                ShardingPlan({"": case["plan"]}),
                device="cpu",
                embedding_grad=case["embedding_grad"],
                local_size=case["local_size"],
            )
            out = _values(sharded(kjt), sequence)
            assert out.device.type == "cpu"
            with torch.device("cpu"):  # the test's own tensor
                coeff = loss_coefficients(case, rank, 0, tuple(out.shape))
            (out * coeff).sum().backward()
            state = full_state_dict(sharded)
        want = _values(ref(kjt), sequence).detach()
        worst = max(worst, float((out.detach() - want).abs().max()) if out.numel() else 0.0)
        assert all(v.device.type == "cpu" for v in state.values())
        assert all(p.grad is None or p.grad.device.type == "cpu" for p in sharded.parameters())
    return worst


@pytest.mark.parametrize("sequence", [False, True])
def test_pipeline_creates_no_tensor_on_the_default_device(sequence: bool) -> None:
    seeds = list(range(2100 + 10 * sequence, 2100 + 10 * sequence + 4))
    for worst in run_distributed(_default_device_job, 2, seeds, sequence):
        assert worst <= 1e-5


def _move_job(rank: int, ws: int) -> dict:
    case = random_case(2200, ws, types=("table_wise", "row_wise", "column_wise", "data_parallel"))
    sharded = shard_modules(_build(case, False), ShardingPlan({"": case["plan"]}), local_size=case["local_size"])
    sharded.to("meta")
    sd = sharded.state_dict()
    pieces = [t for v in sd.values() if _compat.is_sharded(v) for _, t in _compat.local_pieces(v)]
    placements = [v.device_mesh.device_type for v in sd.values() if _compat.is_sharded(v)]
    return dict(
        device=str(sharded.device),
        routing=str(sharded._kjt_dist.bucketing.bucket_start.device),  # the input dist's routing tensors
        params={str(p.device) for p in sharded.parameters()},
        pieces={str(t.device) for t in pieces},
        placements=placements,
        half=str(sharded.half().device),
    )


def test_to_after_sharding_moves_routing_and_state_dict_placements() -> None:
    for res in run_distributed(_move_job, 2):
        assert res["device"] == "meta" and res["routing"] == "meta" and res["half"] == "meta"
        assert res["params"] <= {"meta"} and res["pieces"] <= {"meta"}
        assert res["placements"] and all(p == "meta" for p in res["placements"])


# -- CUDA: the same cases against the CPU reference -----------------------------------------------------
def _loss(values: torch.Tensor, case: dict, rank: int, step: int) -> torch.Tensor:
    return (values * loss_coefficients(case, rank, step, tuple(values.shape)).to(values.device)).sum()


def _cuda_job(rank: int, ws: int, seeds: list[int], sequence: bool, backend: str) -> float:
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        dist.init_process_group(
            "nccl", rank=rank, world_size=ws, timeout=timedelta(seconds=120), device_id=torch.device("cuda", 0)
        )
    torch.cuda.set_device(0)
    worst = 0.0
    for seed in seeds:
        case = random_case(seed, ws, sequence=sequence)
        model = _build(case, sequence)
        ref = copy.deepcopy(model)
        sharded = shard_modules(
            model,
            ShardingPlan({"": case["plan"]}),
            device="cuda",
            embedding_grad=case["embedding_grad"],
            local_size=case["local_size"],
        )
        params = list(sharded.parameters())
        opt = torch.optim.SGD(params, lr=0.5) if params else None
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        scale = 1.0 if case["embedding_grad"] == "sum" else 1.0 / ws
        for step in range(2):
            out = _values(sharded(batch(case, rank, step).to("cuda")), sequence)
            want = _values(ref(batch(case, rank, step)), sequence).detach()
            worst = max(worst, float((out.detach().cpu() - want).abs().max()) if out.numel() else 0.0)
            _loss(out, case, rank, step).backward()
            if opt is not None:
                opt.step()
                opt.zero_grad()
            ref_loss = sum(
                scale * _loss(_values(ref(batch(case, r, step)), sequence), case, r, step) for r in range(ws)
            )
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
        got = full_state_dict(sharded)
        for k, v in ref.state_dict().items():
            worst = max(worst, float((got[k].cpu() - v).abs().max()))
    return worst


@pytest.mark.gpu
@_CUDA
@pytest.mark.parametrize("sequence", [False, True])
@pytest.mark.parametrize("ws, backend", [(1, "nccl"), (2, "gloo")])
def test_cuda_sharded_training_equals_cpu_single_process(ws: int, backend: str, sequence: bool) -> None:
    # world size 1 over NCCL; 2 ranks share the one GPU over gloo (NCCL refuses two ranks on one GPU)
    seeds = list(range(2300 + 10 * ws, 2300 + 10 * ws + 4))
    results = run_distributed(
        _cuda_job, ws, seeds, sequence, backend, init_process_group=backend == "gloo", timeout_s=300
    )
    assert max(results) <= 1e-5


def _wrong_device_job(rank: int, ws: int) -> str:
    t = EmbeddingBagConfig(name="t", num_embeddings=4, embedding_dim=4, feature_names=["f"])
    sharded = shard_modules(EmbeddingBagCollection([t]), ShardingPlan({"": {"t": row_wise()}}), device="cpu")
    kjt = KeyedJaggedTensor(["f"], torch.tensor([1]), lengths=torch.tensor([1]))
    try:
        sharded(kjt.to("cuda") if rank == 1 else kjt)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.gpu
@_CUDA
def test_a_batch_on_another_device_is_refused_on_every_rank() -> None:
    msgs = run_distributed(_wrong_device_job, 2, timeout_s=60)
    assert "is on cuda:0 but this sharded collection is on cpu" in msgs[1]
    assert "ranks [1] rejected their input" in msgs[0]
