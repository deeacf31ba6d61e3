"""memory.py: after keep_freed_memory, a step's large tensors reuse freed memory (no fresh page faults)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from lightning_rec import memory as _memory

_glibc_linux = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"

# A "step" allocates, fills and frees tensors of 3.6-38 MB (the largest above glibc's top dynamic mmap
# threshold, 32 MiB); print the minor page faults of ten steps after ten warm-up ones. In a fresh process:
# the setting is process-wide.
_SCRIPT = """
import importlib.util, resource, sys, torch
spec = importlib.util.spec_from_file_location("_memory", sys.argv[1])  # the module alone: a quick start
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
applied = module.keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():
    ts = [torch.empty(n).fill_(1.0) for n in (900_000, 1_800_000, 4_800_000, 9_600_000)]
    del ts
for _ in range(10):
    step()
before = faults()
for _ in range(10):
    step()
print(applied, faults() - before)
"""
_BIGGEST = 10 * 9_600_000 * 4 // 4096  # the pages of the 38 MB tensor over ten steps


def _run(env_value: str | None = None) -> tuple[str, int]:
    env = dict(os.environ)
    env.pop("LIGHTNING_REC_MALLOC", None)
    if env_value is not None:
        env["LIGHTNING_REC_MALLOC"] = env_value
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, _memory.__file__],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not _glibc_linux, reason="glibc's mallopt: Linux with glibc only")
def test_freed_memory_is_reused_without_page_faults() -> None:
    applied, kept = _run()
    assert applied == "True"
    assert kept < _BIGGEST // 20, f"{kept} page faults for memory freed and allocated again"
    # opted out, glibc's own thresholds: the 38 MB block is a fresh mapping every step
    applied, default = _run(env_value="0")
    assert applied == "False" and default > _BIGGEST // 2, default
