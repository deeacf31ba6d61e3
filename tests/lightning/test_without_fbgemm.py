"""A torch that no fbgemm-gpu release is built for yet: the library imports with one notice and trains on torch's
kernels like one process (2 processes under the Trainer); fused optimizers say what to install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_torch_without_fbgemm_trains_on_torch_kernels() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "tests.lightning.without_fbgemm_job"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert "trained equal to one process" in p.stdout
