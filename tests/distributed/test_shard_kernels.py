"""Sharded lookups honour the plan's per-table ``compute_kernel``.

Every sharding type, SUM and MEAN, weighted or not, with ``compute_kernel="fbgemm"`` at 2 processes, is
compared with an independent single-process reference (``F.embedding_bag`` on full tables, SGD on the sum of
every rank's loss), forward and after SGD steps. Other tests show the fbgemm op really runs (its calls are
counted), that mixed kernels on one rank agree too, and that a table fbgemm cannot serve raises naming it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_rec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    PoolingType,
    kernels,
)
from lightning_rec.kernels import _capability, _grouped
from lightning_rec.plans.mesh import init_2d_mesh
from lightning_rec.sharding import (
    ShardingPlan,
    column_wise,
    data_parallel,
    full_state_dict,
    grid_shard,
    row_wise,
    shard_modules,
    sharded_collections,
    table_row_wise,
    table_wise,
)
from lightning_rec.testing import run_distributed
from tests.fbgemm_marks import needs_fbgemm

_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
WS = 2
STEPS = 3
LR = 0.1

# (sharding type, placement for a table of the given index, local_size)
PLACEMENTS = {
    "table_wise": (lambda i, k: table_wise(i % WS, compute_kernel=k), WS),
    "row_wise": (lambda i, k: row_wise([2, 5] if i % 2 else None, compute_kernel=k), WS),
    "column_wise": (lambda i, k: column_wise([i % WS, (i + 1) % WS], compute_kernel=k), WS),
    "table_row_wise": (lambda i, k: table_row_wise(0, compute_kernel=k), WS),
    "grid_shard": (lambda i, k: grid_shard([0, 1], compute_kernel=k), 1),
    "data_parallel": (lambda i, k: data_parallel(compute_kernel=k), WS),
}


def _tables(dtype: torch.dtype = torch.float32) -> list[EmbeddingBagConfig]:
    # SUM and MEAN tables; one table read by two features; widths that column shards split evenly
    return [
        EmbeddingBagConfig(
            name="sum.t", num_embeddings=11, embedding_dim=4, feature_names=["a", "b"], pooling="sum", dtype=dtype
        ),
        EmbeddingBagConfig(
            name="mean t", num_embeddings=7, embedding_dim=6, feature_names=["c"], pooling="mean", dtype=dtype
        ),
    ]


def _batch(tables, rank: int, step: int, weighted: bool) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    b = 3 + rank  # batch sizes differ across ranks
    keys, lengths, values = [], [], []
    for t in tables:
        for f in t.feature_names:
            lens = torch.randint(0, 4, (b,), generator=g)
            lens[0] = 2  # never an all-empty batch: the fbgemm path must run
            keys.append(f)
            lengths.append(lens)
            values.append(torch.randint(0, t.num_embeddings, (int(lens.sum()),), generator=g))
    v = torch.cat(values)
    w = torch.rand(v.numel(), generator=g) + 0.5 if weighted else None
    return KeyedJaggedTensor(keys, v, weights=w, lengths=torch.cat(lengths), stride=b)


def _coeff(rank: int, step: int, shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(77 + 10 * step + rank))


def _reference(tables, weights: dict[str, torch.Tensor], kjt: KeyedJaggedTensor) -> torch.Tensor:
    """Plain torch on full tables: per feature ``F.embedding_bag`` SUM; MEAN divides by the bag length."""
    outs = []
    jts = kjt.to_dict()
    for t in tables:
        for f in t.feature_names:
            jt = jts[f]
            psw = jt.weights() if kjt.weights_or_none() is not None else None
            out = F.embedding_bag(
                jt.values(), weights[t.name], jt.offsets(), mode="sum", per_sample_weights=psw, include_last_offset=True
            )
            if t.pooling == PoolingType.MEAN:
                out = out / jt.lengths().clamp(min=1).unsqueeze(1).to(out.dtype)
            outs.append(out)
    return torch.cat(outs, dim=1)


def _train_beside_reference(
    sharded, tables, ref_w: dict[str, torch.Tensor], rank: int, ws: int, weighted: bool, rank_weight: float = 1.0
) -> tuple[float, dict[str, float]]:
    """STEPS of SGD on the sharded collection (this rank's loss) and on the fp32 reference tables (every rank's
    loss, times ``rank_weight``): the largest forward gap on this rank's batches, and each table's largest gap
    after training."""
    opt = torch.optim.SGD(sharded.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref_w.values(), lr=LR)
    worst = 0.0
    for step in range(STEPS):
        out = sharded(_batch(tables, rank, step, weighted)).values()
        ref_total = 0.0
        for r in range(ws):
            ref = _reference(tables, ref_w, _batch(tables, r, step, weighted))
            if r == rank:
                worst = max(worst, float((out.detach().float() - ref.detach()).abs().max()))
            ref_total = ref_total + rank_weight * (ref * _coeff(r, step, ref.shape)).sum()
        (out.float() * _coeff(rank, step, out.shape)).sum().backward()
        opt.step()
        opt.zero_grad()
        ref_total.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    state = full_state_dict(sharded)
    diffs = {
        t.name: float((state[f"embedding_bags.{t.name}.weight"].float() - ref_w[t.name].detach()).abs().max())
        for t in tables
    }
    return worst, diffs


def _equivalence_job(rank: int, ws: int, kinds: list[str], kernel: str) -> dict:
    worst, calls = {}, 0
    op_name = "split_embedding_codegen_forward_cpu"  # the op the fbgemm kernel runs on CPU (kernels/_dense_tbe.py)
    _capability.load_fbgemm()
    real_op = getattr(torch.ops.fbgemm, op_name)

    def counting(*args, **kw):
        nonlocal calls
        calls += 1
        return real_op(*args, **kw)

    setattr(torch.ops.fbgemm, op_name, counting)
    try:
        for kind in kinds:
            place, local = PLACEMENTS[kind]
            for weighted in (False, True):
                tables = _tables()
                torch.manual_seed(5)
                ebc = EmbeddingBagCollection(tables, is_weighted=weighted, kernel="torch")
                ref_w = {t.name: ebc.embedding_bags[t.name].weight.detach().clone().requires_grad_() for t in tables}
                plan = ShardingPlan({"": {t.name: place(i, kernel) for i, t in enumerate(tables)}})
                sharded = shard_modules(ebc, plan, local_size=local)
                assert set(sharded.lookup_kernels.values()) == {kernel}
                forward, tables_err = _train_beside_reference(sharded, tables, ref_w, rank, ws, weighted)
                worst[(kind, weighted)] = max(forward, *tables_err.values())
    finally:
        setattr(torch.ops.fbgemm, op_name, real_op)
    return dict(worst=worst, calls=calls)


@pytest.mark.parametrize(
    "kinds", [["table_wise", "row_wise", "column_wise"], ["table_row_wise", "grid_shard", "data_parallel"]]
)
def test_fbgemm_kernel_matches_reference_for_every_sharding_type(kinds: list[str]) -> None:
    for res in run_distributed(_equivalence_job, WS, kinds, "fbgemm"):
        for key, err in res["worst"].items():
            assert err <= 1e-5, (key, err)
        assert res["calls"] > 0


def _count_job(rank: int, ws: int, plan_kernel: str | None, module_kernel: str) -> dict:
    """Count fbgemm op calls and torch-kernel calls of one forward + backward."""
    counts = {"fbgemm": 0, "torch": 0}
    op_name = "split_embedding_codegen_forward_cpu"  # the op the fbgemm kernel runs on CPU (kernels/_dense_tbe.py)
    _capability.load_fbgemm()
    real_op, real_torch = getattr(torch.ops.fbgemm, op_name), _grouped.torch_pooled

    def count(name, fn):
        def wrapped(*args, **kw):
            counts[name] += 1
            return fn(*args, **kw)

        return wrapped

    setattr(torch.ops.fbgemm, op_name, count("fbgemm", real_op))
    _grouped.torch_pooled = count("torch", real_torch)
    try:
        tables = _tables()
        ebc = EmbeddingBagCollection(tables, kernel=module_kernel)
        plan = ShardingPlan(
            {"": {"sum.t": row_wise(compute_kernel=plan_kernel), "mean t": data_parallel(compute_kernel=plan_kernel)}}
        )
        sharded = shard_modules(ebc, plan)
        out = sharded(_batch(tables, rank, 0, False)).values()
        out.sum().backward()
        grads = all(p.grad is not None and p.grad.abs().sum() > 0 for p in sharded.parameters())
        return dict(counts=counts, kernels=sharded.lookup_kernels, grads=grads)
    finally:
        setattr(torch.ops.fbgemm, op_name, real_op)
        _grouped.torch_pooled = real_torch


@pytest.mark.parametrize(
    ("plan_kernel", "module_kernel", "want"),
    [
        ("fbgemm", "torch", "fbgemm"),  # the plan wins over the collection's setting
        ("torch", "fbgemm", "torch"),
        (None, "fbgemm", "fbgemm"),  # None: the collection's kernel setting
        ("auto", "auto", "torch"),  # resolve_kernel's choice: torch on CPU (measured faster)
    ],
)
def test_planned_kernel_is_the_one_that_runs(plan_kernel, module_kernel, want) -> None:
    for res in run_distributed(_count_job, WS, plan_kernel, module_kernel):
        assert set(res["kernels"].values()) == {want}
        other = "torch" if want == "fbgemm" else "fbgemm"
        assert res["counts"][want] == 2 and res["counts"][other] == 0, res["counts"]  # shards, then replicas
        assert res["grads"]


def _mixed_job(rank: int, ws: int) -> dict:
    """fbgemm and torch tables (fp32 and fp16 fbgemm groups) side by side on one rank, sharded and replicated."""
    tables = [
        EmbeddingBagConfig(name="a", num_embeddings=9, embedding_dim=4, feature_names=["fa"]),
        EmbeddingBagConfig(name="b", num_embeddings=6, embedding_dim=3, feature_names=["fb1", "fb2"], pooling="mean"),
        EmbeddingBagConfig(name="c", num_embeddings=5, embedding_dim=2, feature_names=["fc"]),
        EmbeddingBagConfig(name="d", num_embeddings=8, embedding_dim=4, feature_names=["fd"], dtype=torch.float16),
        EmbeddingBagConfig(name="e", num_embeddings=4, embedding_dim=2, feature_names=["fe"]),
        EmbeddingBagConfig(name="f", num_embeddings=4, embedding_dim=2, feature_names=["ff"]),
    ]
    torch.manual_seed(3)
    ebc = EmbeddingBagCollection(tables, is_weighted=True, kernel="torch")
    ref_w = {t.name: ebc.embedding_bags[t.name].weight.detach().float().clone().requires_grad_() for t in tables}
    plan = ShardingPlan(
        {
            "": {
                "a": row_wise(compute_kernel="fbgemm"),
                "b": row_wise(compute_kernel="torch"),
                "c": row_wise(compute_kernel="fbgemm"),
                "d": row_wise(compute_kernel="fbgemm"),
                "e": data_parallel(compute_kernel="fbgemm"),
                "f": data_parallel(compute_kernel="torch"),
            }
        }
    )
    sharded = shard_modules(ebc, plan)
    assert sharded.lookup_kernels == {
        "a": "fbgemm",
        "b": "torch",
        "c": "fbgemm",
        "d": "fbgemm",
        "e": "fbgemm",
        "f": "torch",
    }
    forward, diffs = _train_beside_reference(sharded, tables, ref_w, rank, ws, True)
    return dict(forward=forward, tables=diffs)


@needs_fbgemm
def test_mixed_kernels_on_one_rank_match_reference() -> None:
    for res in run_distributed(_mixed_job, WS):
        assert res["forward"] <= 5e-3  # table "d" is fp16: its pooled rows carry fp16 rounding
        for name, diff in res["tables"].items():
            assert diff <= (5e-3 if name == "d" else 1e-5), (name, diff)


def _refusal_job(rank: int, ws: int) -> list[str]:
    msgs = []
    cases = [
        (
            EmbeddingBagCollection(
                [EmbeddingBagConfig(name="bf.tab", num_embeddings=4, embedding_dim=4, dtype=torch.bfloat16)]
            ),
            row_wise(compute_kernel="fbgemm"),
        ),
        (
            EmbeddingBagCollection(
                [EmbeddingBagConfig(name="sparse tab", num_embeddings=4, embedding_dim=4)], sparse_grad=True
            ),
            table_wise(0, compute_kernel="fbgemm"),
        ),
        (
            EmbeddingCollection([EmbeddingConfig(name="seq tab", num_embeddings=4, embedding_dim=4)]),
            row_wise(compute_kernel="fbgemm"),
        ),
        (
            EmbeddingBagCollection(
                [EmbeddingBagConfig(name="dp tab", num_embeddings=4, embedding_dim=4, dtype=torch.bfloat16)]
            ),
            data_parallel(compute_kernel="fbgemm"),
        ),
    ]
    for module, placement in cases:
        name = (
            module.embedding_bag_configs()[0].name
            if hasattr(module, "embedding_bag_configs")
            else module.embedding_configs()[0].name
        )
        try:
            shard_modules(module, ShardingPlan({"": {name: placement}}))
        except ValueError as e:
            msgs.append(str(e))
        else:
            msgs.append("no error")
    return msgs


def test_fbgemm_on_tables_it_cannot_serve_raises_naming_the_table() -> None:
    for msgs in run_distributed(_refusal_job, WS):
        assert "'bf.tab'" in msgs[0] and "bfloat16" in msgs[0] and "compute_kernel='fbgemm'" in msgs[0]
        assert "'sparse tab'" in msgs[1] and "sparse_grad" in msgs[1]
        assert "'seq tab'" in msgs[2] and "sequence" in msgs[2]
        assert "'dp tab'" in msgs[3]


def _convert_job(rank: int, ws: int) -> str:
    """A conversion to a dtype fbgemm cannot serve raises before converting and leaves the module usable."""
    tables = _tables()
    sharded = shard_modules(
        EmbeddingBagCollection(tables), ShardingPlan({"": {t.name: row_wise(compute_kernel="fbgemm") for t in tables}})
    )
    try:
        sharded.to(torch.bfloat16)
    except ValueError as e:
        msg = str(e)
    else:
        msg = "no error"
    dtypes = {p.dtype for p in sharded.parameters()}
    sharded(_batch(tables, rank, 0, False)).values().sum().backward()
    assert dtypes == {torch.float32}
    half = sharded.half()  # fp16 is served: the lookups follow
    assert set(half.lookup_kernels.values()) == {"fbgemm"}
    half(_batch(tables, rank, 1, False))
    assert next(iter(sharded_collections(half)))[1] is half
    return msg


@needs_fbgemm
def test_conversion_fbgemm_cannot_serve_raises_and_keeps_the_module() -> None:
    for msg in run_distributed(_convert_job, WS):
        assert "'sum.t'" in msg and "bfloat16" in msg


def _cuda_job(rank: int, ws: int, kernel: str) -> dict:
    tables = _tables()
    torch.manual_seed(5)
    ebc = EmbeddingBagCollection(tables, is_weighted=True, kernel="torch")
    ref_w = {t.name: ebc.embedding_bags[t.name].weight.detach().clone() for t in tables}
    plan = ShardingPlan(
        {"": {"sum.t": row_wise(compute_kernel=kernel), "mean t": data_parallel(compute_kernel=kernel)}}
    )
    sharded = shard_modules(ebc, plan, device="cuda")
    kjt = _batch(tables, rank, 0, True)
    out = sharded(kjt.to(sharded.device)).values()
    ref = _reference(tables, ref_w, kjt)
    fbgemm_cuda = kernels.has_fbgemm_op(kernels.DENSE_LOOKUP_OP, "cuda")
    return dict(
        err=float((out.detach().cpu() - ref).abs().max()), kernels=sharded.lookup_kernels, fbgemm_cuda=fbgemm_cuda
    )


@pytest.mark.gpu
@_CUDA
@pytest.mark.parametrize("kernel", ["fbgemm", "auto"])
def test_cuda_kernels_match_reference(kernel: str) -> None:
    # "auto" is fbgemm on CUDA where the installed build has the op, else the torch kernel after one warning
    for res in run_distributed(_cuda_job, WS, kernel):
        assert res["err"] <= 1e-5
        want = "fbgemm" if res["fbgemm_cuda"] else "torch"
        assert set(res["kernels"].values()) == {want}


def _two_d_job(rank: int, ws: int, embedding_grad: str) -> float:
    """2 replicas x 2-way model parallel: shard gradients are summed over replicas before fbgemm's tables step."""
    mesh = init_2d_mesh(2)
    tables = _tables()
    torch.manual_seed(5)
    ebc = EmbeddingBagCollection(tables, is_weighted=True, kernel="torch")
    ref_w = {t.name: ebc.embedding_bags[t.name].weight.detach().clone().requires_grad_() for t in tables}
    plan = ShardingPlan({"": {"sum.t": row_wise(compute_kernel="fbgemm"), "mean t": data_parallel("fbgemm")}})
    sharded = shard_modules(
        ebc, plan, process_group=mesh.shard_group, replica_group=mesh.replica_group, embedding_grad=embedding_grad
    )
    assert set(sharded.lookup_kernels.values()) == {"fbgemm"}
    rank_weight = 1.0 if embedding_grad == "sum" else 1.0 / ws
    forward, diffs = _train_beside_reference(sharded, tables, ref_w, rank, ws, True, rank_weight)
    return max(forward, *diffs.values())


@needs_fbgemm
def test_fbgemm_kernel_under_2d_replicas_matches_reference() -> None:
    # "mean": the replica reduction and the 1 / data-parallel-ranks scale both act on fbgemm-looked-up shards
    for worst in run_distributed(_two_d_job, 4, "mean"):
        assert worst <= 1e-5
