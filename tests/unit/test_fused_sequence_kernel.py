"""The fused kernel without pooling (sequence lookups: one row per id) against independent plain-torch references.

The references never go through lightning_rec or fbgemm: rows come from ``F.embedding`` on float64 copies of the
initial weights, and the dense gradient of ``(out * coef).sum()`` is stepped with ``torch.optim.SGD``,
``torch.optim.Adagrad``, the row-wise Adagrad formula, or fbgemm's Adam / LAMB rule written out by hand (only the
rows the batch reads move, each once, from its gradient summed over the batch).
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
import torch.nn.functional as F

from lightning_rec.fused_kinds import CPU_KINDS, FBGEMM_CPU_KINDS, FUSED_KINDS, TORCH_CPU_KINDS
from lightning_rec.kernels import FusedPooledKernel, FusedSequenceKernel
from lightning_rec.kernels._torch_adam import TorchAdamTBE
from lightning_rec.optim import FusedOptimizer, FusedOptimizerSpec

# (name, rows, dim): one dim (fbgemm's no-bag mode has one width); features f0 and f1 share t0
TABLES = [("t0", 9, 8), ("t1", 7, 8), ("t2", 5, 8)]
FEATURE_TABLE = [0, 0, 1, 2]
LR, LR2, EPS, BETAS = 0.05, 0.02, 1e-8, (0.8, 0.95)
Batch = list[list[list[int]]]  # [feature][bag] -> ids


def _weights(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(r, d, generator=g) - 0.5 for _, r, d in TABLES]


def _kernel(kind: str, tables=TABLES, ft=FEATURE_TABLE, seed: int = 0, dtype=torch.float32):
    kernel = FusedSequenceKernel(
        [(n, r, d, dtype) for n, r, d in tables],
        ft,
        FusedOptimizerSpec(kind, lr=LR, eps=EPS, betas=BETAS if kind in TORCH_CPU_KINDS else None),
        weights=[w.to(dtype) for w in _weights(seed)],
    )
    return kernel, FusedOptimizer(kernel)


def _batch(g: torch.Generator, b: int = 3, empty_bags: bool = False) -> Batch:
    """B bags per feature: repeats inside a bag and across features of one table, empty bags, the last row."""
    batch = []
    for f, t in enumerate(FEATURE_TABLE):
        rows, bags = TABLES[t][1], []
        for j in range(b):
            n = 0 if empty_bags or (j + f) % 3 == 1 else int(torch.randint(1, 5, (1,), generator=g))
            ids = torch.randint(0, rows, (n,), generator=g).tolist()
            if j == 0 and n:
                ids += ids[:1] + [rows - 1]
            bags.append(ids)
        batch.append(bags)
    return batch


def _pack(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    values, offsets = [], [0]
    for bags in batch:
        for ids in bags:
            values += ids
            offsets.append(len(values))
    return torch.tensor(values, dtype=torch.long), torch.tensor(offsets)


def _ids_of(batch: Batch, t: int) -> list[int]:
    return [i for f, bags in enumerate(batch) if FEATURE_TABLE[f] == t for ids in bags for i in ids]


class Reference:
    """Float64 copies of the tables, stepped by torch optimizers or the kind's rule written out."""

    def __init__(self, kind: str, seed: int = 0) -> None:
        self.kind = kind
        self.w = [w.double().requires_grad_(True) for w in _weights(seed)]
        if kind == "sgd":
            self.opt: torch.optim.Optimizer | None = torch.optim.SGD(self.w, lr=LR)
        elif kind == "adagrad":
            self.opt = torch.optim.Adagrad(self.w, lr=LR, eps=EPS, initial_accumulator_value=0)
        else:
            self.opt = None
        rowwise = kind in ("rowwise_adagrad", "partial_rowwise_adam", "partial_rowwise_lamb")
        self.sum = [torch.zeros(w.shape[0] if rowwise else w.shape, dtype=torch.float64) for w in self.w]
        self.m = [torch.zeros_like(w) for w in self.w]
        self.t = 0  # the Adam family's step counter: one per forward, as fbgemm counts

    def lookup(self, batch: Batch) -> torch.Tensor:
        outs = [
            F.embedding(torch.tensor([i for ids in bags for i in ids], dtype=torch.long), self.w[t])
            for bags, t in zip(batch, FEATURE_TABLE)
        ]
        return torch.cat(outs)

    def backward(self, batch: Batch, coef: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        out = self.lookup(batch)
        (out * coef.double() * scale).sum().backward()
        return out.detach()

    def set_lr(self, lr: float) -> None:
        self.lr = lr
        if self.opt is not None:
            self.opt.param_groups[0]["lr"] = lr

    @torch.no_grad()
    def step(self, read: list[set[int]], lr: float = LR) -> None:
        """One update from the accumulated ``.grad``; ``read``: the rows the step's lookups read, per table."""
        self.t += 1
        if self.opt is not None:
            self.opt.param_groups[0]["lr"] = lr
            for w in self.w:
                if w.grad is None:
                    w.grad = torch.zeros_like(w)
            self.opt.step()
        elif self.kind == "rowwise_adagrad":
            for w, s in zip(self.w, self.sum):
                g = w.grad if w.grad is not None else torch.zeros_like(w)
                s += (g * g).mean(1)
                w -= lr * g / (s.sqrt() + EPS)[:, None]
        else:
            self._adam_rule(read, lr)
        for w in self.w:
            w.grad = None

    def _adam_rule(self, read: list[set[int]], lr: float) -> None:
        b1, b2 = BETAS
        rowwise, lamb = self.kind.startswith("partial_rowwise"), self.kind.endswith("lamb")
        for t, w in enumerate(self.w):
            grad = w.grad if w.grad is not None else torch.zeros_like(w)
            for row in sorted(read[t]):
                g = grad[row]
                m = self.m[t][row] = b1 * self.m[t][row] + (1 - b1) * g
                if rowwise:
                    self.sum[t][row] = b2 * self.sum[t][row] + (1 - b2) * (g * g).mean()
                    r = (m / (1 - b1**self.t)) / (math.sqrt(self.sum[t][row] / (1 - b2**self.t)) + EPS)
                else:
                    self.sum[t][row] = b2 * self.sum[t][row] + (1 - b2) * g * g
                    r = (m / (1 - b1**self.t)) / ((self.sum[t][row] / (1 - b2**self.t)).sqrt() + EPS)
                scale = float(w[row].norm() / r.norm()) if lamb and r.norm() > 0 else 1.0
                w[row] = w[row] - lr * scale * r


def _read(*batches: Batch) -> list[set[int]]:
    return [{i for b in batches for i in _ids_of(b, t)} for t in range(len(TABLES))]


def _close(kernel: FusedPooledKernel, ref: Reference, what: str, atol: float = 2e-6) -> None:
    for name, got, want in zip(kernel.table_names, kernel.tables(), ref.w):
        torch.testing.assert_close(
            got.float(), want.detach().float(), atol=atol, rtol=1e-5, msg=lambda m, n=name: f"{what} {n}: {m}"
        )


def _coef(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(n, TABLES[0][2], generator=g)


# -- every kind against its reference ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", CPU_KINDS)
def test_rows_and_updates_match_reference(kind):
    kernel, opt = _kernel(kind)
    assert kernel.pooling == "none" and kernel.total_dim == 8
    assert isinstance(kernel._tbe, TorchAdamTBE) == (kind in TORCH_CPU_KINDS)
    ref = Reference(kind)
    g = torch.Generator().manual_seed(1)
    # steps: plain, grad_scale, an empty batch (no sample), all bags empty, another lr, plain again
    plan = [
        (3, False, 1.0, LR),
        (3, False, 0.5, LR),
        (0, False, 1.0, LR),
        (2, True, 1.0, LR),
        (4, False, 1.0, LR2),
        (3, False, 2.0, LR2),
    ]
    for step, (b, empty, scale, lr) in enumerate(plan):
        opt.param_groups[0]["lr"] = lr
        batch = _batch(g, b, empty)
        values, offsets = _pack(batch)
        out = kernel(values, offsets, grad_scale=scale)
        assert out.shape == (values.numel(), 8)
        want = ref.backward(batch, coef := _coef(values.numel(), g), scale)
        torch.testing.assert_close(out, want.float(), atol=1e-6, rtol=0, msg=lambda m, s=step: f"step {s} rows: {m}")
        (out * coef).sum().backward()
        opt.step()
        ref.step(_read(batch), lr)
        _close(kernel, ref, f"step {step}")
    if kind in TORCH_CPU_KINDS:
        assert kernel.optimizer_iter == len(plan)


def test_fp16_tables_match_within_fp16_precision():
    for kind in FBGEMM_CPU_KINDS:
        kernel, opt = _kernel(kind, dtype=torch.float16)
        ref = Reference(kind)
        g = torch.Generator().manual_seed(2)
        for _ in range(2):
            batch = _batch(g)
            values, offsets = _pack(batch)
            out = kernel(values, offsets)
            assert out.dtype == torch.float16
            coef = _coef(values.numel(), g)
            ref.backward(batch, coef)
            (out * coef.half()).sum().backward()
            opt.step()
            ref.step(_read(batch))
        _close(kernel, ref, kind, atol=1e-2)


def test_pooling_keyword_of_the_pooled_kernel_is_the_same_kernel():
    tables = [(n, r, d, torch.float32) for n, r, d in TABLES]
    a = FusedPooledKernel(tables, FEATURE_TABLE, {"kind": "sgd", "lr": LR}, weights=_weights(), pooling="none")
    b, _ = _kernel("sgd")
    values, offsets = _pack(_batch(torch.Generator().manual_seed(3)))
    assert torch.equal(a(values, offsets), b(values, offsets))
    pooled = FusedPooledKernel(tables, FEATURE_TABLE, {"kind": "sgd", "lr": LR}, weights=_weights())
    assert pooled.pooling == "sum" and pooled(values, offsets).shape == (3, 4 * 8)


# -- feature_table order ---------------------------------------------------------------------------------------


def test_unsorted_feature_table_is_refused_and_sorting_the_features_gives_the_rows():
    # fbgemm's no-bag CPU kernel crashes for an unsorted feature_table_map ("Index 0 is out of bounds: 1, range
    # 0 to -7", docs/ARCHITECTURE.md F2): the kernel refuses it, naming the workaround
    tables = [(n, r, d, torch.float32) for n, r, d in TABLES]
    with pytest.raises(ValueError, match=re.escape("feature_table must be non-decreasing")) as err:
        FusedSequenceKernel(tables, [1, 0, 2], {"kind": "rowwise_adagrad", "lr": LR})
    assert "permute the output rows afterwards" in str(err.value)
    # features in the order t1, t0: sort them by table, look up, put each feature's rows back in place
    g = torch.Generator().manual_seed(4)
    user = [[[1, 6, 1], []], [[2, 2], [8]]]  # feature 0 reads t1, feature 1 reads t0
    kernel = FusedSequenceKernel(tables[:2], [0, 1], {"kind": "sgd", "lr": LR}, weights=_weights()[:2])
    values, offsets = _pack([user[1], user[0]])
    out = kernel(values, offsets)
    n1 = sum(len(ids) for ids in user[1])
    rows = torch.cat([out[n1:], out[:n1]])  # feature 0's rows, then feature 1's
    w = _weights()
    want = torch.cat([F.embedding(torch.tensor([1, 6, 1]), w[1]), F.embedding(torch.tensor([2, 2, 8]), w[0])])
    torch.testing.assert_close(rows, want)
    coef = torch.randn(rows.shape, generator=g)
    (rows * coef).sum().backward()
    kernel.finish_step()
    dense1, dense0 = torch.zeros_like(w[1]), torch.zeros_like(w[0])
    dense1.index_add_(0, torch.tensor([1, 6, 1]), coef[:3])
    dense0.index_add_(0, torch.tensor([2, 2, 8]), coef[3:])
    torch.testing.assert_close(kernel.tables()[0], w[0] - LR * dense0)
    torch.testing.assert_close(kernel.tables()[1], w[1] - LR * dense1)


# -- accumulation ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", CPU_KINDS)
def test_accumulation_of_three_lookups_is_one_update_from_their_sum(kind):
    kernel, opt = _kernel(kind)
    opt.accumulate = True
    ref = Reference(kind)
    g = torch.Generator().manual_seed(5)
    for step in range(2):
        batches = (
            [_batch(g, 3), _batch(g, 2), _batch(g, 0)]
            if step == 0
            else [_batch(g, 1), _batch(g, 4), _batch(g, 2, True)]
        )
        before = [t.detach().clone() for t in kernel.tables()]
        for k, batch in enumerate(batches):
            values, offsets = _pack(batch)
            scale = 0.5 if k == 1 else 1.0
            out = kernel(values, offsets, grad_scale=scale)
            want = ref.backward(batch, coef := _coef(values.numel(), g), scale)
            torch.testing.assert_close(out, want.float(), atol=1e-6, rtol=0)
            (out * coef).sum().backward()
            assert all(torch.equal(a, b) for a, b in zip(before, kernel.tables())), "tables moved before the step"
        assert kernel.pending_lookups == len(batches)
        opt.step()
        ref.step(_read(*batches))
        _close(kernel, ref, f"step {step}")
        assert kernel.pending_lookups == 0
    if kind in TORCH_CPU_KINDS:
        assert kernel.optimizer_iter == 2


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adam"])
def test_drop_kept_rows_forgets_their_gradient_in_waiting_lookups_only(kind):
    kernel, opt = _kernel(kind)
    opt.accumulate = True
    ref = Reference(kind)
    first = [[[1, 2, 1], [3]], [[2, 5], []], [[0, 4]], [[1]]]
    first = [bags + [[]] * (2 - len(bags)) for bags in first]
    later = [[[2], [1]], [[], [2]], [[4], []], [[3], [1]]]
    g = torch.Generator().manual_seed(6)
    # the first lookup: two losses through it, row 2 of t0 dropped in between (managed collision)
    values, offsets = _pack(first)
    out = kernel(values, offsets)
    c1, c2 = _coef(values.numel(), g), _coef(values.numel(), g)
    (out * c1).sum().backward(retain_graph=True)
    kernel.drop_kept_rows("t0", torch.tensor([2]))
    (out * c2).sum().backward()
    values2, offsets2 = _pack(later)
    out2 = kernel(values2, offsets2)
    c3 = _coef(values2.numel(), g)
    (out2 * c3).sum().backward()
    opt.step()
    # reference: the first lookup's gradient without t0's row 2, the later lookup's whole
    ref.backward(first, c1 + c2)
    ref.w[0].grad[2] = 0
    ref.backward(later, c3)
    read = _read(first, later)
    if 2 not in _ids_of(later, 0):
        read[0].discard(2)
    ref.step(read)
    _close(kernel, ref, "after drop")


# -- guards, state, errors -------------------------------------------------------------------------------------


def test_second_backward_and_second_lookup_before_the_step_raise():
    kernel, opt = _kernel("sgd")
    values, offsets = _pack(_batch(torch.Generator().manual_seed(7)))
    out = kernel(values, offsets)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran a second time"):
        out.sum().backward()
    with pytest.raises(RuntimeError, match="a second backward reached FusedPooledKernel before the optimizer step"):
        kernel(values, offsets).sum().backward()
    opt.step()
    kernel(values, offsets).sum().backward()


def test_tables_are_leaf_parameters_under_table_weight_keys():
    kernel, _ = _kernel("rowwise_adagrad")
    assert list(kernel.state_dict()) == ["t0.weight", "t1.weight", "t2.weight"]
    for p, v in zip(kernel.tables(), kernel._tbe.split_embedding_weights()):
        assert isinstance(p, torch.nn.Parameter) and p.is_leaf and not p.requires_grad
        assert p.data_ptr() == v.data_ptr()


@pytest.mark.parametrize("kind", CPU_KINDS)
def test_state_round_trip(kind):
    a, opt_a = _kernel(kind)
    g = torch.Generator().manual_seed(8)
    for _ in range(2):
        values, offsets = _pack(_batch(g))
        (a(values, offsets) * _coef(values.numel(), g)).sum().backward()
        opt_a.step()
    opt_a.param_groups[0]["lr"] = LR2
    model_sd, opt_sd = copy.deepcopy(a.state_dict()), copy.deepcopy(opt_a.state_dict())
    b, opt_b = _kernel(kind, seed=1)
    b.load_state_dict(model_sd)
    opt_b.load_state_dict(opt_sd)
    assert b.get_learning_rate() == LR2 and b.optimizer_iter == a.optimizer_iter
    for name, states in a.optimizer_states().items():
        assert set(states) == set(FUSED_KINDS[kind].state_names)
        for key, t in states.items():
            assert torch.equal(b.optimizer_states()[name][key], t)
    values, offsets = _pack(_batch(g))
    coef = _coef(values.numel(), g)
    for k, o in ((a, opt_a), (b, opt_b)):
        (k(values, offsets) * coef).sum().backward()
        o.step()
    for ta, tb in zip(a.tables(), b.tables()):
        assert torch.equal(ta, tb)


def test_errors():
    mixed = [("a", 4, 4, torch.float32), ("b", 6, 8, torch.float32), ("c", 3, 4, torch.float32)]
    message = "one embedding dim for all its tables, got 'a': 4, 'b': 8, 'c': 4; build one kernel per dim"
    for kind in ("sgd", "adam"):
        with pytest.raises(ValueError, match=re.escape(message)):
            FusedSequenceKernel(mixed, [0, 1, 2], {"kind": kind, "lr": LR})
    with pytest.raises(ValueError, match=re.escape("pooling must be one of ['sum', 'none'], got 'mean'")):
        FusedPooledKernel(mixed[:1], [0], {"kind": "sgd", "lr": LR}, pooling="mean")
    for kind in ("rowwise_adagrad", "adam"):
        kernel, _ = _kernel(kind)
        values, offsets = _pack(_batch(torch.Generator().manual_seed(9)))
        with pytest.raises(ValueError, match="without pooling .* takes no per_sample_weights"):
            kernel(values, offsets, torch.ones(values.numel()))
        for bad, what in ((-1, "has id -1, outside the valid range [0, 4] (num_embeddings=5)"), (5, "has id 5")):
            ids = torch.tensor([1, 2, 0, bad])
            with pytest.raises(ValueError, match=re.escape(f"feature 3 (table 't2') {what}")):
                kernel(ids, torch.tensor([0, 1, 2, 3, 4]))
        with pytest.raises(ValueError, match=re.escape("feature 1 (table 't0') has id 9")):
            kernel(torch.tensor([1, 9, 0, 0]), torch.tensor([0, 1, 2, 3, 4]))
