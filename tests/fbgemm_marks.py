"""Whether fbgemm-gpu is installed, and the mark of tests that need it (a torch that no fbgemm release is built
for yet runs lightning_rec without it)."""

from __future__ import annotations

import importlib.util

import pytest

FBGEMM = importlib.util.find_spec("fbgemm_gpu") is not None
needs_fbgemm = pytest.mark.skipif(not FBGEMM, reason="needs fbgemm-gpu, which is not installed")
