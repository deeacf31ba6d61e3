"""Version checks run at import time (lightning_rec._compat.check_versions)."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from lightning_rec import _compat
from lightning_rec._compat import check_versions
from tests.fbgemm_marks import needs_fbgemm


@pytest.mark.parametrize(
    "torch_version,fbgemm",
    [
        ("2.13.0", ("fbgemm-gpu-cpu", "1.8.0")),
        ("2.13.0+cpu", ("fbgemm-gpu-cpu", "1.8.0")),
        ("2.13.1+cu128", ("fbgemm-gpu", "1.8.0+cu128")),
        ("2.13.0", ("fbgemm-gpu", "1.8.2")),
        ("2.11.0+cu130", ("fbgemm-gpu-cpu", "1.6.0")),
        ("2.12.1", ("fbgemm-gpu", "1.7.0")),
        ("2.14.1+cu130", ("fbgemm-gpu-cpu", "1.9.0")),
        ("2.14.0", ("fbgemm-gpu", "1.9.0")),
    ],
)
def test_matching_versions_pass(torch_version: str, fbgemm: tuple[str, str]) -> None:
    check_versions(torch_version, fbgemm)


def test_torch_mismatch_names_both_versions() -> None:
    with pytest.raises(ImportError) as err:
        check_versions("2.12.0", ("fbgemm-gpu-cpu", "1.8.0"))
    msg = str(err.value)
    assert "fbgemm-gpu-cpu==1.8.0" in msg
    assert "torch 2.13.x" in msg  # what this fbgemm needs
    assert "torch 2.12.0 is installed" in msg  # what is there
    assert "pip install torch==2.14.1" in msg  # the default pair
    with pytest.raises(ImportError, match=re.escape("torch 2.14.0+cpu is installed")):
        check_versions("2.14.0+cpu", ("fbgemm-gpu-cpu", "1.8.0"))
    with pytest.raises(ImportError, match=re.escape("torch 2.15.0 is installed")):  # no fbgemm for 2.15 yet
        check_versions("2.15.0", ("fbgemm-gpu-cpu", "1.9.0"))


def test_missing_fbgemm() -> None:
    with pytest.raises(ImportError, match="fbgemm-gpu kernels, which are not installed") as err:
        check_versions("2.13.0", None)
    assert "fbgemm-gpu-cpu==1.8.0" in str(err.value)


@pytest.mark.parametrize("torch_version", ["2.15.0", "2.15.1+cu130", "2.16.0", "3.0.0"])
def test_a_torch_ahead_of_every_fbgemm_release_imports_with_one_notice(torch_version: str) -> None:
    with pytest.warns(UserWarning, match="has no fbgemm-gpu release yet") as seen:
        check_versions(torch_version, None)
    assert len(seen) == 1
    text = str(seen[0].message)
    assert f"torch {torch_version}" in text and "fused embedding optimizers" in text
    assert "pip install torch==2.14.1 'fbgemm-gpu-cpu==1.9.0'" in text


def test_unsupported_fbgemm_release() -> None:
    with pytest.raises(ImportError, match=re.escape("fbgemm-gpu==1.5.0 is not a supported fbgemm-gpu release")) as err:
        check_versions("2.13.0", ("fbgemm-gpu", "1.5.0"))
    assert "1.8.x" in str(err.value)


@needs_fbgemm
def test_installed_environment_passes() -> None:
    dist = _compat.fbgemm_distribution()
    assert dist is not None and dist[0].startswith("fbgemm-gpu")
    check_versions(torch.__version__, dist)


def test_torch_fbgemm_pairs() -> None:
    # each supported torch has its fbgemm; a mismatch names the fbgemm release that fits the installed torch
    with pytest.raises(ImportError) as err:
        check_versions("2.11.0+cu130", ("fbgemm-gpu-cpu", "1.8.0"))
    assert "torch 2.13.x" in str(err.value) and "'fbgemm-gpu-cpu==1.6.0'" in str(err.value)
    with pytest.raises(ImportError, match=re.escape("torch 2.12.x")):
        check_versions("2.13.0", ("fbgemm-gpu", "1.7.0"))
    assert _compat.fbgemm_for_torch("2.11.0+cu130") == "1.6.0"
    assert _compat.fbgemm_for_torch("2.12.0") == "1.7.0"
    assert _compat.fbgemm_for_torch("2.13.1") == "1.8.0"
    assert _compat.fbgemm_for_torch("2.14.1") == "1.9.0"
    assert _compat.fbgemm_for_torch("2.15.0") is None
    assert _compat.torch_ahead_of_fbgemm("2.15.0") and not _compat.torch_ahead_of_fbgemm("2.14.1+cu130")
    assert not _compat.torch_ahead_of_fbgemm("2.10.0")  # older than every release: refused, not ahead
    assert _compat.fbgemm_install_hint("2.11.0", "cuda") == "pip install 'fbgemm-gpu==1.6.0'"
    assert _compat.fbgemm_install_hint("2.13.0", "cpu") == "pip install 'fbgemm-gpu-cpu==1.8.0'"


def _fbgemm_notice(fbgemm: str, torch_version: str) -> str:
    # the text fbgemm-gpu 1.6 / 1.7 log at import (fbgemm_gpu/__init__.py, _load_library), colour codes included
    return (
        f"\n            \033[33m\n            _fbgemm_torch_compat_table has no entry for {fbgemm} of FBGEMM;\n"
        f"            cannot determine compatibility with PyTorch {torch_version}\n            \033[0m\n            "
    )


@pytest.mark.parametrize(
    "fbgemm,torch_version,shown",
    [
        ("1.7.0", "2.12.0+cu130", False),  # supported pairs: the notice is noise
        ("1.6.0", "2.11.0", False),
        ("1.6.0", "2.13.0", True),  # a pair check_versions refuses, or a release it does not know, stays visible
        ("1.9.0", "2.14.0", False),
        ("2.0.0", "2.15.0", True),
    ],
)
def test_fbgemm_compat_notice_dropped_only_for_supported_pairs(fbgemm, torch_version, shown, caplog) -> None:
    # the filter sits on the root logger, where fbgemm logs: caplog's handler only sees what passes it
    caplog.set_level(logging.WARNING)
    logging.getLogger().warning(_fbgemm_notice(fbgemm, torch_version))
    logging.getLogger().warning("an unrelated warning")
    messages = [r.getMessage() for r in caplog.records]
    assert "an unrelated warning" in messages
    assert any(f"no entry for {fbgemm} of FBGEMM" in m for m in messages) == shown
