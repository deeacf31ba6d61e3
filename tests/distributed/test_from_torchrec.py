"""TorchRec's training API on 2 gloo processes: the ported golden example trains, and DMP + fused row-wise
Adagrad + DDP equals plain single-process training on the global batch, step for step."""

from __future__ import annotations

import copy
import importlib.util
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, _compat
from lightning_rec.data import Batch, RandomRecDataset
from lightning_rec.distributed import (
    DefaultDataParallelWrapper,
    DistributedModelParallel,
    EmbeddingBagCollectionSharder,
    KeyedOptimizerWrapper,
    RowWiseAdagrad,
    ShardingEnv,
    TrainPipelineSparseDist,
    apply_optimizer_in_backward,
    in_backward_optimizer_filter,
)
from lightning_rec.models.dlrm import DLRM, DLRMTrain, InteractionArch
from lightning_rec.pipeline.state_dict import full_state_dict
from lightning_rec.sharding import ShardingPlan, column_wise, row_wise, table_wise
from lightning_rec.testing import run_distributed

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "from_torchrec.py"


def _example():
    spec = importlib.util.spec_from_file_location("from_torchrec", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run_example(rank: int, world: int) -> list[float]:
    return _example().train(num_embeddings=200, embedding_dim=8, num_iterations=40, learning_rate=0.1, seed=3)


def test_ported_golden_example_trains_on_two_processes() -> None:
    losses = run_distributed(_run_example, 2)
    for rank, curve in enumerate(losses):
        first, last = sum(curve[:5]) / 5, sum(curve[-5:]) / 5
        assert last < 0.7 * first, f"rank {rank}: loss {first:.4f} -> {last:.4f} did not go down"


# -- DMP == one process on the global batch ----------------------------------------------------------------
TABLES = [("t_a", 40, 8, ["a"]), ("t_b", 30, 8, ["b"]), ("t_c", 25, 8, ["c"])]
LR = 0.05
STEPS = 3


def _model() -> DLRMTrain:
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(n, d, name, f) for name, n, d, f in TABLES])
    return DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=5,
            dense_arch_layer_sizes=[6, 8],
            over_arch_layer_sizes=[4, 1],
        )
    )


def _batches(rank: int) -> list[Batch]:
    keys = [f for *_, fs in TABLES for f in fs]
    ds = RandomRecDataset(
        keys,
        batch_size=3 + rank,
        hash_sizes=[n for _, n, _, _ in TABLES],
        ids_per_feature=3,
        min_ids_per_feature=0,
        num_dense=5,
        manual_seed=100 + rank,
        num_batches=STEPS,
    )
    return list(ds)


def _concat(a: Batch, b: Batch) -> Batch:
    keys = a.sparse.keys()
    da, db = a.sparse.to_dict(), b.sparse.to_dict()
    values = torch.cat([torch.cat([da[k].values(), db[k].values()]) for k in keys])
    lengths = torch.cat([torch.cat([da[k].lengths(), db[k].lengths()]) for k in keys])
    return Batch(
        torch.cat([a.dense, b.dense]), KeyedJaggedTensor(keys, values, lengths=lengths), torch.cat([a.labels, b.labels])
    )


def _reference(state: dict, batches: list[list[Batch]], table_optimizer: type) -> dict:
    """Plain torch, one process: ``table_optimizer`` on the tables, Adagrad on the rest, the global batch per step."""
    model = _model()
    model.load_state_dict(state)
    tables = list(model.model.sparse_arch.parameters())
    dense = [p for p in model.parameters() if all(p is not t for t in tables)]
    opts = [table_optimizer(tables, lr=LR, eps=1e-10), torch.optim.Adagrad(dense, lr=LR)]
    for step in range(STEPS):
        glob = batches[0][step]
        for r in range(1, len(batches)):
            glob = _concat(glob, batches[r][step])
        for o in opts:
            o.zero_grad()
        # each rank's loss is the mean over its own batch; DDP and embedding_grad="mean" average the ranks
        per_rank = [len(batches[r][step]) for r in range(len(batches))]
        logits = model.model(glob.dense, glob.sparse).squeeze(-1)
        parts = torch.split(
            torch.nn.functional.binary_cross_entropy_with_logits(logits, glob.labels.float(), reduction="none"),
            per_rank,
        )
        (sum(p.mean() for p in parts) / len(parts)).backward()
        for o in opts:
            o.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _dmp_vs_reference(
    rank: int, world: int, plan_kind: str, via: str, dense_precision: str | None, device_type: str = "cpu"
) -> None:
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = _model()
    initial = copy.deepcopy(model.state_dict())
    if via == "in_backward":
        apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": LR})
        sharder = EmbeddingBagCollectionSharder()
    elif via == "plain":  # no fused kernel: the tables train with the loop's optimizer, as the dense part does
        sharder = EmbeddingBagCollectionSharder()
    else:
        # element-wise Adagrad: a column shard keeps the same per-value state as the whole table (row-wise
        # Adagrad keeps one statistic per row of each column shard, as TorchRec's does: README "Porting")
        sharder = EmbeddingBagCollectionSharder(
            fused_params={"optimizer": "EXACT_ADAGRAD", "learning_rate": LR, "eps": 1e-10}
        )
    plans = {
        "auto": None,
        "mixed": ShardingPlan(
            {
                "model.sparse_arch.embedding_bag_collection": {
                    "t_a": row_wise(),
                    "t_b": table_wise(rank=1),
                    "t_c": column_wise(size_per_rank=[4, 4]),
                }
            }
        ),
    }
    env = ShardingEnv.from_process_group(dist.group.WORLD) if plan_kind == "mixed" else None
    wrapper = None if dense_precision is None else DefaultDataParallelWrapper(allreduce_comm_precision=dense_precision)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dmp = DistributedModelParallel(
            model,
            env=env,
            device=device,
            plan=plans[plan_kind],
            sharders=[sharder],
            data_parallel_wrapper=wrapper,
        )
    # TorchRec's setting, kept deliberately: torch 2.13's deprecation notice for it is not the user's to read
    assert not [w for w in caught if "broadcast_buffers" in str(w.message)]
    # TorchRec's DDP settings: no buffer broadcast each forward, a static graph
    (ddp,) = [m for m in dmp.modules() if isinstance(m, DistributedDataParallel)]
    assert ddp.broadcast_buffers is False and ddp.static_graph is True
    assert set(dmp.state_dict()) == set(initial), "DMP state_dict keys differ from the unsharded model's"
    ebc_plan = dmp.plan.get_plan_for_module("model.sparse_arch.embedding_bag_collection")
    assert all(ps.ranks for ps in ebc_plan.values()), ebc_plan
    if plan_kind == "mixed":
        assert ebc_plan["t_a"].sharding_type == "row_wise" and ebc_plan["t_a"].ranks == [0, 1]
        assert ebc_plan["t_c"].ranks == [0, 1]
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    assert any("embedding_bag_collection" in k for k in dense) == (via == "plain"), sorted(dense)
    opt = KeyedOptimizerWrapper(dense, lambda ps: torch.optim.Adagrad(ps, lr=LR))
    pipeline = TrainPipelineSparseDist(dmp, opt, device)
    batches = [_batches(r) for r in range(world)]
    it = iter(batches[rank])
    for _ in range(STEPS):
        pipeline.progress(it)
    with pytest.raises(StopIteration):
        pipeline.progress(it)
    got = {k: v.cpu() for k, v in full_state_dict(dmp.module).items()}
    want = _reference(initial, batches, RowWiseAdagrad if via == "in_backward" else torch.optim.Adagrad)
    assert set(got) == set(want)
    # fp16 dense gradients: each within fp16's relative rounding (2^-11) of the fp32 one, moved by Adagrad's lr
    atol = 1e-5 if dense_precision is None else 1e-3
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=atol, msg=lambda m, k=k: f"{k}: {m}")
    if dense_precision is not None:  # the compression hook took effect: the dense weights are not the fp32 ones
        dense_keys = [k for k in want if "embedding_bag_collection" not in k]
        assert any(not torch.allclose(got[k], want[k], rtol=0, atol=1e-7) for k in dense_keys)
    # state_dict round trip: zero every weight, load the saved state back, get the trained weights again
    saved = copy.deepcopy(full_state_dict(dmp.module))
    with torch.no_grad():
        for v in dmp.module.state_dict(keep_vars=True).values():
            for piece in [t for _, t in _compat.local_pieces(v)] if _compat.is_sharded(v) else [v]:
                piece.zero_()
    assert all(not v.any() for v in full_state_dict(dmp.module).values())
    dmp.load_state_dict(saved)
    for k, v in full_state_dict(dmp.module).items():
        torch.testing.assert_close(v, saved[k], msg=lambda m, k=k: f"after load_state_dict, {k}: {m}")
    assert not torch.equal(
        want["model.sparse_arch.embedding_bag_collection.embedding_bags.t_a.weight"],
        initial["model.sparse_arch.embedding_bag_collection.embedding_bags.t_a.weight"],
    )
    dist.barrier()


@pytest.mark.parametrize(
    "plan_kind, via, dense_precision",
    [
        ("auto", "in_backward", None),
        ("mixed", "fused_params", None),
        ("auto", "in_backward", "fp16"),
        ("mixed", "plain", None),
    ],
)
def test_dmp_equals_single_process_reference(plan_kind: str, via: str, dense_precision: str | None) -> None:
    run_distributed(_dmp_vs_reference, 2, plan_kind, via, dense_precision)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("plan_kind", ["auto", "mixed"])
def test_dmp_on_cuda_equals_single_cpu_process(plan_kind: str) -> None:
    # 2 ranks on the one GPU over gloo; tables unfused (fbgemm's fused kernels need its CUDA build)
    run_distributed(_dmp_vs_reference, 2, plan_kind, "plain", None, "cuda", timeout_s=300)


def test_data_parallel_wrapper_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match="allreduce_comm_precision='fp8'"):
        DefaultDataParallelWrapper(allreduce_comm_precision="fp8")


class _Seen(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.ones(1))


def _meta_model(rank: int, world: int, how: str) -> None:
    torch.manual_seed(rank)  # different seeds: DDP must make the dense replicas equal
    meta = torch.device("meta")

    def build() -> DLRMTrain:
        tables = [EmbeddingBagConfig(n, d, name, f) for name, n, d, f in TABLES]
        ebc = EmbeddingBagCollection(tables, device=meta if how == "arguments" else None)
        dlrm = DLRM(ebc, 5, [6, 8], [4, 1], dense_device=meta if how == "arguments" else None)
        return DLRMTrain(dlrm)

    if how == "arguments":  # TorchRec's way: devices passed down
        model = build()
    else:  # torch's way: every tensor, buffers included, on the meta device
        with meta:
            model = build()
            model.seen = _Seen()  # a buffer no reset_parameters() fills
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dmp = DistributedModelParallel(model, device=torch.device("cpu"))
    guessed = [str(w.message) for w in caught if "meta device" in str(w.message)]
    if how == "arguments":
        assert not guessed
    else:  # named, with what to do; the interaction's buffers are not among them (its reset_parameters fills them)
        assert len(guessed) == 1 and "['seen.count']" in guessed[0] and "reset_parameters" in guessed[0], guessed
    # the interaction's pair indices are buffers derived from the feature count, not zeros
    fresh = InteractionArch(len(TABLES))
    for name, b in dmp.module.model.inter_arch.named_buffers():
        torch.testing.assert_close(b, fresh.get_buffer(name), rtol=0, atol=0, msg=name)
    assert not [n for n, p in dmp.named_parameters() if p.device.type == "meta"]
    dense = {k: v for k, v in dmp.state_dict().items() if "embedding_bag_collection" not in k and "seen." not in k}
    assert all(v.abs().sum() > 0 for v in dense.values()), "meta dense parameters were not initialised"
    gathered = [None] * world
    dist.all_gather_object(gathered, dense)
    for k in dense:
        torch.testing.assert_close(gathered[0][k], gathered[1][k])
    loss, _ = dmp(_batches(rank)[0])
    assert torch.isfinite(loss)


@pytest.mark.parametrize("how", ["arguments", "context"])
def test_dmp_materialises_a_meta_model(how: str) -> None:
    run_distributed(_meta_model, 2, how)


def _bf16_on_gloo(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match="'bf16' needs the NCCL backend"):
        DistributedModelParallel(
            _model(), data_parallel_wrapper=DefaultDataParallelWrapper(allreduce_comm_precision="bf16")
        )


def test_bf16_dense_gradients_on_gloo_are_refused_by_name() -> None:
    run_distributed(_bf16_on_gloo, 2)
