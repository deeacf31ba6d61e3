"""Checkpoints written while sharded tables were ShardedTensors still load (issue 15, item 3).

The committed fixture (tests/fixtures/make_sharded_tensor_ckpt.py wrote it at commit 5ee0af6, 2 processes) holds
a row-wise, a table-wise and a column-wise table, fused row-wise Adagrad sums and a torch Adagrad's sums. It
loads into 1 process and into 2 processes in its own and in another layout, giving exactly what the writer saw.
"""

from __future__ import annotations

import torch

from lightning_rec import checkpoint as ckpt
from lightning_rec.testing import run_distributed
from tests.fixtures.make_sharded_tensor_ckpt import EXPECTED, ONE, OTHER, OUT, SAVED, observed, sharded


def _load_job(rank: int, ws: int, layouts: list[str]) -> dict:
    plans = {"saved": SAVED, "other": OTHER, "one": ONE}
    out = {}
    for name in layouts:
        model, opt = sharded(plans[name], seed=7)  # other initial weights: everything must come from the files
        meta = ckpt.load(OUT, model, [opt])
        out[name] = {"note": meta["note"], **observed(model, opt)}
    return out


def _check(got: dict, want: dict) -> None:
    assert got["note"] == "sharded_tensor fixture"
    for part in ("weights", "sums", "adagrad"):
        assert got[part].keys() == want[part].keys(), (part, got[part].keys())
        for k, v in want[part].items():
            assert torch.equal(got[part][k], v), f"{part} {k}: {got[part][k]} vs {v}"


def test_sharded_tensor_checkpoint_loads_into_one_process() -> None:
    want = torch.load(EXPECTED, weights_only=True)
    (r,) = run_distributed(_load_job, 1, ["one"])
    _check(r["one"], want)


def test_sharded_tensor_checkpoint_loads_into_two_processes_in_any_layout() -> None:
    want = torch.load(EXPECTED, weights_only=True)
    for r in run_distributed(_load_job, 2, ["saved", "other"]):
        _check(r["saved"], want)
        _check(r["other"], want)
