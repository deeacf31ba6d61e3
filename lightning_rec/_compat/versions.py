"""Which torch each fbgemm-gpu release is built for, the check run when lightning_rec is imported, and the
fbgemm import notice dropped for pairs that check accepts."""

from __future__ import annotations

import logging
import re
import warnings
from importlib import metadata

# fbgemm-gpu wheels are built against one torch minor release; a mismatch fails later with undefined
# symbols deep inside torch.ops, so we check at import time. fbgemm minor -> the torch minor it is built for.
_FBGEMM_TORCH = {"1.6": "2.11", "1.7": "2.12", "1.8": "2.13", "1.9": "2.14"}
_DEFAULT_TORCH = "2.14"
_DEFAULT_RELEASE = "2.14.1"  # the default pair's torch release (the Makefile's TORCH)


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def _minor_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in _minor(version).split(".") if p.isdigit())


def fbgemm_for_torch(torch_version: str) -> str | None:
    """The fbgemm-gpu release (``"1.9.0"``) built for ``torch_version``'s minor release, None if unsupported."""
    for fbgemm, torch_minor in _FBGEMM_TORCH.items():
        if torch_minor == _minor(torch_version):
            return f"{fbgemm}.0"
    return None


def torch_ahead_of_fbgemm(torch_version: str) -> bool:
    """Whether ``torch_version`` is newer than every torch an fbgemm-gpu release is built for (yet)."""
    return _minor_key(torch_version) > max(_minor_key(t) for t in _FBGEMM_TORCH.values())


def fbgemm_install_hint(torch_version: str, device_type: str = "cpu") -> str:
    """``pip install ...`` naming the fbgemm-gpu build and release that match this torch (CUDA or CPU build)."""
    package = "fbgemm-gpu" if device_type == "cuda" else "fbgemm-gpu-cpu"
    fbgemm = fbgemm_for_torch(torch_version)
    if fbgemm is None:
        default = fbgemm_for_torch(_DEFAULT_TORCH)
        return f"pip install torch=={_DEFAULT_RELEASE} '{package}=={default}'"
    return f"pip install '{package}=={fbgemm}'"


def fbgemm_distribution() -> tuple[str, str] | None:
    for dist in ("fbgemm-gpu-cpu", "fbgemm-gpu", "fbgemm-gpu-nightly", "fbgemm-gpu-nightly-cpu"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def without_fbgemm_notice(torch_version: str) -> str:
    """What runs, and what does not, on a torch that no fbgemm-gpu release is built for yet."""
    return (
        f"lightning_rec: torch {torch_version} has no fbgemm-gpu release yet (the newest pair is torch "
        f"{_DEFAULT_TORCH} with fbgemm-gpu {fbgemm_for_torch(_DEFAULT_TORCH)}), and none is installed: lookups, "
        "input dists and sparse ops run on torch's own kernels (slower), and fused embedding optimizers "
        "(embedding_optimizer=..., apply_optimizer_in_backward, compute_kernel='fbgemm') are unavailable. For "
        f"those: {fbgemm_install_hint(torch_version)}"
    )


def check_versions(torch_version: str, fbgemm: tuple[str, str] | None) -> None:
    """Raise ImportError when fbgemm-gpu is missing or built for another torch. A torch newer than every fbgemm
    release, with none installed, imports (torch kernels only) with one warning saying what that costs."""
    pairs = ", ".join(f"torch {t}.x with fbgemm-gpu {f}.x" for f, t in _FBGEMM_TORCH.items())
    default = fbgemm_for_torch(_DEFAULT_TORCH)
    hint = f"pip install torch=={_DEFAULT_RELEASE} 'fbgemm-gpu-cpu=={default}'  (CPU) or 'fbgemm-gpu=={default}' (CUDA)"
    own = fbgemm_for_torch(torch_version)
    if own is not None:
        hint = (
            f"pip install 'fbgemm-gpu-cpu=={own}' (CPU) or 'fbgemm-gpu=={own}' (CUDA) for torch "
            f"{_minor(torch_version)}, or {hint}"
        )
    if fbgemm is None:
        if torch_ahead_of_fbgemm(torch_version):
            warnings.warn(without_fbgemm_notice(torch_version), stacklevel=3)
            return
        raise ImportError(f"lightning_rec needs the fbgemm-gpu kernels, which are not installed. Install: {hint}")
    dist, version = fbgemm
    want = _FBGEMM_TORCH.get(_minor(version))
    if want is None:
        raise ImportError(
            f"{dist}=={version} is not a supported fbgemm-gpu release (supported: "
            f"{', '.join(k + '.x' for k in _FBGEMM_TORCH)}: {pairs}). Install: {hint}"
        )
    if _minor(torch_version) != want:
        raise ImportError(
            f"{dist}=={version} is built for torch {want}.x but torch {torch_version} is installed; "
            f"mixing them crashes with undefined symbols. Supported pairs: {pairs}. Install matching versions: {hint}"
        )


# fbgemm-gpu 1.6 and 1.7 ship a compatibility table that stops at 1.5, so importing them logs "has no entry for
# 1.7.0 of FBGEMM; cannot determine compatibility" once per library: 14 root-logger warnings per process (28 in
# a 2-rank job) for a pair we support. fbgemm 1.8's table lists 1.6-1.8. Drop only that notice, and only when the
# pair it names is one check_versions accepts: an unknown release or another torch still shows it.
_FBGEMM_NO_ENTRY = re.compile(r"no entry for (\S+) of FBGEMM;\s*cannot determine compatibility with PyTorch (\S+)")


def fbgemm_notice_filter(record: logging.LogRecord) -> bool:
    """False for fbgemm-gpu's "no entry in its compatibility table" notice about a supported torch/fbgemm pair."""
    match = _FBGEMM_NO_ENTRY.search(record.getMessage())
    return match is None or _FBGEMM_TORCH.get(_minor(match.group(1))) != _minor(match.group(2))


# fbgemm logs on the root logger (logging.warning), where a logger filter sees it before any handler
logging.getLogger().addFilter(fbgemm_notice_filter)
