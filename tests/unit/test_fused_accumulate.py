"""FusedPooledKernel in accumulation mode (issue 33): k backward passes, then one step, give the update of the
summed gradient, against a plain-torch reference (F.embedding_bag on dense copies, torch optimizers)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_rec.fused_kinds import FBGEMM_CPU_KINDS
from lightning_rec.kernels import FusedPooledKernel
from lightning_rec.optim import FusedOptimizer

TABLES = [("a", 10, 4, torch.float32), ("b", 6, 8, torch.float32)]
FEATURE_TABLE = [0, 0, 1]
LR, EPS = 0.3, 1e-8


def _weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(r, d, generator=g) for _, r, d, _ in TABLES]


def _batch(b: int, g: torch.Generator, weighted: bool):
    values, offsets = [], [0]
    for t in FEATURE_TABLE:
        for _ in range(b):
            n = int(torch.randint(0, 4, (1,), generator=g))
            values += torch.randint(0, TABLES[t][1], (n,), generator=g).tolist()
            offsets.append(len(values))
    v = torch.tensor(values, dtype=torch.long)
    return v, torch.tensor(offsets), (torch.rand(v.numel(), generator=g) + 0.5) if weighted else None


class _Reference:
    """Dense copies of the tables, gradients accumulated in ``.grad``, the kind's update written out."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.w = [w.clone().requires_grad_(True) for w in _weights()]
        self.sum = [torch.zeros(w.shape if kind == "adagrad" else w.shape[:1]) for w in self.w]

    def lookup(self, values, offsets, psw, b: int) -> torch.Tensor:
        outs = []
        for f, t in enumerate(FEATURE_TABLE):
            lo, hi = int(offsets[f * b]), int(offsets[(f + 1) * b])
            outs.append(
                F.embedding_bag(
                    values[lo:hi],
                    self.w[t],
                    offsets[f * b : (f + 1) * b + 1] - lo,
                    mode="sum",
                    per_sample_weights=None if psw is None else psw[lo:hi],
                    include_last_offset=True,
                )
            )
        return torch.cat(outs, 1)

    @torch.no_grad()
    def step(self) -> None:
        for w, s in zip(self.w, self.sum):
            g = w.grad if w.grad is not None else torch.zeros_like(w)
            if self.kind == "sgd":
                w -= LR * g
            elif self.kind == "adagrad":
                s += g * g
                w -= LR * g / (s.sqrt() + EPS)
            else:
                s += (g * g).mean(1)
                w -= LR * g / (s.sqrt() + EPS)[:, None]
            w.grad = None


def _fused(kind: str) -> tuple[FusedPooledKernel, FusedOptimizer]:
    kernel = FusedPooledKernel(TABLES, FEATURE_TABLE, {"kind": kind, "lr": LR, "eps": EPS}, weights=_weights())
    opt = FusedOptimizer(kernel)
    opt.accumulate = True
    return kernel, opt


def _close(kernel: FusedPooledKernel, ref: _Reference) -> None:
    for got, want in zip(kernel.tables(), ref.w):
        torch.testing.assert_close(got, want.detach(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("kind", FBGEMM_CPU_KINDS)  # Adam family: test_fused_adam_cpu.py
def test_k_backward_passes_then_one_step_equal_the_summed_gradient(kind: str, weighted: bool) -> None:
    kernel, opt = _fused(kind)
    ref = _Reference(kind)
    g = torch.Generator().manual_seed(1)
    for sizes in ([3], [3, 2], [4, 0, 1, 2]):  # k = 1, 2, 4 micro-batches of different sizes (one empty)
        for b in sizes:
            values, offsets, psw = _batch(b, g, weighted)
            before = [p.clone() for p in kernel.tables()]
            out = kernel(values, offsets, psw, grad_scale=0.5)
            grad = torch.randn(out.shape, generator=g)
            (out * grad).sum().backward()
            assert all(torch.equal(p, q) for p, q in zip(before, kernel.tables())), "tables moved before the step"
            (ref.lookup(values, offsets, psw, b) * grad * 0.5).sum().backward()
        assert opt.pending_bytes() > 0
        opt.step()
        ref.step()
        assert opt.pending_bytes() == 0
        _close(kernel, ref)
        if kind != "sgd":
            for got, want in zip(kernel.optimizer_states().values(), ref.sum):
                # sums of squared gradients grow past 10: a few ulps of them, whatever order torch adds in
                torch.testing.assert_close(got["sum"], want, atol=1e-6, rtol=1e-6)


def test_one_step_in_accumulation_mode_is_bitwise_the_fused_backward() -> None:
    # the step replays fbgemm's own forward and backward over the kept batch: the same update, bit for bit
    eager = FusedPooledKernel(TABLES, FEATURE_TABLE, {"kind": "rowwise_adagrad", "lr": LR}, weights=_weights())
    eager_opt = FusedOptimizer(eager)
    kernel, opt = _fused("rowwise_adagrad")
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        values, offsets, psw = _batch(5, g, True)
        grad = torch.randn(5, 16, generator=g)
        for k, o in ((eager, eager_opt), (kernel, opt)):
            (k(values, offsets, psw) * grad).sum().backward()
            o.step()
        assert all(torch.equal(p, q) for p, q in zip(eager.tables(), kernel.tables()))


def test_per_sample_weight_gradients_match_the_fused_backward() -> None:
    eager = FusedPooledKernel(TABLES, FEATURE_TABLE, {"kind": "sgd", "lr": LR}, weights=_weights())
    kernel, _ = _fused("sgd")
    values, offsets, psw = _batch(4, torch.Generator().manual_seed(3), True)
    grad = torch.randn(4, 16, generator=torch.Generator().manual_seed(4))
    got, want = psw.clone().requires_grad_(True), psw.clone().requires_grad_(True)
    (kernel(values, offsets, got, grad_scale=0.25) * grad).sum().backward()
    (eager(values, offsets, want, grad_scale=0.25) * grad).sum().backward()
    torch.testing.assert_close(got.grad, want.grad, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", FBGEMM_CPU_KINDS)  # Adam family: test_fused_adam_cpu.py
def test_several_losses_one_step(kind: str) -> None:
    # two losses through one lookup (retain_graph) and a second lookup, three backward calls, one step
    kernel, opt = _fused(kind)
    ref = _Reference(kind)
    g = torch.Generator().manual_seed(5)
    for _ in range(2):
        (v1, o1, _), (v2, o2, _) = _batch(3, g, False), _batch(2, g, False)
        c1, c2, c3 = (torch.randn(b, 16, generator=g) for b in (3, 3, 2))
        out = kernel(v1, o1)
        (out * c1).sum().backward(retain_graph=True)
        (out.pow(2) * c2).sum().backward()
        (kernel(v2, o2) * c3).sum().backward()
        opt.step()
        r = ref.lookup(v1, o1, None, 3)
        ((r * c1).sum() + (r.pow(2) * c2).sum() + (ref.lookup(v2, o2, None, 2) * c3).sum()).backward()
        ref.step()
        _close(kernel, ref)


def test_accumulation_mode_guards() -> None:
    kernel, opt = _fused("adagrad")
    values, offsets, _ = _batch(2, torch.Generator().manual_seed(6), False)
    with torch.no_grad():  # evaluation keeps nothing
        kernel(values, offsets)
    assert kernel.pending_lookups == 0
    kernel(values, offsets).sum().backward()
    with pytest.raises(RuntimeError, match="wait for the step.*before turning accumulation off"):
        opt.accumulate = False
    with pytest.warns(UserWarning, match="between micro-batches"):
        opt.state_dict()
    opt.step()
    opt.accumulate = False  # nothing pending: back to updates inside backward
    kernel(values, offsets).sum().backward()
    with pytest.raises(RuntimeError, match="accumulation mode"):
        kernel(values, offsets).sum().backward()


def test_lightning_checkpoints_at_step_boundaries_hold_no_kept_gradients(tmp_path) -> None:
    # with accumulation, Lightning's ModelCheckpoint saves after the step, when nothing waits
    import warnings

    import lightning.pytorch as pl

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.opt = _fused("rowwise_adagrad")

        def training_step(self, batch, batch_idx):
            values, offsets = batch
            return self.emb(values, offsets).pow(2).mean()

        def configure_optimizers(self):
            return self.opt

    g = torch.Generator().manual_seed(8)
    batches = [_batch(2, g, False)[:2] for _ in range(6)]
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ckpt],
        accumulate_grad_batches=3,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*between micro-batches")
        trainer.fit(Model(), torch.utils.data.DataLoader(batches, batch_size=None))
    assert trainer.global_step == 2 and len(list(tmp_path.glob("*.ckpt"))) == 2
