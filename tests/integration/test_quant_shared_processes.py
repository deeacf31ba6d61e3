"""Serving workers share one read-only copy of the quantized tables: two real processes map the same file (a
process test, so it lives outside the unit tier)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_rec import quantize_embeddings
from lightning_rec.quant.shared import save_quantized
from tests.unit.test_quant_shared import Model, _kjt

ROOT = Path(__file__).resolve().parents[2]


_CHILD = """
import json, sys, torch
from tests.unit.test_quant_shared import Model, _kjt
from lightning_rec.quant.shared import load_quantized_tables
path = sys.argv[1]
m = load_quantized_tables(path, Model(rows=20000))
with torch.no_grad():
    out = m(_kjt())
sums = {n: int(t.weight.sum()) for n, t in m.sparse.embedding_bags.named_children()}  # reads every page
entry, lines = {}, open("/proc/self/smaps").read().splitlines()
for i, line in enumerate(lines):
    if line.endswith(path):
        entry["perms"] = line.split()[1]
        for more in lines[i + 1 :]:
            k, _, v = more.partition(":")
            if " " in k:  # the next mapping's first line
                break
            if v.strip().endswith("kB"):
                entry[k] = int(v.split()[0]) * 1024
print(json.dumps({"out": out.flatten().tolist(), "sums": sums, "map": entry}))
sys.stdout.flush()
sys.stdin.read()  # hold the mapping until the parent has looked
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/smaps")
def test_two_processes_share_one_read_only_copy(tmp_path: Path) -> None:
    torch.manual_seed(0)
    q = quantize_embeddings(Model(rows=20000), torch.qint8)
    path = str(save_quantized(q, tmp_path / "model.lrq").resolve())
    table_bytes = q.sparse.storage_bytes()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs: list[subprocess.Popen] = []
    try:
        got = []
        for _ in range(2):  # the second starts once the first holds the mapping, every page read
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _CHILD, path],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    cwd=ROOT,
                    env=env,
                )
            )
            got.append(json.loads(procs[-1].stdout.readline()))
        with torch.no_grad():
            want = q(_kjt()).flatten().tolist()
        for g in got:
            assert g["out"] == pytest.approx(want, abs=0) and g["sums"] == got[0]["sums"]
            m = g["map"]
            assert m["perms"] == "r--s", m  # read-only, shared
            assert m["Rss"] >= table_bytes * 0.9, m  # every page read...
            assert m["Anonymous"] == 0, m  # ...none copied (a private mapping copies the pages written)
        # the pages the second process read are the first one's: shared, not its own
        second = got[1]["map"]
        assert second["Shared_Clean"] + second["Shared_Dirty"] >= table_bytes * 0.9, second
        assert second["Private_Clean"] + second["Private_Dirty"] < table_bytes * 0.1, second
    finally:
        for p in procs:
            p.communicate("", timeout=60)
