"""FusedPooledKernel + FusedOptimizer (updates inside backward) against independent plain-torch references.

The references never go through lightning_rec or fbgemm: every bag is built from Python lists and looked up
with ``F.embedding_bag(sparse=True)`` on copies of the initial weights, then stepped with ``torch.optim.SGD``,
``torch.optim.Adagrad`` or the row-wise Adagrad formula written out by hand.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F

from lightning_rec.fused_kinds import FBGEMM_CPU_KINDS
from lightning_rec.kernels import FusedPooledKernel
from lightning_rec.optim import CPU_KINDS, FusedOptimizer, FusedOptimizerSpec, as_spec

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")

# (name, rows, dim); features f0 and f1 share t0
TABLES = [("t0", 11, 4), ("t1", 7, 8), ("t2", 5, 12)]
FEATURES = [("f0", "t0"), ("f1", "t0"), ("f2", "t1"), ("f3", "t2")]
ROWS = {n: r for n, r, _ in TABLES}
DIMS = {n: d for n, _, d in TABLES}
B = 3
LR, EPS = 0.1, 1e-8
STEPS = 4


def make_batch(gen: torch.Generator) -> dict[str, tuple[list[list[int]], list[list[float]]]]:
    """Per feature: B bags of ids (duplicates, an empty bag) and their per-sample weights."""
    batch = {}
    for f, (name, t) in enumerate(FEATURES):
        bags, weights = [], []
        for b in range(B):
            n = 0 if (b + f) % 3 == 1 else int(torch.randint(1, 5, (1,), generator=gen))
            ids = torch.randint(0, ROWS[t], (n,), generator=gen).tolist()
            if b == 0:
                ids = ids + ids[:1]  # a duplicate id inside one bag
            bags.append(ids)
            weights.append((torch.rand(len(ids), generator=gen) + 0.5).tolist())
        batch[name] = (bags, weights)
    return batch


def pack(batch, features) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Feature-major values / offsets / per-sample weights for the given feature order."""
    values, offsets, psw = [], [0], []
    for name, _ in features:
        bags, weights = batch[name]
        for ids, w in zip(bags, weights):
            values += ids
            psw += w
            offsets.append(len(values))
    return torch.tensor(values, dtype=torch.long), torch.tensor(offsets), torch.tensor(psw)


def make_grads(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {name: torch.randn(B, DIMS[t], generator=gen) for name, t in FEATURES}


def initial_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(r, d, generator=gen) for n, r, d in TABLES}


class Reference:
    """Plain torch: F.embedding_bag(sparse=True) + torch optimizers / the row-wise Adagrad formula."""

    def __init__(self, weights: dict[str, torch.Tensor], kind: str, lr: float = LR, eps: float = EPS) -> None:
        self.kind, self.lr, self.eps = kind, lr, eps
        self.w = {n: w.clone().requires_grad_(True) for n, w in weights.items()}
        params = list(self.w.values())
        if kind == "sgd":
            self.opt = torch.optim.SGD(params, lr=lr)
        elif kind == "adagrad":
            self.opt = torch.optim.Adagrad(params, lr=lr, eps=eps, initial_accumulator_value=0.0)
        else:
            self.m = {n: torch.zeros(w.shape[0]) for n, w in weights.items()}

    def step(self, batch, grads, weighted: bool) -> dict[str, torch.Tensor]:
        outs = {}
        for name, t in FEATURES:
            bags, weights = batch[name]
            values = torch.tensor([i for bag in bags for i in bag], dtype=torch.long)
            offsets = torch.tensor([0] + [len(bag) for bag in bags]).cumsum(0)
            psw = torch.tensor([x for w in weights for x in w]) if weighted else None
            outs[name] = F.embedding_bag(
                values, self.w[t], offsets, mode="sum", per_sample_weights=psw, include_last_offset=True, sparse=True
            )
        loss = sum((outs[n] * grads[n]).sum() for n, _ in FEATURES)
        for w in self.w.values():
            w.grad = None
        loss.backward()
        if self.kind in ("sgd", "adagrad"):
            self.opt.step()
        else:
            with torch.no_grad():
                for n, w in self.w.items():
                    if w.grad is None:
                        continue
                    g = w.grad.coalesce()
                    rows, vals = g.indices()[0], g.values()  # g summed over duplicate ids
                    self.m[n][rows] += vals.pow(2).mean(1)
                    w[rows] -= self.lr * vals / (self.m[n][rows].sqrt() + self.eps)[:, None]
        return {n: o.detach() for n, o in outs.items()}

    def state(self, name: str) -> torch.Tensor | None:
        if self.kind == "adagrad":
            return self.opt.state[self.w[name]]["sum"]
        if self.kind == "rowwise_adagrad":
            return self.m[name]
        return None


def build(kind: str, weights: dict[str, torch.Tensor], tables=TABLES, features=FEATURES, lr: float = LR, **kw):
    index = {n: i for i, (n, _, _) in enumerate(tables)}
    kernel = FusedPooledKernel(
        [(n, r, d, torch.float32) for n, r, d in tables],
        [index[t] for _, t in features],
        FusedOptimizerSpec(kind, lr=lr, eps=EPS, **kw),
        weights=[weights[n] for n, _, _ in tables],
    )
    return kernel, FusedOptimizer(kernel)


def fused_step(kernel, opt, batch, grads, features=FEATURES, weighted=True, grad_scale=1.0) -> torch.Tensor:
    values, offsets, psw = pack(batch, features)
    out = kernel(values, offsets, psw if weighted else None, grad_scale=grad_scale)
    (out * torch.cat([grads[n] for n, _ in features], dim=1)).sum().backward()
    opt.step()
    return out.detach()


def table_weights(kernel) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in zip(kernel.table_names, kernel.tables())}


# --------------------------------------------------------------------------------------------------------
# numerics against the references
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("kind", FBGEMM_CPU_KINDS)  # the Adam family: tests/unit/test_fused_adam_cpu.py
def test_matches_torch_reference(kind, weighted):
    w0 = initial_weights()
    kernel, opt = build(kind, w0)
    ref = Reference(w0, kind)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        batch, grads = make_batch(gen), make_grads(gen)
        out = fused_step(kernel, opt, batch, grads, weighted=weighted)
        ref_out = ref.step(batch, grads, weighted)
        torch.testing.assert_close(out, torch.cat([ref_out[n] for n, _ in FEATURES], 1), atol=1e-5, rtol=1e-5)
        states = kernel.optimizer_states()
        for n, _, _ in TABLES:
            torch.testing.assert_close(
                table_weights(kernel)[n],
                ref.w[n].detach(),
                atol=1e-5,
                rtol=1e-5,
                msg=lambda m, step=step, n=n: f"{kind} step {step} table {n}: {m}",
            )
            expected = ref.state(n)
            if expected is None:
                assert states[n] == {}
            else:
                torch.testing.assert_close(states[n]["sum"], expected, atol=1e-5, rtol=1e-5)
    # the updates really happened (and the batch touched every table)
    for n in w0:
        assert not torch.equal(table_weights(kernel)[n], w0[n])


def test_fp16_tables_match_reference_within_fp16_precision():
    gen = torch.Generator().manual_seed(3)
    w0 = {n: w.half() for n, w in initial_weights().items()}
    kernel = FusedPooledKernel(
        [(n, r, d, torch.float16) for n, r, d in TABLES],
        [0, 0, 1, 2],
        {"kind": "sgd", "lr": LR, "stochastic_rounding": False},
        weights=list(w0.values()),
    )
    opt = FusedOptimizer(kernel)
    assert all(p.dtype == torch.float16 for p in kernel.tables())
    ref = Reference({n: w.float() for n, w in w0.items()}, "sgd")
    for _ in range(2):
        batch, grads = make_batch(gen), make_grads(gen)
        out = fused_step(kernel, opt, batch, grads)
        assert out.dtype == torch.float16
        ref.step(batch, grads, weighted=True)
    for n in w0:
        torch.testing.assert_close(table_weights(kernel)[n].float(), ref.w[n].detach(), atol=1e-2, rtol=1e-2)


def test_grad_scale_halves_the_sgd_update_but_not_the_weight_gradient():
    w0 = initial_weights()
    gen = torch.Generator().manual_seed(2)
    batch, grads = make_batch(gen), make_grads(gen)
    values, offsets, psw = pack(batch, FEATURES)
    g = torch.cat([grads[n] for n, _ in FEATURES], 1)
    deltas, psw_grads = [], []
    for scale in (1.0, 0.5):
        kernel, opt = build("sgd", w0)
        weights = psw.clone().requires_grad_(True)
        (kernel(values, offsets, weights, grad_scale=scale) * g).sum().backward()
        opt.step()
        deltas.append({n: table_weights(kernel)[n] - w0[n] for n in w0})
        psw_grads.append(weights.grad)
    for n in w0:
        assert deltas[0][n].abs().max() > 0
        torch.testing.assert_close(deltas[1][n], 0.5 * deltas[0][n], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(psw_grads[1], psw_grads[0])
    # and the weight gradient is the true one: sum_d grad * embedding, before the update
    expected = []
    for name, t in FEATURES:
        for b, ids in enumerate(batch[name][0]):
            for i in ids:
                expected.append((w0[t][i] * grads[name][b]).sum())
    torch.testing.assert_close(psw_grads[0], torch.stack(expected), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="grad_scale=0 with per_sample_weights that require grad"):
        kernel(values, offsets, psw.clone().requires_grad_(True), grad_scale=0.0)
    kernel(values, offsets, psw, grad_scale=0.0).sum().backward()  # fine when the weights need no gradient


def test_empty_batch_and_all_empty_bags():
    kernel, opt = build("rowwise_adagrad", initial_weights())
    before = table_weights(kernel)
    out = kernel(torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    assert out.shape == (0, kernel.total_dim)
    out.sum().backward()
    opt.step()
    out = kernel(torch.zeros(0, dtype=torch.long), torch.zeros(len(FEATURES) * B + 1, dtype=torch.long))
    assert torch.equal(out, torch.zeros(B, kernel.total_dim))
    out.sum().backward()
    opt.step()
    after = table_weights(kernel)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_no_update_without_backward_and_under_no_grad():
    kernel, opt = build("sgd", initial_weights())
    values, offsets, psw = pack(make_batch(torch.Generator().manual_seed(0)), FEATURES)
    before = table_weights(kernel)
    with torch.no_grad():
        out = kernel(values, offsets, psw)
    assert not out.requires_grad
    kernel(values, offsets)  # graph built but never backpropagated
    opt.step()
    assert all(torch.equal(before[n], table_weights(kernel)[n]) for n in before)


# --------------------------------------------------------------------------------------------------------
# parameters, state_dict, module isolation
# --------------------------------------------------------------------------------------------------------


def test_tables_are_leaf_views_of_the_kernel_storage():
    w0 = initial_weights()
    kernel, opt = build("sgd", w0)
    params = kernel.tables()
    assert [tuple(p.shape) for p in params] == [(r, d) for _, r, d in TABLES]
    for p in params:
        assert isinstance(p, torch.nn.Parameter) and p.is_leaf and not p.requires_grad
    # the module exposes the tables and nothing of fbgemm's (weights_host, momentum, buffers)
    assert [n for n, _ in kernel.named_parameters()] == ["t0.weight", "t1.weight", "t2.weight"]
    assert list(kernel.state_dict()) == ["t0.weight", "t1.weight", "t2.weight"]
    assert list(kernel.buffers()) == []
    sd = kernel.state_dict()
    assert all(sd[f"{n}.weight"].data_ptr() == p.data_ptr() for n, p in zip(kernel.table_names, params))
    held = [p.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(5)
    fused_step(kernel, opt, make_batch(gen), make_grads(gen))
    # the update is visible through the same Parameter objects and the earlier state_dict, without copying
    assert all(q is p for q, p in zip(kernel.tables(), params))
    for n, p, h in zip(kernel.table_names, params, held):
        assert not torch.equal(p, h)
        assert torch.equal(sd[f"{n}.weight"], p)
    # writes through a parameter reach the kernel
    with torch.no_grad():
        params[1].zero_()
    values, offsets, _ = pack(make_batch(gen), FEATURES)
    with torch.no_grad():
        out = kernel(values, offsets)
    assert torch.equal(out[:, 8:16], torch.zeros(B, 8))


def test_model_state_dict_loads_by_copy_including_dotted_names():
    tables = [("user.id", 6, 4, torch.float32), ("item", 5, 8, torch.float32)]
    a = FusedPooledKernel(tables, [0, 1], {"kind": "sgd", "lr": 0.1})
    b = FusedPooledKernel(tables, [0, 1], {"kind": "sgd", "lr": 0.1})
    assert list(a.state_dict()) == ["user.id.weight", "item.weight"]
    ptrs = [p.data_ptr() for p in b.tables()]
    b.load_state_dict(a.state_dict())  # strict
    assert all(torch.equal(p, q) for p, q in zip(a.tables(), b.tables()))
    b.load_state_dict({k: torch.zeros_like(v) for k, v in a.state_dict().items()}, assign=True)
    assert [p.data_ptr() for p in b.tables()] == ptrs  # still the kernel's storage
    with torch.no_grad():
        assert torch.equal(b(torch.tensor([1, 2]), torch.tensor([0, 1, 2])), torch.zeros(1, 12))
    with pytest.raises(RuntimeError, match="Unexpected key.*user.idx.weight"):
        b.load_state_dict({**a.state_dict(), "user.idx.weight": torch.zeros(6, 4)})
    with pytest.raises(RuntimeError, match=r"size mismatch for item.weight"):
        b.load_state_dict({"user.id.weight": torch.zeros(6, 4), "item.weight": torch.zeros(4, 8)})


def test_cannot_be_moved_or_converted_but_to_same_device_is_fine():
    kernel, _ = build("sgd", initial_weights())
    kernel.to("cpu")
    kernel.float()
    with pytest.raises(RuntimeError, match="cannot be moved or converted after construction.*'t0'.*float16"):
        kernel.half()
    with pytest.raises(RuntimeError, match="cannot be moved or converted"):
        kernel.to(torch.float64)
    kernel.tables()[0].data = torch.zeros(11, 4)
    values, offsets, _ = pack(make_batch(torch.Generator().manual_seed(0)), FEATURES)
    with pytest.raises(RuntimeError, match="table 't0' no longer shares storage"):
        kernel(values, offsets)


def test_deepcopy_is_independent_and_still_fused():
    gen = torch.Generator().manual_seed(4)
    kernel, opt = build("adagrad", initial_weights())
    fused_step(kernel, opt, make_batch(gen), make_grads(gen))
    twin = copy.deepcopy(kernel)
    twin_opt = FusedOptimizer(twin)
    batch, grads = make_batch(gen), make_grads(gen)
    fused_step(kernel, opt, batch, grads)
    fused_step(twin, twin_opt, batch, grads)
    for n in kernel.table_names:
        assert torch.equal(table_weights(kernel)[n], table_weights(twin)[n])
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(kernel.tables(), twin.tables()))
    assert torch.equal(twin.state_dict()["t1.weight"], twin.tables()[1])
    # a deep copy of the optimizer drives deep copies of its kernels
    opt_copy = copy.deepcopy(opt)
    (k_copy,) = opt_copy.kernels
    assert k_copy is not kernel and opt_copy.param_groups[0]["params"] == k_copy.tables()
    fused_step(k_copy, opt_copy, batch, grads)
    fused_step(kernel, opt, batch, grads)
    for n in kernel.table_names:
        assert torch.equal(table_weights(kernel)[n], table_weights(k_copy)[n])


# --------------------------------------------------------------------------------------------------------
# FusedOptimizer: torch.optim interface, learning rate, checkpoints
# --------------------------------------------------------------------------------------------------------


def test_is_a_torch_optimizer():
    kernel, opt = build("rowwise_adagrad", initial_weights())
    assert isinstance(opt, torch.optim.Optimizer)
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["lr"] == LR
    assert opt.param_groups[0]["params"] == kernel.tables()
    assert opt.defaults["lr"] == LR
    assert set(opt.state) == set(kernel.tables())
    assert opt.state[kernel.tables()[0]]["sum"].shape == (11,)
    opt.zero_grad()
    assert all(p.grad is None for p in kernel.tables())
    with pytest.raises(RuntimeError, match="one param group per FusedPooledKernel"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    loss = opt.step(lambda: torch.tensor(3.0))
    assert loss.item() == 3.0


def _sgd_delta(kernel, opt):
    """One fused SGD step on a fixed batch; returns (change of t0, plain gradient of t0 from the reference)."""
    gen = torch.Generator().manual_seed(7)
    batch, grads = make_batch(gen), make_grads(gen)
    before = table_weights(kernel)
    ref = Reference(before, "sgd", lr=1.0)  # lr = 1: the update is minus the gradient
    ref.step(batch, grads, weighted=True)
    grad = before["t0"] - ref.w["t0"].detach()
    fused_step(kernel, opt, batch, grads)
    return table_weights(kernel)["t0"] - before["t0"], grad


def test_lr_set_on_param_group_is_used_by_the_next_step():
    kernel, opt = build("sgd", initial_weights())
    opt.param_groups[0]["lr"] = 0.05
    opt.step()
    assert kernel.get_learning_rate() == 0.05
    delta, grad = _sgd_delta(kernel, opt)
    torch.testing.assert_close(delta, -0.05 * grad, atol=1e-6, rtol=1e-5)
    # and without a step in between: the kernel reads the group's lr at forward
    opt.param_groups[0]["lr"] = 0.2
    delta, grad = _sgd_delta(kernel, opt)
    torch.testing.assert_close(delta, -0.2 * grad, atol=1e-6, rtol=1e-5)
    # setting it on the kernel updates the group that owns it
    kernel.set_learning_rate(0.3)
    assert opt.param_groups[0]["lr"] == 0.3


def test_lr_scheduler_changes_the_kernel_learning_rate():
    kernel, opt = build("sgd", initial_weights(), lr=0.4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.25)
    gen = torch.Generator().manual_seed(8)
    batch, grads = make_batch(gen), make_grads(gen)

    def closure():  # Lightning's order: optimizer.step(closure) runs forward + backward inside step
        values, offsets, psw = pack(batch, FEATURES)
        out = kernel(values, offsets, psw)
        loss = (out * torch.cat([grads[n] for n, _ in FEATURES], 1)).sum()
        loss.backward()
        return loss

    opt.step(closure)
    sched.step()
    assert kernel.get_learning_rate() == pytest.approx(0.1)
    delta, grad = _sgd_delta(kernel, opt)
    torch.testing.assert_close(delta, -0.1 * grad, atol=1e-6, rtol=1e-5)
    sched.step()
    assert kernel.get_learning_rate() == pytest.approx(0.025)


@pytest.mark.parametrize("kind", CPU_KINDS)
def test_state_dict_round_trip_into_a_kernel_with_another_table_order(kind):
    gen = torch.Generator().manual_seed(9)
    a, opt_a = build(kind, initial_weights())
    for _ in range(2):
        fused_step(a, opt_a, make_batch(gen), make_grads(gen))
    opt_a.param_groups[0]["lr"] = 0.03
    model_sd = copy.deepcopy(a.state_dict())
    opt_sd = copy.deepcopy(opt_a.state_dict())
    assert opt_sd["param_groups"][0]["lr"] == 0.03 and opt_sd["param_groups"][0]["tables"] == ["t0", "t1", "t2"]
    assert set(opt_sd["tables"]) == {"t0", "t1", "t2"}

    tables_b = list(reversed(TABLES))
    features_b = [("f3", "t2"), ("f2", "t1"), ("f0", "t0"), ("f1", "t0")]
    b, opt_b = build(kind, initial_weights(seed=1), tables=tables_b, features=features_b)
    b.load_state_dict(model_sd)
    opt_b.load_state_dict(opt_sd)
    assert opt_b.param_groups[0]["lr"] == 0.03 and b.get_learning_rate() == 0.03
    for n, s in a.optimizer_states().items():
        for key, t in s.items():
            assert torch.equal(b.optimizer_states()[n][key], t)

    batch, grads = make_batch(gen), make_grads(gen)
    fused_step(a, opt_a, batch, grads)
    fused_step(b, opt_b, batch, grads, features=features_b)
    wa, wb = table_weights(a), table_weights(b)
    for n in wa:
        assert torch.equal(wa[n], wb[n]), n


def test_load_state_dict_refuses_other_tables_shapes_and_kinds():
    a, opt_a = build("rowwise_adagrad", initial_weights())
    sd = opt_a.state_dict()
    other = [("t0", 11, 4), ("t1", 9, 8), ("t2", 5, 12)]
    weights = {n: torch.zeros(r, d) for n, r, d in other}
    b, opt_b = build("rowwise_adagrad", weights, tables=other)
    before = copy.deepcopy(b.optimizer_states())
    with pytest.raises(
        ValueError, match=re.escape("table 't1': optimizer state 'sum' has shape (7,) in the checkpoint but (9,) here")
    ):
        opt_b.load_state_dict(sd)
    assert all(torch.equal(before[n]["sum"], b.optimizer_states()[n]["sum"]) for n in before)  # nothing half-loaded

    renamed = [("t0", 11, 4), ("t1", 7, 8), ("t9", 5, 12)]
    _, opt_c = build(
        "rowwise_adagrad",
        {n: torch.zeros(r, d) for n, r, d in renamed},
        tables=renamed,
        features=FEATURES[:3] + [("f3", "t9")],
    )
    with pytest.raises(
        ValueError, match=re.escape("missing from the checkpoint ['t9'], unexpected in the checkpoint ['t2']")
    ):
        opt_c.load_state_dict(sd)

    d, opt_d = build("adagrad", initial_weights())
    with pytest.raises(
        ValueError, match="table 't0': the checkpoint's fused optimizer is 'rowwise_adagrad' but this one is 'adagrad'"
    ):
        opt_d.load_state_dict(sd)
    with pytest.raises(ValueError, match="not a FusedOptimizer state_dict"):
        opt_d.load_state_dict({"state": {}, "param_groups": []})
    with pytest.raises(
        ValueError,
        match=re.escape("table 't0': optimizer state 'sum' has shape (11,) in the checkpoint but (11, 4) here"),
    ):
        d.load_optimizer_states(a.optimizer_states())


def test_two_kernels_in_one_optimizer():
    w0 = initial_weights()
    k1 = FusedPooledKernel([("t0", 11, 4, torch.float32)], [0, 0], {"kind": "sgd", "lr": 0.1}, weights=[w0["t0"]])
    k2 = FusedPooledKernel(
        [("t1", 7, 8, torch.float32)], [0], {"kind": "rowwise_adagrad", "lr": 0.2}, weights=[w0["t1"]]
    )
    opt = FusedOptimizer([k1, k2])
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.2]
    assert [g["kind"] for g in opt.param_groups] == ["sgd", "rowwise_adagrad"]
    sd = opt.state_dict()
    assert set(sd["tables"]) == {"t0", "t1"} and sd["tables"]["t0"] == {}
    opt.param_groups[1]["lr"] = 0.5
    opt.step()
    assert (k1.get_learning_rate(), k2.get_learning_rate()) == (0.1, 0.5)
    with pytest.raises(ValueError, match="table 't0' appears in kernels 0 and 1"):
        FusedOptimizer([k1, FusedPooledKernel([("t0", 3, 4, torch.float32)], [0], {"kind": "sgd", "lr": 0.1})])
    with pytest.raises(ValueError, match="same FusedPooledKernel twice"):
        FusedOptimizer([k1, k1])


def test_newer_optimizer_takes_over_the_kernel():
    kernel, old = build("sgd", initial_weights())
    new = FusedOptimizer(kernel)
    new.param_groups[0]["lr"] = 0.7
    assert kernel.get_learning_rate() == 0.7
    with pytest.raises(RuntimeError, match="no longer drives the kernel"):
        old.step()


# --------------------------------------------------------------------------------------------------------
# guards and errors
# --------------------------------------------------------------------------------------------------------


def _inputs():
    return pack(make_batch(torch.Generator().manual_seed(0)), FEATURES)


def test_double_backward_through_one_output_raises():
    kernel, opt = build("rowwise_adagrad", initial_weights())
    values, offsets, psw = _inputs()
    out = kernel(values, offsets, psw)
    out.sum().backward(retain_graph=True)
    after_first = table_weights(kernel)
    with pytest.raises(
        RuntimeError, match="backward ran a second time through the same FusedPooledKernel output.*cannot be honoured"
    ):
        out.sum().backward()
    assert all(torch.equal(after_first[n], table_weights(kernel)[n]) for n in after_first)
    opt.step()
    with pytest.raises(RuntimeError, match="backward ran a second time"):  # also after a step
        out.sum().backward()


def test_gradient_accumulation_without_step_raises():
    kernel, opt = build("adagrad", initial_weights())
    values, offsets, psw = _inputs()
    kernel(values, offsets, psw).sum().backward()
    after_first = table_weights(kernel)
    out = kernel(values, offsets, psw)
    with pytest.raises(
        RuntimeError,
        match=r"a second backward reached FusedPooledKernel before the optimizer step.*gradient accumulation",
    ):
        out.sum().backward()
    assert all(torch.equal(after_first[n], table_weights(kernel)[n]) for n in after_first)
    # two lookups through the kernel in one step, one backward: refused as well
    opt.step()
    with pytest.raises(RuntimeError, match="a second backward reached FusedPooledKernel"):
        (kernel(values, offsets) + kernel(values, offsets)).sum().backward()
    # after a step, training goes on
    opt.step()
    kernel(values, offsets, psw).sum().backward()
    opt.step()
    kernel(values, offsets, psw).sum().backward()
    kernel.finish_step()  # without a FusedOptimizer
    kernel(values, offsets, psw).sum().backward()


@pytest.mark.parametrize("kind", ["adam", "lamb", "partial_rowwise_adam", "partial_rowwise_lamb"])
def test_adam_family_runs_on_cpu(kind):
    # fbgemm has no CPU kernel for them: the torch update runs instead (tests/unit/test_fused_adam_cpu.py)
    spec = FusedOptimizerSpec(kind, lr=0.01, betas=(0.9, 0.99), weight_decay=0.01)
    assert spec.check_device("cpu") == torch.device("cpu")
    kernel = FusedPooledKernel([("t", 4, 4, torch.float32)], [0], spec)
    kernel(torch.tensor([1, 2]), torch.tensor([0, 2])).sum().backward()
    assert kernel.optimizer_iter == 1


def test_spec_validation():
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType

    assert FusedOptimizerSpec("sgd", 0.1).validate(torch.device("cpu")) == OptimType.EXACT_SGD
    assert FusedOptimizerSpec("adagrad", 0.1).validate("cpu") == OptimType.EXACT_ADAGRAD
    assert FusedOptimizerSpec("rowwise_adagrad", 0.1).validate(None) == OptimType.EXACT_ROWWISE_ADAGRAD
    assert FusedOptimizerSpec("adam", 0.1).validate("cuda") == OptimType.ADAM  # no CUDA needed to map it
    assert FusedOptimizerSpec("rowwise_adagrad", 0.1).eps == 1e-8
    with pytest.raises(
        ValueError,
        match=re.escape(
            "weight_decay=0.01 is not supported on device cpu: fbgemm's CPU kernels silently ignore weight decay"
        ),
    ):
        FusedOptimizerSpec("rowwise_adagrad", 0.1, weight_decay=0.01).validate("cpu")
    with pytest.raises(ValueError, match="weight_decay=0.01 is not supported on device cpu"):
        FusedPooledKernel(
            [("t", 4, 4, torch.float32)], [0], {"kind": "rowwise_adagrad", "lr": 0.1, "weight_decay": 0.01}
        )
    with pytest.raises(ValueError, match=re.escape("unknown fused optimizer kind 'adamw'; expected one of")):
        FusedOptimizerSpec("adamw", 0.1)
    with pytest.raises(ValueError, match="'sgd' has no betas"):
        FusedOptimizerSpec("sgd", 0.1, betas=(0.9, 0.99))
    with pytest.raises(ValueError, match="'adagrad' does not support weight_decay"):
        FusedOptimizerSpec("adagrad", 0.1, weight_decay=0.1)
    with pytest.raises(ValueError, match="lr must be a finite number >= 0"):
        FusedOptimizerSpec("sgd", -1.0)
    with pytest.raises(ValueError, match="cannot run on device meta"):
        FusedOptimizerSpec("sgd", 0.1).validate("meta")


def test_as_spec():
    spec = FusedOptimizerSpec("rowwise_adagrad", 0.1)
    assert as_spec(spec) is spec
    assert as_spec(None) is None
    assert as_spec({"kind": "rowwise_adagrad", "lr": 0.1}) == spec
    with pytest.raises(ValueError, match=r"unknown fused optimizer options \['momentum'\]"):
        as_spec({"kind": "sgd", "lr": 0.1, "momentum": 0.9})
    with pytest.raises(ValueError, match=r"need \['lr'\]"):
        as_spec({"kind": "sgd"})
    with pytest.raises(TypeError, match="expected a FusedOptimizerSpec"):
        as_spec("sgd")


SGD = {"kind": "sgd", "lr": 0.1}


@pytest.mark.parametrize(
    "tables, feature_table, message",
    [
        ([("a", 4, 4, torch.bfloat16)], [0], "table 'a': bfloat16 tables are not supported by the fused kernel"),
        (
            [("a", 4, 4, torch.float32), ("b", 4, 6, torch.float32)],
            [0, 1],
            "table 'b': embedding dim 6 is not supported by the fused fbgemm kernel, which needs a positive multiple of 4",
        ),
        ([("a", 0, 4, torch.float32)], [0], "table 'a': the fused kernel needs at least one row, got rows=0"),
        ([("a", 4, 4, torch.float64)], [0], "table 'a': dtype torch.float64 is not supported"),
        ([("a", 4, 4, torch.float32), ("b", 4, 4, torch.float16)], [0, 1], "one fused kernel needs one dtype"),
        ([("a", 4, 4, torch.float32), ("a", 4, 4, torch.float32)], [0, 1], "table name 'a' is used twice"),
        (
            [("a", 4, 4, torch.float32), ("b", 4, 4, torch.float32)],
            [0, 1, 0],
            (
                "feature_table must be non-decreasing (features grouped by table, in table order), got [0, 1, 0]: "
                "feature 2 (table 'a') comes after feature 1 (table 'b')"
            ),
        ),
        ([("a", 4, 4, torch.float32), ("b", 4, 4, torch.float32)], [1, 0], "feature_table must be non-decreasing"),
        ([("a", 4, 4, torch.float32), ("b", 4, 4, torch.float32)], [0, 0], "tables ['b'] have no feature"),
        ([("a", 4, 4, torch.float32)], [0, 1], "feature 1 maps to table index 1, outside [0, 0]"),
        ([], [0], "needs at least one table"),
    ],
)
def test_construction_errors(tables, feature_table, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        FusedPooledKernel(tables, feature_table, SGD)


def test_initial_weights_are_checked_and_default_init_is_not_zero():
    with pytest.raises(ValueError, match=re.escape("table 'a': initial weight has shape (4, 8), expected (4, 4)")):
        FusedPooledKernel([("a", 4, 4, torch.float32)], [0], SGD, weights=[torch.zeros(4, 8)])
    kernel = FusedPooledKernel([("a", 100, 4, torch.float32)], [0], SGD)
    w = kernel.tables()[0]
    assert w.abs().max() > 0 and w.abs().max() <= 0.1  # +-sqrt(1/rows)


@pytest.mark.parametrize(
    "values, message",
    [
        (
            [1, -1, 2],
            "feature 0 (table 'a') has id -1, outside the valid range [0, 3] (num_embeddings=4) (-1 is usually padding",
        ),
        ([1, 2, 5], "feature 1 (table 'b') has id 5, outside the valid range [0, 4]"),
    ],
)
def test_bad_ids_are_refused_before_the_kernel(values, message):
    kernel = FusedPooledKernel([("a", 4, 4, torch.float32), ("b", 5, 4, torch.float32)], [0, 1], SGD)
    before = table_weights(kernel)
    with pytest.raises(ValueError, match=re.escape(message)):
        kernel(torch.tensor(values), torch.tensor([0, 2, 3]))
    assert all(torch.equal(before[n], table_weights(kernel)[n]) for n in before)


def test_bad_offsets_and_weights_are_refused():
    kernel = FusedPooledKernel([("a", 4, 4, torch.float32), ("b", 5, 4, torch.float32)], [0, 1], SGD)
    values = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="offsets has 4 entries; expected features \\* batch \\+ 1 with 2 features"):
        kernel(values, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="offsets must start at 0, never decrease and end at the number of ids"):
        kernel(values, torch.tensor([0, 2, 1, 3, 3]))
    with pytest.raises(ValueError, match="offsets must start at 0"):
        kernel(values, torch.tensor([0, 1, 2, 2, 2]))
    with pytest.raises(ValueError, match="per_sample_weights must be 1-D with one weight per id"):
        kernel(values, torch.tensor([0, 1, 2, 3, 3]), torch.ones(2))


# --------------------------------------------------------------------------------------------------------
# Lightning drives it like any optimizer
# --------------------------------------------------------------------------------------------------------


def _lightning_module(seed: int):
    import lightning.pytorch as pl

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            w = initial_weights(seed)
            self.emb = FusedPooledKernel(
                [("t0", 11, 4, torch.float32), ("t1", 7, 8, torch.float32)],
                [0, 0, 1],
                {"kind": "rowwise_adagrad", "lr": 0.5},
                weights=[w["t0"], w["t1"]],
            )
            self.register_buffer("target", torch.randn(1, 16, generator=torch.Generator().manual_seed(0)))

        def training_step(self, batch, batch_idx):
            values, offsets = batch
            return (self.emb(values, offsets) - self.target).pow(2).mean()

        def configure_optimizers(self):
            opt = FusedOptimizer(self.emb)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Model()


def _fit(model, max_steps, tmp_path, ckpt_path=None, **kw):
    import lightning.pytorch as pl

    # one batch, repeated: a resumed fit restarts the (non-resumable) epoch from its first batch
    values = torch.randint(0, 7, (7,), generator=torch.Generator().manual_seed(11))
    batches = [(values, torch.tensor([0, 2, 3, 3, 5, 6, 7]))] * 6  # 3 features x batch 2, one empty bag
    trainer = pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        **kw,
    )
    trainer.fit(model, torch.utils.data.DataLoader(batches, batch_size=None), ckpt_path=ckpt_path)
    return trainer


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lightning_fit_schedule_checkpoint_resume(tmp_path):
    straight = _lightning_module(0)
    _fit(straight, 5, tmp_path)
    assert straight.emb.get_learning_rate() == pytest.approx(0.5 * 0.5**5)

    first = _lightning_module(0)
    trainer = _fit(first, 3, tmp_path)
    ckpt = str(tmp_path / "fused.ckpt")
    trainer.save_checkpoint(ckpt)
    resumed = _lightning_module(1)  # other initial weights: everything must come from the checkpoint
    _fit(resumed, 5, tmp_path, ckpt_path=ckpt)
    assert resumed.emb.get_learning_rate() == pytest.approx(straight.emb.get_learning_rate())
    for p, q in zip(straight.emb.tables(), resumed.emb.tables()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6)
    for n, s in straight.emb.optimizer_states().items():
        torch.testing.assert_close(s["sum"], resumed.emb.optimizer_states()[n]["sum"], atol=1e-6, rtol=1e-6)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lightning_gradient_accumulation_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match="gradient accumulation"):
        _fit(_lightning_module(0), 3, tmp_path, accumulate_grad_batches=2)


def test_fused_tables_hold_several_kernels_under_the_usual_keys():
    from lightning_rec.kernels import FusedTables

    sgd = {"kind": "sgd", "lr": 0.1}
    shards = FusedPooledKernel([("b.x", 3, 4, torch.float32)], [0], sgd)
    replicated = FusedPooledKernel([("a", 5, 8, torch.float32), ("c", 2, 4, torch.float32)], [0, 1], sgd)
    holder = torch.nn.Module()
    holder.embedding_bags = FusedTables([shards, replicated], ["a", "b.x", "c"])
    state = holder.state_dict()
    assert list(state) == ["embedding_bags.a.weight", "embedding_bags.b.x.weight", "embedding_bags.c.weight"]
    assert state["embedding_bags.b.x.weight"].data_ptr() == shards.tables()[0].data_ptr()
    new = {k: torch.full_like(v, 0.5) for k, v in state.items()}
    holder.load_state_dict(new)  # strict, dotted table name included; copies into the kernels' storage
    assert torch.equal(shards.tables()[0], torch.full((3, 4), 0.5)) and torch.equal(
        replicated.tables()[1], torch.full((2, 4), 0.5)
    )
    with pytest.raises(RuntimeError, match='Unexpected key.*"embedding_bags.zz.weight"'):
        holder.load_state_dict({**new, "embedding_bags.zz.weight": torch.zeros(1)})
    with pytest.raises(RuntimeError, match=r"cannot be moved or converted after construction \(table 'b.x'"):
        holder.half()
    holder.to("cpu")  # same device: fine
    assert all(not p.requires_grad for p in holder.parameters()) and len(list(holder.parameters())) == 3
