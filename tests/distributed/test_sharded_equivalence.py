"""The guard of docs/ARCHITECTURE.md (plans never change the math): for random tables, plans and batches, sharded training == one process.

Each job runs many random cases on real gloo processes. The reference is the unsharded collection
(torch kernel, itself checked against F.embedding_bag in tests/unit) trained on one process with the
loss convention of rule 2: ``"sum"`` -> reference loss = sum over ranks of each rank's local loss,
``"mean"`` -> their mean.
"""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_rec import EmbeddingBagCollection, EmbeddingCollection, PoolingType
from lightning_rec.plans.mesh import init_2d_mesh
from lightning_rec.sharding import ShardingPlan, data_parallel, full_state_dict, fused_optimizer, shard_modules
from lightning_rec.testing import run_distributed
from tests.distributed.cases import ALL_TYPES, ROW_WHOLE_TYPES, batch, loss_coefficients, random_case

STEPS = 3
LR = 0.5
ATOL = 1e-5


def _pooled_loss(out: torch.Tensor, case: dict, rank: int, step: int) -> torch.Tensor:
    c = loss_coefficients(case, rank, step, tuple(out.shape)).to(out.device)
    return (out * c).sum() / max(out.shape[0], 1)


def _sequence_loss(out: dict, case: dict, rank: int, step: int) -> torch.Tensor:
    total = torch.zeros((), device=next(iter(out.values())).values().device if out else "cpu")
    for i, name in enumerate(sorted(out)):
        v = out[name].values()
        c = loss_coefficients(case, rank, step * 100 + i, tuple(v.shape)).to(v.device)
        total = total + (v * c).sum()
    return total / max(case["batch_sizes"][rank], 1)


class _RowwiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad written out: ``m[r] += mean_d(g[r]**2)``; ``w[r] -= lr * g[r] / (sqrt(m[r]) + eps)``."""

    def __init__(self, params, lr: float, eps: float = 1e-8) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.to_dense() if p.grad.is_sparse else p.grad
                m = self.state[p].setdefault("sum", torch.zeros(p.shape[0], dtype=p.dtype))
                m += g.pow(2).mean(1)
                p -= group["lr"] * g / (m.sqrt() + group["eps"]).unsqueeze(1)


def _reference_optimizer(params, fused: str | None) -> torch.optim.Optimizer:
    params = list(params)
    if fused == "adagrad":
        return torch.optim.Adagrad(params, lr=LR, eps=1e-8, initial_accumulator_value=0.0)
    if fused == "rowwise_adagrad":
        return _RowwiseAdagrad(params, lr=LR)
    return torch.optim.SGD(params, lr=LR)


def _check_case(
    rank: int, ws: int, case: dict, sequence: bool, mesh=None, fused: str | None = None, device: str = "cpu"
) -> dict:
    torch.manual_seed(case["seed"])
    if sequence:
        model = EmbeddingCollection(case["tables"], sparse_grad=case["sparse_grad"])
    else:
        model = EmbeddingBagCollection(
            case["tables"], is_weighted=case["weighted"], kernel="torch", sparse_grad=case["sparse_grad"]
        )
    ref = copy.deepcopy(model)
    groups = {} if mesh is None else dict(process_group=mesh.shard_group, replica_group=mesh.replica_group)
    if fused is not None:
        groups["embedding_optimizer"] = {"kind": fused, "lr": LR}
    sharded = shard_modules(
        model,
        ShardingPlan({"": case["plan"]}),
        embedding_grad=case["embedding_grad"],
        local_size=case["local_size"],
        device=device,
        **groups,
    )
    if fused is not None:
        opt = fused_optimizer(sharded)  # None on a rank holding no shard
        assert all(not p.requires_grad for p in sharded.parameters())
    else:
        # a rank may hold no piece of any table; it still joins every exchange
        params = list(sharded.parameters())
        opt = torch.optim.SGD(params, lr=LR) if params else None
    ref_opt = _reference_optimizer(ref.parameters(), fused)
    loss_fn = _sequence_loss if sequence else _pooled_loss
    rank_weight = 1.0 if case["embedding_grad"] == "sum" else 1.0 / ws
    worst = 0.0
    for step in range(STEPS):
        kjt = batch(case, rank, step)
        out = sharded(kjt.to(device))
        expected = ref(kjt)
        if sequence:
            assert list(out) == list(expected), (list(out), list(expected))
            for k in out:
                torch.testing.assert_close(
                    out[k].values().cpu(),
                    expected[k].values(),
                    atol=ATOL,
                    rtol=0,
                    msg=lambda m: f"case {case['seed']} feature {k!r} step {step}: {m}",
                )
                assert torch.equal(out[k].lengths().cpu(), expected[k].lengths())
            loss = _sequence_loss(out, case, rank, step)
        else:
            assert out.keys() == expected.keys()
            torch.testing.assert_close(
                out.values().cpu(),
                expected.values().detach(),
                atol=ATOL,
                rtol=0,
                msg=lambda m: f"case {case['seed']} step {step} forward: {m}",
            )
            diff = (out.values().cpu() - expected.values()).detach()
            worst = max(worst, float(diff.abs().max()) if diff.numel() else 0.0)
            loss = _pooled_loss(out.values(), case, rank, step)
        if opt is not None:
            opt.zero_grad()
        loss.backward()
        if opt is not None:
            opt.step()
        # the reference sees every rank's batch on one process
        ref_opt.zero_grad()
        ref_outs = [ref(batch(case, r, step)) for r in range(ws)]
        ref_loss = sum(
            rank_weight * loss_fn(o if sequence else o.values(), case, r, step) for r, o in enumerate(ref_outs)
        )
        ref_loss.backward()
        ref_opt.step()
    got = full_state_dict(sharded)
    want = ref.state_dict()
    assert list(got) == list(want) or set(got) == set(want), (list(got), list(want))
    for key in want:
        torch.testing.assert_close(
            got[key].cpu(),
            want[key],
            atol=ATOL,
            rtol=0,
            msg=lambda m: f"case {case['seed']} plan {case['plan']} {key} after {STEPS} steps: {m}",
        )
    # this rank's copy of every table it holds, and the fused optimizer's state: replicas must hold equal bits
    local = {n: p.detach().cpu().clone() for n, p in sharded.named_parameters()}
    state = opt.state_dict()["tables"] if fused is not None and opt is not None else {}
    state = {t: {k: v.clone() for k, v in st.items()} for t, st in state.items()}
    return {"worst": worst, "local": local, "state": state}


def _equivalence_job(rank: int, ws: int, seeds: list[int], sequence: bool, device: str = "cpu") -> list[float]:
    if device == "cuda":
        torch.cuda.set_device(0)
        if not dist.is_initialized():  # one rank on the GPU: NCCL; more ranks share it over gloo
            dist.init_process_group(
                "nccl", rank=rank, world_size=ws, timeout=timedelta(seconds=120), device_id=torch.device("cuda", 0)
            )
    return [_check_case(rank, ws, random_case(seed, ws, sequence=sequence), sequence, device=device) for seed in seeds]


# CUDA: world size 1 over NCCL; 2 ranks on the one GPU over gloo with CUDA tensors (NCCL refuses that)
_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
_DEVICES = [
    ("cpu", 1),
    ("cpu", 2),
    ("cpu", 3),
    ("cpu", 4),
    pytest.param("cuda", 1, marks=_CUDA),
    pytest.param("cuda", 2, marks=_CUDA),
]


def _run(ws: int, seeds: list[int], sequence: bool, device: str) -> None:
    nccl = device == "cuda" and ws == 1
    run_distributed(_equivalence_job, ws, seeds, sequence, device, init_process_group=not nccl, timeout_s=300)


@pytest.mark.parametrize("device, ws", _DEVICES)
def test_pooled_sharded_training_equals_single_process(device: str, ws: int) -> None:
    seeds = list(range(100 * ws, 100 * ws + (6 if ws < 4 else 5)))
    _run(ws, seeds, False, device)


@pytest.mark.parametrize("device, ws", [("cpu", 2), ("cpu", 3), *_DEVICES[-2:]])
def test_sequence_sharded_training_equals_single_process(device: str, ws: int) -> None:
    seeds = list(range(500 + 100 * ws, 500 + 100 * ws + 4))
    _run(ws, seeds, True, device)


def _equivalence_2d_job(rank: int, ws: int, seeds: list[int], model_parallel_size: int, sequence: bool) -> list[float]:
    mesh = init_2d_mesh(model_parallel_size)
    return [
        _check_case(rank, ws, random_case(seed, model_parallel_size, sequence=sequence, world=ws), sequence, mesh)
        for seed in seeds
    ]


@pytest.mark.parametrize("sequence", [False, True])
def test_2d_replicas_of_model_parallel_groups_equal_single_process(sequence: bool) -> None:
    # 4 ranks = 2 replicas x 2-way model parallel; plans speak in ranks of the 2-rank shard group
    seeds = list(range(900 + 10 * sequence, 900 + 10 * sequence + 4))
    run_distributed(_equivalence_2d_job, 4, seeds, 2, sequence)


def _fused_job(rank: int, ws: int, runs: list[tuple[int, str]], model_parallel_size: int | None) -> list[dict]:
    mesh = init_2d_mesh(model_parallel_size) if model_parallel_size else None
    mp = model_parallel_size or ws
    out = []
    for i, (seed, kind) in enumerate(runs):
        types = ROW_WHOLE_TYPES if kind == "rowwise_adagrad" else ALL_TYPES
        case = random_case(seed, mp, types=types, world=ws, fused=True)
        # every case holds a data-parallel table; both conventions and both poolings are covered
        first = case["tables"][0]
        case["plan"][first.name] = data_parallel()
        case["embedding_grad"] = ("sum", "mean")[i % 2]
        first.pooling = (PoolingType.SUM, PoolingType.MEAN)[(i // 2) % 2]
        out.append({**_check_case(rank, ws, case, False, mesh, fused=kind), "dp": first.name})
    return out


def _assert_replicas_identical(results: list[list[dict]], model_parallel_size: int) -> None:
    for r, per_case in enumerate(results):
        peer = r % model_parallel_size  # the same shard rank in the first replica group
        for i, (mine, theirs) in enumerate(zip(per_case, results[peer])):
            assert mine["local"].keys() == theirs["local"].keys()
            for n, w in mine["local"].items():
                assert torch.equal(w, theirs["local"][n]), f"case {i}: rank {r} and rank {peer} differ in {n}"
            for t, st in mine["state"].items():
                for k, v in st.items():
                    assert torch.equal(v, theirs["state"][t][k]), f"case {i}: optimizer state {t}/{k} differs"
    # the data-parallel table: one copy per rank of the whole world, all equal, with equal optimizer state
    for i, first in enumerate(results[0]):
        key = f"embedding_bags.{first['dp']}.weight"
        for r, res in enumerate(results):
            assert torch.equal(res[i]["local"][key], first["local"][key]), f"case {i}: rank {r} differs in {key}"
            for k, v in res[i]["state"][first["dp"]].items():
                assert torch.equal(v, first["state"][first["dp"]][k]), f"case {i}: rank {r} state {k} differs"


@pytest.mark.parametrize("ws, kinds", [(2, ("sgd", "rowwise_adagrad")), (3, ("adagrad",))])
def test_fused_optimizer_training_equals_single_process(ws: int, kinds: tuple[str, ...]) -> None:
    # the fbgemm in-backward update of every shard and of data-parallel replicas == torch's optimizer on the
    # unsharded tables
    runs = [(1300 + 10 * ws + i, kinds[i % len(kinds)]) for i in range(4)]
    results = run_distributed(_fused_job, ws, runs, None)
    _assert_replicas_identical(results, ws)


@pytest.mark.slow
def test_fused_optimizer_2d_replicas_equal_single_process_and_stay_identical() -> None:
    # 4 ranks = 2 replicas x 2-way model parallel: every replica looks up the union batch of its replica
    # group, so each applies the same update, equal to one process's torch optimizer on the global batch
    runs = [(1500 + i, kind) for i, kind in enumerate(["sgd", "rowwise_adagrad", "sgd", "adagrad"])]
    results = run_distributed(_fused_job, 4, runs, 2, timeout_s=240)
    _assert_replicas_identical(results, 2)
