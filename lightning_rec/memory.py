"""The process memory policy on CPU: memory a training step frees stays with the process for the next step,
and the fused kernel's tables sit on transparent huge pages where the system allows.

**glibc's malloc keeps what a step frees** (:func:`keep_freed_memory`). Each step allocates and frees the same
large tensors (ids, pooled rows, their gradients, fbgemm's sorted indices: megabytes each). glibc serves blocks
above its mmap threshold (dynamic, at most 32 MiB) from fresh mappings and trims the top of its heap on free, so
the next step faults the same memory in again, one 4 KiB page at a time, and under virtualisation a fault is dear
(the figures are in ``benchmarks/results/vs_torchrec_malloc_both.md`` and the README's memory section). With
higher mmap and trim thresholds freed blocks stay in the heap and the next step reuses them: the process keeps its
peak, as PyTorch's caching allocator does with CUDA memory, and gives back only what frees more than ``_TRIM`` at
once. Applied once per process, when a fused kernel or a sharded collection is built on CPU; it affects every
later allocation of the process (glibc's allocator is process-wide). ``LIGHTNING_REC_MALLOC=0`` keeps glibc's
defaults; under another allocator (jemalloc, tcmalloc preloaded) it changes nothing.

**Transparent huge pages under the fused kernel's tables** (:func:`zero_into_huge_pages`; Linux, THP in
``madvise`` mode). fbgemm's CPU backward updates one row per distinct id, scattered over tables far larger than
the caches, one row after the other: with 4 KiB pages most of those rows also miss the TLB, and the page walk adds
to the memory latency the update already waits for. 2 MiB pages take the walk out of the fused kernel's step
(forward + backward + update; measured against fbgemm's own module on the same tables in
``benchmarks/results/kernels_huge_pages.md``). With THP ``always`` the kernel already gets them, with ``never``
nobody does; only ``madvise`` (a common default) needs asking. ``LIGHTNING_REC_HUGE_PAGES=0`` turns it off.

The module imports nothing of lightning_rec, so it loads alone (``tests/integration/test_malloc.py``).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
from collections.abc import Callable

import torch

_MALLOC_ENV = "LIGHTNING_REC_MALLOC"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP = 256 << 20  # blocks up to this size come from the heap (and go back to it)
_TRIM = 1 << 30  # the heap's free top beyond this goes back to the system

_HUGE_PAGES_ENV = "LIGHTNING_REC_HUGE_PAGES"
_HUGE = 2 << 20
_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (once per process); False where it does not apply."""
    if os.environ.get(_MALLOC_ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM))


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode (``always`` / ``madvise`` / ``never``), None if unknown."""
    try:
        with open(_THP_ENABLED) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


@functools.cache
def _madvise() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def zero_into_huge_pages(t: torch.Tensor) -> bool:
    """Zero the CPU tensor ``t`` and, where the system allows, back it with huge pages from then on.

    For storage whose contents do not matter yet (the caller fills it next): the 2 MiB-aligned middle of
    ``t`` is marked ``MADV_HUGEPAGE`` and its pages dropped, so that the caller's first write faults in
    huge pages, zero-filled; the ends are zeroed in place. Returns whether huge pages were asked for (False:
    ``t`` is only zeroed: too small, not on CPU, THP not in ``madvise`` mode, turned off, or refused).
    """
    done = False
    # (shared storage is left alone: dropping a shared mapping's pages would not zero them)
    wanted = t.device.type == "cpu" and t.is_contiguous() and not t.is_shared()
    if wanted and os.environ.get(_HUGE_PAGES_ENV, "1") != "0" and thp_mode() == "madvise":
        madvise = _madvise()
        start = t.data_ptr()
        first = -(-start // _HUGE) * _HUGE
        last = (start + t.numel() * t.element_size()) // _HUGE * _HUGE
        if madvise is not None and last > first:
            span = ctypes.c_size_t(last - first)
            # dropped pages read back as zeros; if either call fails, zero_() below writes them instead
            done = madvise(first, span, _MADV_HUGEPAGE) == 0 and madvise(first, span, _MADV_DONTNEED) == 0
            if done:
                flat = t.view(-1).view(torch.uint8)
                flat[: first - start].zero_()
                flat[last - start :].zero_()
    if not done:
        t.zero_()
    return done
