"""``lightning-rec profile`` and ``lightning-rec plan --speeds``: the plumbing (what is written, read and named),
never how fast anything ran."""

from __future__ import annotations

import json

from lightning_rec.cli import main
from lightning_rec.plans.planner import ProfiledSpeeds, TableProfile

TABLES = """\
tables:
  - {name: user, num_embeddings: 100000, embedding_dim: 64, feature_names: [user_id]}
  - {name: item, num_embeddings: 1000, embedding_dim: 64, feature_names: [item_id], pooling_factor: 10}
"""


def _speeds(device: str) -> ProfiledSpeeds:
    tables = (TableProfile("user", 100000, 64, 4, 1, 1.0, "sparse", 512, 1.0, 0.5, 2e10, 3e10),)
    return ProfiledSpeeds(device, "a device", "box7", {"torch": "x"}, "2026-11-28T10:00:00+00:00", 1, tables)


def test_plan_names_the_speeds_it_used(tmp_path, capsys) -> None:
    tables = tmp_path / "tables.yaml"
    tables.write_text(TABLES)
    cpu = tmp_path / "cpu.json"
    _speeds("cpu").save(cpu)
    args = ["plan", str(tables), "--world-size", "2", "--device", "cpu"]
    assert main(args) == 0
    assert "speeds=defaults (cpu/gloo)" in capsys.readouterr().out
    assert main([*args, "--speeds", str(cpu), "--json", "-"]) == 0
    settings = json.loads(capsys.readouterr().out)["settings"]
    assert settings["speeds"].startswith(f"profile {cpu} (box7, cpu a device, 2026-11-28T10:00")
    assert settings["speeds"].endswith("1 own, 1 nearest")  # item: the profiled table of the nearest size
    # a file from another device type is refused, naming both
    assert main(["plan", str(tables), "--world-size", "2", "--speeds", str(cpu)]) == 2
    err = capsys.readouterr().err
    assert "measured on cpu" in err and "this plan is for cuda" in err


def test_profile_writes_a_speeds_file_the_planner_reads(tmp_path, capsys) -> None:
    out = tmp_path / "speeds.json"
    args = ["profile", "-o", str(out), "--size", "1e-5", "--batch-size", "32", "--batches", "2", "--repeats", "1"]
    assert main([*args, "--multi-hot", "cat_1=4", "--embedding-optimizer", "{kind: sgd, lr: 0.01}"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"wrote {out}: profile") and "lookup GB/s" in text
    sp = ProfiledSpeeds.load(out, "cpu")
    assert len(sp.tables) == 26 and {t.grads for t in sp.tables} == {"fused"}
    assert sp.tables[1].name == "t_cat_1" and sp.tables[1].ids > 1  # the multi-hot feature's bags
    assert main(["profile", "-o", str(out), "--multi-hot", "cat_1"]) == 2
    assert "expected FEATURE=N" in capsys.readouterr().err
    assert main(["profile", "-o", str(out), "--device", "cuda", "--processes", "2"]) == 2
    assert "above 1 on the CPU only" in capsys.readouterr().err
