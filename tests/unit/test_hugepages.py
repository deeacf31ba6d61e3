"""The fused kernel's tables on transparent huge pages: same values, same training, the advice really given.

Whether the kernel grants 2 MiB pages depends on free memory, so the checks read the advice itself (the
``hg`` flag of the mapping in /proc/self/smaps), which is deterministic once asked for.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_rec import memory as hp
from lightning_rec.kernels import FusedPooledKernel
from lightning_rec.optim import FusedOptimizer

MIB = 1 << 20
needs_madvise = pytest.mark.skipif(
    hp.thp_mode() != "madvise" or hp._madvise() is None, reason="transparent huge pages are not in madvise mode here"
)


def advised(t: torch.Tensor) -> bool:
    """Whether the mapping that holds ``t``'s first 2 MiB-aligned byte carries MADV_HUGEPAGE (VmFlags ``hg``)."""
    addr = -(-t.data_ptr() // (2 * MIB)) * (2 * MIB)
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0] if line.strip() else ""
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = lo <= addr < hi
            elif found and line.startswith("VmFlags:"):
                return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds address {addr:#x}")


@needs_madvise
def test_big_tensor_is_zeroed_and_advised():
    t = torch.full((3 * MIB + 123,), 7.0)  # 12 MiB of float32, deliberately not aligned at either end
    assert hp.zero_into_huge_pages(t)
    assert advised(t)
    assert not t.any()
    t.fill_(1.5)  # the dropped pages fault back in and keep what is written
    assert bool((t == 1.5).all())


def test_small_tensor_is_only_zeroed():
    t = torch.full((1000,), 3.0)
    assert not hp.zero_into_huge_pages(t)
    assert not t.any()


def test_turned_off_by_the_environment_variable(monkeypatch):
    monkeypatch.setenv("LIGHTNING_REC_HUGE_PAGES", "0")
    t = torch.full((4 * MIB,), 2.0)
    assert not hp.zero_into_huge_pages(t)
    assert not t.any()


def test_shared_storage_is_only_zeroed():
    t = torch.full((4 * MIB,), 2.0).share_memory_()
    assert not hp.zero_into_huge_pages(t)
    assert not t.any()


def test_thp_mode_reads_the_bracketed_word(tmp_path, monkeypatch):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    monkeypatch.setattr(hp, "_THP_ENABLED", str(f))
    assert hp.thp_mode() == "madvise"
    monkeypatch.setattr(hp, "_THP_ENABLED", str(tmp_path / "missing"))
    assert hp.thp_mode() is None


TABLES = [("big", 40_000, 64, torch.float32), ("small", 10, 8, torch.float32)]


def _kernel(weights):
    return FusedPooledKernel(TABLES, [0, 1], {"kind": "sgd", "lr": 0.3}, weights=weights)


def _train(kernel, steps: int = 3) -> None:
    opt = FusedOptimizer(kernel)
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        values = torch.cat([torch.randint(0, 40_000, (50,), generator=gen), torch.randint(0, 10, (12,), generator=gen)])
        offsets = torch.tensor([0, 20, 50, 55, 62])  # 2 bags per feature
        out = kernel(values, offsets)
        (out * torch.randn(out.shape, generator=gen)).sum().backward()
        opt.step()


def test_kernel_tables_and_training_are_the_same_with_and_without_huge_pages(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(r, d, generator=gen) for _, r, d, _ in TABLES]
    on = _kernel(init)
    monkeypatch.setenv("LIGHTNING_REC_HUGE_PAGES", "0")
    # turned off, nothing is asked of the kernel (the memory itself may be reused from earlier advised blocks in
    # a long-running process, since freed memory is kept for reuse: memory.py)
    asked: list[tuple] = []
    monkeypatch.setattr(hp, "_madvise", lambda: lambda *a: asked.append(a) or 0)
    off = _kernel(init)
    assert asked == []
    monkeypatch.undo()
    if hp.thp_mode() == "madvise" and hp._madvise() is not None:
        assert advised(on.big.weight)
    for a, b, w in zip((on.big, on.small), (off.big, off.small), init):
        assert torch.equal(a.weight, w) and torch.equal(b.weight, w)
    _train(on)
    _train(off)
    assert torch.equal(on.big.weight, off.big.weight) and torch.equal(on.small.weight, off.small.weight)
    assert not torch.equal(on.big.weight, init[0])  # the steps did update the big table


def test_a_partial_fill_leaves_zeros_elsewhere():
    def first_rows(w: torch.Tensor) -> None:
        w[:3].fill_(1.0)

    k = _kernel([first_rows, lambda w: None])
    assert bool((k.big.weight[:3] == 1).all()) and not k.big.weight[3:].any() and not k.small.weight.any()
    values, offsets = torch.tensor([0, 5, 1]), torch.tensor([0, 2, 2, 3, 3])
    expected = F.embedding_bag(values[:2], k.big.weight.detach(), torch.tensor([0]), mode="sum")
    assert torch.equal(k(values, offsets)[0, :64], expected[0])
