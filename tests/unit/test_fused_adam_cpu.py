"""The Adam family as fused optimizers on CPU (kernels/_torch_adam.py) against independent references.

fbgemm's CPU build has no Adam / LAMB kernels, so on CPU these kinds apply fbgemm's CUDA rule written in torch
(``fbgemm_gpu/codegen/genscript/optimizers.py``). The references here never go through lightning_rec:
``torch.optim.SparseAdam`` on ``F.embedding_bag(sparse=True)`` for ``adam``, and for every kind the rule written
out row by row in float64 on dense copies of the tables.
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
import torch.nn.functional as F

from lightning_rec.fused_kinds import FUSED_KINDS, TORCH_CPU_KINDS, FusedOptimizerSpec
from lightning_rec.kernels import FusedPooledKernel
from lightning_rec.kernels._torch_adam import TorchAdamTBE
from lightning_rec.optim import FusedOptimizer

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")

# (name, rows, dim); f0 and f1 share t0; t2 is wider (a second block of one width)
TABLES = [("t0", 9, 4), ("t1", 7, 4), ("t2", 5, 8)]
FEATURE_TABLE = [0, 0, 1, 2]
B = 3
BETAS = (0.8, 0.95)


def _weights(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(r, d, generator=g) * 0.2 - 0.1 for _, r, d in TABLES]


def _batch(g: torch.Generator, weighted: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Feature-major ids with repeats inside and across bags; every table read (SparseAdam steps only tables
    with a gradient, fbgemm's counter counts every step: they agree when every step reads every table)."""
    values, offsets = [], [0]
    for f, t in enumerate(FEATURE_TABLE):
        rows = TABLES[t][1]
        for b in range(B):
            n = 0 if (b + f) % 4 == 3 else int(torch.randint(1, 5, (1,), generator=g))
            ids = torch.randint(0, rows, (n,), generator=g).tolist()
            if b == 0:
                ids += ids[:1] + [rows - 1]  # a repeat inside the bag, and the last row
            values += ids
            offsets.append(len(values))
    v = torch.tensor(values, dtype=torch.long)
    return v, torch.tensor(offsets), (torch.rand(v.numel(), generator=g) + 0.5) if weighted else None


def _kernel(kind: str, lr: float = 0.01, weight_decay: float = 0.0, eps: float = 1e-8, tables=TABLES, ft=FEATURE_TABLE):
    kernel = FusedPooledKernel(
        [(n, r, d, torch.float32) for n, r, d in tables],
        ft,
        FusedOptimizerSpec(kind, lr=lr, eps=eps, betas=BETAS, weight_decay=weight_decay),
        weights=_weights() if tables is TABLES else None,
    )
    return kernel, FusedOptimizer(kernel)


def _embedding_bags(weights, values, offsets, psw, sparse: bool) -> torch.Tensor:
    outs = []
    for f, t in enumerate(FEATURE_TABLE):
        lo, hi = int(offsets[f * B]), int(offsets[(f + 1) * B])
        outs.append(
            F.embedding_bag(
                values[lo:hi],
                weights[t],
                offsets[f * B : (f + 1) * B + 1] - lo,
                mode="sum",
                per_sample_weights=None if psw is None else psw[lo:hi],
                include_last_offset=True,
                sparse=sparse,
            )
        )
    return torch.cat(outs, 1)


class RuleReference:
    """fbgemm's Adam / LAMB rule (optimizers.py in fbgemm_gpu's codegen), row by row in float64 on dense copies:
    only rows the batch reads are updated, each once, from its gradient summed over the batch."""

    def __init__(self, kind: str, weight_decay: float, eps: float = 1e-8) -> None:
        self.kind, self.wd, self.eps = kind, weight_decay, eps
        self.rowwise = kind.startswith("partial_rowwise")
        self.lamb = kind.endswith("lamb")
        self.w = [w.double() for w in _weights()]
        self.m = [torch.zeros_like(w) for w in self.w]
        self.v = [torch.zeros(w.shape[0] if self.rowwise else w.shape, dtype=torch.float64) for w in self.w]
        self.t = 0

    def step(self, values, offsets, psw, grad_out, lr: float) -> torch.Tensor:
        self.t += 1
        leaves = [w.clone().requires_grad_(True) for w in self.w]
        out = _embedding_bags(leaves, values, offsets, None if psw is None else psw.double(), sparse=False)
        (out * grad_out.double()).sum().backward()
        b1, b2 = BETAS
        for t, (w, leaf) in enumerate(zip(self.w, leaves)):
            read = {int(values[i]) for f, ft in enumerate(FEATURE_TABLE) if ft == t
                    for i in range(int(offsets[f * B]), int(offsets[(f + 1) * B]))}  # fmt: skip
            for row in sorted(read):
                g = leaf.grad[row]
                m = self.m[t][row] = b1 * self.m[t][row] + (1 - b1) * g
                if self.rowwise:
                    self.v[t][row] = b2 * self.v[t][row] + (1 - b2) * (g * g).mean()
                    v_hat = self.v[t][row] / (1 - b2**self.t)
                    r = (m / (1 - b1**self.t)) / (math.sqrt(v_hat) + self.eps)
                else:
                    self.v[t][row] = b2 * self.v[t][row] + (1 - b2) * g * g
                    r = (m / (1 - b1**self.t)) / ((self.v[t][row] / (1 - b2**self.t)).sqrt() + self.eps)
                r = r + self.wd * w[row]
                scale = float(w[row].norm() / r.norm()) if self.lamb else 1.0
                w[row] = w[row] - lr * scale * r
        return out.detach()


def _close(kernel: FusedPooledKernel, weights, atol: float = 1e-6, what: str = "") -> None:
    for name, got, want in zip(kernel.table_names, kernel.tables(), weights):
        torch.testing.assert_close(got, want.float(), atol=atol, rtol=1e-5, msg=lambda m, n=name: f"{what} {n}: {m}")


# -- adam against torch.optim.SparseAdam ---------------------------------------------------------------------


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
def test_adam_matches_sparse_adam(weighted: bool) -> None:
    # SparseAdam: w -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps); fbgemm puts eps inside the bias
    # correction, sqrt(v / (1 - b2^t)) + eps: the same update but for eps, which a tiny eps makes vanish
    kernel, opt = _kernel("adam", lr=0.01, eps=1e-12)
    ref = [w.clone().requires_grad_(True) for w in _weights()]
    sparse_adam = torch.optim.SparseAdam(ref, lr=0.01, betas=BETAS, eps=1e-12)
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        values, offsets, psw = _batch(g, weighted)
        out = kernel(values, offsets, psw)
        grad = torch.randn(out.shape, generator=g)
        (out * grad).sum().backward()
        opt.step()
        (_embedding_bags(ref, values, offsets, psw, sparse=True) * grad).sum().backward()
        sparse_adam.step()
        sparse_adam.zero_grad()
        _close(kernel, [r.detach() for r in ref], what=f"step {step}")
        for name, p in zip(kernel.table_names, ref):
            state = kernel.optimizer_states()[name]
            torch.testing.assert_close(state["exp_avg"], sparse_adam.state[p]["exp_avg"], atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(state["exp_avg_sq"], sparse_adam.state[p]["exp_avg_sq"], atol=1e-6, rtol=1e-6)
    assert kernel.optimizer_iter == 6 == int(sparse_adam.state[ref[0]]["step"])


# -- every kind against the rule written out -----------------------------------------------------------------


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05], ids=["no_wd", "wd"])
@pytest.mark.parametrize("kind", TORCH_CPU_KINDS)
def test_matches_the_rule_written_out(kind: str, weight_decay: float, weighted: bool) -> None:
    kernel, opt = _kernel(kind, weight_decay=weight_decay)
    ref = RuleReference(kind, weight_decay)
    g = torch.Generator().manual_seed(2)
    for step, lr in enumerate((0.01, 0.02, 0.005, 0.03)):  # the learning rate changes every step
        opt.param_groups[0]["lr"] = lr
        values, offsets, psw = _batch(g, weighted)
        before = [w.clone() for w in kernel.tables()]
        state_before = copy.deepcopy(kernel.optimizer_states())
        out = kernel(values, offsets, psw, grad_scale=0.5)
        grad = torch.randn(out.shape, generator=g)
        (out * grad).sum().backward()
        opt.step()
        want = ref.step(values, offsets, psw, grad * 0.5, lr)
        torch.testing.assert_close(out, want.float(), atol=1e-6, rtol=1e-6)
        _close(kernel, ref.w, what=f"{kind} step {step}")
        for t, (name, _, _) in enumerate(TABLES):
            states = kernel.optimizer_states()[name]
            torch.testing.assert_close(states["exp_avg"], ref.m[t].float(), atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(states["exp_avg_sq"], ref.v[t].float(), atol=1e-7, rtol=1e-5)
            # rows the batch did not read keep their weights and state bit for bit
            read = torch.zeros(TABLES[t][1], dtype=torch.bool)
            for f in (f for f, ft in enumerate(FEATURE_TABLE) if ft == t):
                read[values[int(offsets[f * B]) : int(offsets[(f + 1) * B])]] = True
            assert torch.equal(kernel.tables()[t][~read], before[t][~read])
            for key, s in states.items():
                assert torch.equal(s[~read], state_before[name][key][~read]), key
    assert kernel.optimizer_iter == 4


@pytest.mark.parametrize("kind", TORCH_CPU_KINDS)
def test_eps_is_added_to_the_bias_corrected_root(kind: str) -> None:
    # a large eps tells sqrt(v / (1 - b2^t)) + eps (fbgemm) from sqrt(v) / sqrt(1 - b2^t) + eps (torch's Adam)
    kernel, opt = _kernel(kind, eps=1e-2)
    ref = RuleReference(kind, 0.0, eps=1e-2)
    g = torch.Generator().manual_seed(10)
    for _ in range(3):
        values, offsets, psw = _batch(g, True)
        out = kernel(values, offsets, psw)
        grad = torch.randn(out.shape, generator=g) * 0.01
        (out * grad).sum().backward()
        opt.step()
        ref.step(values, offsets, psw, grad, 0.01)
    _close(kernel, ref.w, what=kind)


def test_per_sample_weight_gradient_is_taken_before_the_update() -> None:
    kernel, _ = _kernel("lamb", weight_decay=0.1)
    values, offsets, psw = _batch(torch.Generator().manual_seed(3), True)
    w0 = [w.clone().requires_grad_(True) for w in kernel.tables()]
    got, want = psw.clone().requires_grad_(True), psw.clone().requires_grad_(True)
    grad = torch.randn(B, 20, generator=torch.Generator().manual_seed(4))
    (kernel(values, offsets, got, grad_scale=0.25) * grad).sum().backward()
    (_embedding_bags(w0, values, offsets, want, sparse=False) * grad).sum().backward()
    torch.testing.assert_close(got.grad, want.grad, atol=1e-6, rtol=1e-6)  # not scaled by grad_scale
    assert not all(torch.equal(a, b) for a, b in zip(kernel.tables(), w0))


def test_step_counter_counts_forwards_as_fbgemm_does() -> None:
    # fbgemm's forward counts a step even without backward (eval lookups too); bias correction reads it
    kernel, _ = _kernel("adam")
    values, offsets, _ = _batch(torch.Generator().manual_seed(5), False)
    with torch.no_grad():
        kernel(values, offsets)
    assert kernel.optimizer_iter == 1
    kernel.optimizer_iter = 41
    kernel(values, offsets).sum().backward()
    assert kernel.optimizer_iter == 42


# -- state: names, shapes, checkpoints ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", TORCH_CPU_KINDS)
def test_state_is_fbgemms_and_round_trips_through_the_optimizer(kind: str) -> None:
    a, opt_a = _kernel(kind, weight_decay=0.01)
    for n, r, d in TABLES:
        shapes = {k: tuple(t.shape) for k, t in a.optimizer_states()[n].items()}
        assert list(shapes) == list(FUSED_KINDS[kind].state_names)
        assert shapes == FUSED_KINDS[kind].state_shapes(r, d)
    g = torch.Generator().manual_seed(6)
    for _ in range(3):
        values, offsets, psw = _batch(g, True)
        (a(values, offsets, psw) * 0.3).sum().backward()
        opt_a.step()
    model_sd, opt_sd = copy.deepcopy(a.state_dict()), copy.deepcopy(opt_a.state_dict())
    assert opt_sd["param_groups"][0]["iter"] == 3 and opt_sd["param_groups"][0]["kind"] == kind

    # the same tables in another order, other widths grouping, fresh weights: everything comes from the files
    tables_b = [TABLES[2], TABLES[0], TABLES[1]]
    b, opt_b = _kernel(kind, weight_decay=0.01, tables=tables_b, ft=[0, 1, 1, 2])
    b.load_state_dict(model_sd)
    opt_b.load_state_dict(opt_sd)
    assert b.optimizer_iter == 3
    for n, states in a.optimizer_states().items():
        for key, t in states.items():
            assert torch.equal(b.optimizer_states()[n][key], t)
    values, offsets, psw = _batch(g, True)
    (a(values, offsets, psw) * 0.3).sum().backward()
    opt_a.step()
    # b's features: f3 (its table 0), then f0, f1, f2
    out_b = b(*_features(values, offsets, psw, [3, 0, 1, 2]))
    (out_b * 0.3).sum().backward()
    opt_b.step()
    for n, p in zip(a.table_names, a.tables()):
        assert torch.equal(p, dict(zip(b.table_names, b.tables()))[n]), n


def _features(values, offsets, psw, features: list[int]):
    """The feature-major batch of ``features`` (old indices), in that order."""
    vs, ws, lengths = [], [], []
    for f in features:
        lo, hi = int(offsets[f * B]), int(offsets[(f + 1) * B])
        vs.append(values[lo:hi])
        ws.append(psw[lo:hi])
        lengths.append(offsets[f * B : (f + 1) * B + 1].diff())
    new_offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cat(lengths).cumsum(0)])
    return torch.cat(vs), new_offsets, torch.cat(ws)


def test_deepcopy_is_independent() -> None:
    kernel, opt = _kernel("partial_rowwise_adam")
    twin = copy.deepcopy(kernel)
    values, offsets, _ = _batch(torch.Generator().manual_seed(7), False)
    kernel(values, offsets).sum().backward()
    opt.step()
    assert twin.optimizer_iter == 0 and all(not s["exp_avg"].any() for s in twin.optimizer_states().values())
    twin_opt = FusedOptimizer(twin)
    twin(values, offsets).sum().backward()
    twin_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(kernel.tables(), twin.tables()))


# -- accumulation --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", TORCH_CPU_KINDS)
def test_four_micro_batches_equal_one_step_on_their_union(kind: str) -> None:
    acc, acc_opt = _kernel(kind, weight_decay=0.01)
    acc_opt.accumulate = True
    one, one_opt = _kernel(kind, weight_decay=0.01)
    g = torch.Generator().manual_seed(8)
    for _ in range(2):
        micro = [_batch(g, True) for _ in range(4)]
        grads = [torch.randn(B, 20, generator=g) for _ in micro]
        before = [w.clone() for w in acc.tables()]
        for (values, offsets, psw), grad in zip(micro, grads):
            (acc(values, offsets, psw) * grad).sum().backward()
        assert all(torch.equal(a, b) for a, b in zip(acc.tables(), before)), "tables moved before the step"
        acc_opt.step()
        # the union: feature-major, micro-batch 0's bags of each feature first
        parts = []
        for f in range(len(FEATURE_TABLE)):
            for values, offsets, psw in micro:
                lo, hi = int(offsets[f * B]), int(offsets[(f + 1) * B])
                parts.append((values[lo:hi], psw[lo:hi], offsets[f * B : (f + 1) * B + 1].diff()))
        union_offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cat([p[2] for p in parts]).cumsum(0)])
        out = one(torch.cat([p[0] for p in parts]), union_offsets, torch.cat([p[1] for p in parts]))
        (out * torch.cat(grads)).sum().backward()
        one_opt.step()
        for a, b in zip(acc.tables(), one.tables()):
            torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)
        for n, states in one.optimizer_states().items():
            for key, t in states.items():
                torch.testing.assert_close(acc.optimizer_states()[n][key], t, atol=1e-7, rtol=1e-6)
        assert acc.optimizer_iter == one.optimizer_iter


# -- the stand-in on its own: sequence pooling ---------------------------------------------------------------


def test_unpooled_lookup_updates_each_id_row() -> None:
    spec = FusedOptimizerSpec("adam", lr=0.01, betas=BETAS, weight_decay=0.02)
    tbe = TorchAdamTBE([6, 4], [4, 4], [0, 1, 1], spec, pooling="none")
    w = tbe.split_embedding_weights()
    with torch.no_grad():
        for t, src in zip(w, _weights()[:2]):
            t.copy_(src[: t.shape[0]])
    ref_w = [x.double().clone() for x in w]
    ref_m = [torch.zeros_like(x) for x in ref_w]
    ref_v = [torch.zeros_like(x) for x in ref_w]
    values = torch.tensor([5, 0, 5, 1, 3, 3, 2])  # feature 0: 3 ids, features 1 and 2 (table 1): 4 ids
    offsets = torch.tensor([0, 2, 3, 4, 4, 6, 7])  # batch of 2
    out = tbe(values, offsets)
    table = [0, 0, 0, 1, 1, 1, 1]
    assert out.shape == (7, 4)
    torch.testing.assert_close(out, torch.stack([w[t][i] for t, i in zip(table, values.tolist())]))
    grad = torch.randn(7, 4, generator=torch.Generator().manual_seed(9))
    want = [torch.zeros_like(x) for x in ref_w]
    for t, i, gr in zip(table, values.tolist(), grad.double()):
        want[t][i] += gr  # a row read twice takes one update from its summed gradient
    out.backward(grad)
    b1, b2 = BETAS
    for t in range(2):
        for row in sorted({i for tt, i in zip(table, values.tolist()) if tt == t}):
            gr = want[t][row]
            ref_m[t][row] = b1 * ref_m[t][row] + (1 - b1) * gr
            ref_v[t][row] = b2 * ref_v[t][row] + (1 - b2) * gr * gr
            r = (ref_m[t][row] / (1 - b1)) / ((ref_v[t][row] / (1 - b2)).sqrt() + 1e-8)
            ref_w[t][row] -= 0.01 * (r + 0.02 * ref_w[t][row])
        torch.testing.assert_close(w[t], ref_w[t].float(), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="pooling='none' takes no per_sample_weights"):
        tbe(values, offsets, torch.ones(7))
    with pytest.raises(ValueError, match=re.escape("pooling='none' needs one width for all tables, got [4, 8]")):
        TorchAdamTBE([6, 4], [4, 8], [0, 1], spec, pooling="none")


# -- refusals ------------------------------------------------------------------------------------------------


def test_refusals() -> None:
    with pytest.raises(ValueError, match=re.escape("fused optimizer 'adam' on CPU supports float32 tables only")):
        FusedPooledKernel([("t", 4, 4, torch.float16)], [0], {"kind": "adam", "lr": 0.1})
    with pytest.raises(ValueError, match=re.escape("or a kind whose CPU update applies it: ['adam', ")):
        FusedPooledKernel([("t", 4, 4, torch.float32)], [0], {"kind": "rowwise_adagrad", "lr": 0.1, "weight_decay": 1})
    with pytest.raises(ValueError, match="TorchAdamTBE applies"):
        TorchAdamTBE([4], [4], [0], FusedOptimizerSpec("rowwise_adagrad", lr=0.1))
    with pytest.raises(ValueError, match="pooling must be one of"):
        TorchAdamTBE([4], [4], [0], FusedOptimizerSpec("adam", lr=0.1), pooling="mean")


def test_empty_batch_and_all_empty_bags_count_a_step_and_move_nothing() -> None:
    kernel, opt = _kernel("partial_rowwise_lamb")
    before = [w.clone() for w in kernel.tables()]
    for offsets in (torch.zeros(1, dtype=torch.long), torch.zeros(len(FEATURE_TABLE) * B + 1, dtype=torch.long)):
        out = kernel(torch.zeros(0, dtype=torch.long), offsets)
        assert out.shape == ((offsets.numel() - 1) // len(FEATURE_TABLE), 20) and not out.any()
        out.sum().backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(kernel.tables(), before)) and kernel.optimizer_iter == 2
