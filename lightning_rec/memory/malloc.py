"""glibc's malloc keeps what a CPU training step frees for the next step, instead of handing it back.

Each step allocates and frees the same large tensors (ids, pooled rows, their gradients, fbgemm's sorted
indices: megabytes each). glibc serves blocks above its mmap threshold (dynamic, at most 32 MiB) from fresh
mappings and trims the top of its heap on free, so the next step faults the same memory in again, one
4 KiB page at a time, and under virtualisation a fault is dear (the figures are in
``benchmarks/results/vs_torchrec_malloc_both.md`` and the README's memory section). With higher mmap and
trim thresholds freed blocks
stay in the heap and the next step reuses them: the process keeps its peak, as PyTorch's caching allocator
does with CUDA memory, and gives back only what frees more than ``_TRIM`` at once.

Applied once per process, when a fused kernel or a sharded collection is built on CPU; it affects every
later allocation of the process (glibc's allocator is process-wide). ``LIGHTNING_REC_MALLOC=0`` keeps
glibc's defaults; under another allocator (jemalloc, tcmalloc preloaded) it changes nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys

_ENV = "LIGHTNING_REC_MALLOC"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP = 256 << 20  # blocks up to this size come from the heap (and go back to it)
_TRIM = 1 << 30  # the heap's free top beyond this goes back to the system


@functools.cache
def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (once per process); False where it does not apply."""
    if os.environ.get(_ENV, "1") == "0" or not sys.platform.startswith("linux"):
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
