"""GroupedPooledLookup: tables served by different kernels give the plain ``F.embedding_bag`` answer."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
import torch.nn.functional as F

from lightning_rec import kernels
from lightning_rec.kernels import GroupedPooledLookup
from tests.fbgemm_marks import needs_fbgemm


def _reference(tables, feature_table, values, offsets, b, psw):
    outs = []
    for f, t in enumerate(feature_table):
        lo, hi = int(offsets[f * b]), int(offsets[(f + 1) * b])
        seg = offsets[f * b : (f + 1) * b + 1] - lo
        w = None if psw is None else psw[lo:hi]
        outs.append(
            F.embedding_bag(values[lo:hi], tables[t], seg, mode="sum", per_sample_weights=w, include_last_offset=True)
        )
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("seed", range(6))
def test_mixed_kernels_match_embedding_bag(seed: int) -> None:
    rng = random.Random(seed)
    n_tables = rng.randint(1, 4)
    rows = [rng.randint(1, 9) for _ in range(n_tables)]
    dims = [rng.choice([2, 3, 4]) for _ in range(n_tables)]
    kinds = [rng.choice(["torch", "fbgemm"]) for _ in range(n_tables)]
    feature_table = sorted(rng.randrange(n_tables) for _ in range(rng.randint(1, 5)))
    b = rng.choice([1, 3])
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(feature_table) * b,), generator=g)
    values = torch.cat(
        [
            torch.randint(0, rows[t], (int(lengths[f * b : (f + 1) * b].sum()),), generator=g)
            for f, t in enumerate(feature_table)
        ]
    )
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    psw = torch.rand(values.numel(), generator=g) if seed % 2 else None
    params = [torch.nn.Parameter(torch.randn(r, d, generator=g)) for r, d in zip(rows, dims)]
    ref_tables = [p.detach().clone().requires_grad_() for p in params]
    lookup = GroupedPooledLookup(kinds, [torch.float32] * n_tables, feature_table, [dims[t] for t in feature_table])
    assert lookup.uses_fbgemm == ("fbgemm" in {kinds[t] for t in feature_table})
    coeff = None
    for _ in range(2):  # the second call reuses the packed flat buffer
        out = lookup(params, values, offsets, b, psw, sparse_grad=False)
        ref = _reference(ref_tables, feature_table, values, offsets, b, psw)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
        coeff = torch.randn(out.shape, generator=g) if coeff is None else coeff
    (out * coeff).sum().backward()
    (ref * coeff).sum().backward()
    for p, r in zip(params, ref_tables):
        got = torch.zeros_like(p) if p.grad is None else p.grad
        want = torch.zeros_like(r) if r.grad is None else r.grad
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_empty_batch_keeps_the_graph() -> None:
    params = [torch.nn.Parameter(torch.randn(3, 4))]
    lookup = GroupedPooledLookup(["fbgemm"], [torch.float32], [0], [4])
    out = lookup(params, torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.long), 0, None, False)
    assert out.shape == (0, 4)
    out.sum().backward()
    assert params[0].grad is not None and not params[0].grad.any()


def test_unknown_kernel_and_table_refusals() -> None:
    with pytest.raises(ValueError, match="lookup kernels must be one of"):
        GroupedPooledLookup(["fused"], [torch.float32], [0], [4])
    with pytest.raises(ValueError, match=r"table 'x\.y'.*bfloat16"):
        kernels.resolve_table_kernel("fbgemm", "x.y", torch.bfloat16, torch.device("cpu"), False)
    with pytest.raises(ValueError, match=r"table 'seq'.*sequence"):
        kernels.resolve_table_kernel("fbgemm", "seq", torch.float32, torch.device("cpu"), False, pooled=False)
    assert kernels.resolve_table_kernel("auto", "t", torch.float32, torch.device("cpu"), False) == "torch"


@needs_fbgemm
def test_fbgemm_serves_fp16_tables_on_cpu() -> None:
    assert kernels.resolve_table_kernel("fbgemm", "t", torch.float16, torch.device("cpu"), False) == "fbgemm"


def test_fbgemm_backward_is_silent_and_exact() -> None:
    """fbgemm's dense op warns in every backward that it may be "silently incorrect"; the kernels called directly
    do not, and give F.embedding_bag's gradients for the tables and the per-sample weights."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 4, generator=g)), torch.nn.Parameter(torch.randn(3, 2, generator=g))]
    ref_tables = [p.detach().clone().requires_grad_() for p in params]
    values, offsets = torch.tensor([0, 4, 2, 1, 0]), torch.tensor([0, 2, 3, 5, 5])
    psw = torch.rand(5, generator=g, requires_grad=True)
    ref_psw = psw.detach().clone().requires_grad_()
    lookup = GroupedPooledLookup(["fbgemm", "fbgemm"], [torch.float32] * 2, [0, 1], [4, 2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = lookup(params, values, offsets, 2, psw, sparse_grad=False)
        coeff = torch.randn(out.shape, generator=g)
        (out * coeff).sum().backward()
    ref = _reference(ref_tables, [0, 1], values, offsets, 2, ref_psw)
    (ref * coeff).sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    for p, r in zip(params, ref_tables):
        torch.testing.assert_close(p.grad, r.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(psw.grad, ref_psw.grad, rtol=0, atol=1e-6)
