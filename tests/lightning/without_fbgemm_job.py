"""A 2-process Trainer job on a torch that no fbgemm-gpu release is built for (torch 2.15 when this was written).
Where fbgemm-gpu is installed, that torch is simulated: fbgemm-gpu hidden (not importable, no installed
distribution) and torch naming itself 2.15.0; in an environment of torch 2.15 without fbgemm it runs as is.

``python -m tests.lightning.without_fbgemm_job``; Lightning's launcher runs it again for rank 1. Rank 0 checks
the import notice (exactly one), the trained state against one unsharded process, and the fused optimizers'
error, and exits non-zero on any mismatch.
"""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import sys
import warnings

_real_version = metadata.version


def _version(name: str) -> str:
    if name.startswith("fbgemm"):
        raise metadata.PackageNotFoundError(name)
    return _real_version(name)


SIMULATED = importlib.util.find_spec("fbgemm_gpu") is not None
if SIMULATED:
    metadata.version = _version
    sys.modules["fbgemm_gpu"] = None  # type: ignore[assignment]  # import fbgemm_gpu raises ImportError

import torch  # noqa: E402

if SIMULATED:
    torch.__version__ = "2.15.0"  # type: ignore[assignment]

with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    import lightning_rec  # noqa: F401

NOTICES = [str(w.message) for w in seen if "has no fbgemm-gpu release yet" in str(w.message)]


def main() -> None:
    from lightning_rec import full_state_dict
    from lightning_rec.fused_kinds import as_spec
    from lightning_rec.kernels import check_fused_available
    from tests.lightning.test_fabric import MIXED, _reference, _Resumed, _trainer

    model = _Resumed(start=0, plan=MIXED)
    trainer = _trainer(2, MIXED)
    trainer.fit(model)
    got = full_state_dict(model)
    if trainer.global_rank != 0:
        return
    assert len(NOTICES) == 1, NOTICES
    assert "fused embedding optimizers" in NOTICES[0] and "torch's own kernels" in NOTICES[0], NOTICES[0]
    want = _reference(2, "adagrad")
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
    try:
        check_fused_available(as_spec({"kind": "rowwise_adagrad", "lr": 0.1}), "cpu")
    except RuntimeError as e:
        assert "fbgemm-gpu is not installed" in str(e), e
    else:
        raise AssertionError("a fused optimizer was accepted without fbgemm-gpu")
    how = "simulated" if SIMULATED else f"torch {torch.__version__}, no fbgemm-gpu installed"
    print(f"without fbgemm ({how}): trained equal to one process", flush=True)


if __name__ == "__main__":
    main()
