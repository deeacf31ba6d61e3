"""Resident memory of this process, and its peak while a function runs (shared by the memory benchmarks)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def rss_mib() -> float:
    """This process's resident set, MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_during(fn: Callable[[], T]) -> tuple[T, float]:
    """``(fn(), the highest resident set seen while it ran, MiB)``, sampled every millisecond by a thread."""
    peak, done = [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_mib())
            time.sleep(0.001)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        out = fn()
    finally:
        done.set()
        t.join()
    return out, max(peak[0], rss_mib())
