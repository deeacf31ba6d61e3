"""Without fbgemm-gpu (a torch that no fbgemm release is built for yet, which lightning_rec supports on torch's
kernels), a test that fails only because it needs fbgemm is reported as skipped, saying so; every other failure
stays a failure."""

from __future__ import annotations

import pytest

from tests.fbgemm_marks import FBGEMM

# what a test that needs fbgemm raises without it: the import itself, or the library's refusal of a fused optimizer
_MISSING = ("No module named 'fbgemm_gpu'", "fbgemm-gpu is not installed")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    outcome = yield
    report = outcome.get_result()
    if FBGEMM or call.excinfo is None or report.passed or report.skipped:
        return
    if any(m in str(call.excinfo.getrepr(chain=True)) for m in _MISSING):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, "Skipped: needs fbgemm-gpu, which is not installed")
