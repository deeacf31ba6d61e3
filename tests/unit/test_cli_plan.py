"""``lightning-rec plan``: table files in YAML and JSON, printed and JSON estimates, errors naming the line."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from lightning_rec.cli import TableFileError, load_tables, main

YAML = """\
tables:
  - name: user id table
    num_embeddings: 100000000
    embedding_dim: 128
    feature_names: [user_id]
    dtype: float16
  - name: item
    num_embeddings: 10000000
    embedding_dim: 128
    feature_names: [item_id, clicked]
    pooling_factors: {clicked: 50}
  - name: geo
    num_embeddings: 1000
    embedding_dim: 64
    feature_names: [geo]
    sharding_types: [data_parallel, table_wise]
together: []
"""


def test_plan_from_yaml_prints_and_writes_json(tmp_path, capsys) -> None:
    f = tmp_path / "tables.yaml"
    f.write_text(YAML)
    out = tmp_path / "plan.json"
    rc = main(["plan", str(f), "--world-size", "512", "--model-parallel-size", "8", "--device-memory", "80GB",
               "--host-memory", "1TB", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "world 512 = 64 replica(s) x 8 model-parallel ranks" in text and "user id table" in text
    d = json.loads(out.read_text())
    assert [t["table"] for t in d["tables"]] == ["user id table", "item", "geo"]
    assert d["tables"][2]["sharding_type"] in ("data_parallel", "table_wise")
    assert len(d["ranks"]) == 8 and d["step_time_ms"] > 0


def test_plan_from_json_list_to_stdout(tmp_path, capsys) -> None:
    tables = [{"name": f"t{i}", "num_embeddings": 1000, "embedding_dim": 32, "feature_names": [f"f{i}"],
               "pooling_factor": 4} for i in range(5)]
    f = tmp_path / "tables.json"
    f.write_text(json.dumps(tables, indent=1))
    assert main(["plan", str(f), "--world-size", "4", "--device", "cpu", "--json", "-"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["layout"]["world_size"] == 4 and len(d["tables"]) == 5


@pytest.mark.parametrize("body, message", [
    ("tables:\n  - name: a\n    num_embeddings: 10\n    embedding_dim: 4\n    feature_names: [f]\n"
     "  - name: b\n    num_embeddings: -1\n    embedding_dim: 4\n    feature_names: [g]\n",
     r"line 6, table 'b': table 'b': num_embeddings must be a positive int"),
    ("tables:\n  - name: a\n    embedding_dim: 4\n    feature_names: [f]\n", r"line 2, table 'a': missing \['num_embeddings'\]"),
    ("- name: a\n  num_embeddings: 10\n  embedding_dim: 4\n  feature_names: [f]\n  colour: red\n",
     r"line 1, table 'a': unknown keys \['colour'\]"),
    ("tables: [\n  {name: a,\n", r"line \d+: not valid YAML/JSON"),
    ("- name: a\n  num_embeddings: 10\n  embedding_dim: 4\n  feature_names: [f]\n  sharding_types: [diagonal]\n",
     r"line 1, table 'a': unknown sharding type 'diagonal'"),
])
def test_bad_files_name_the_line_and_table(tmp_path, body: str, message: str) -> None:
    f = tmp_path / "t.yaml"
    f.write_text(body)
    with pytest.raises(TableFileError, match=message):
        load_tables(f)


def test_infeasible_exits_2_with_missing_memory(tmp_path, capsys) -> None:
    f = tmp_path / "t.yaml"
    f.write_text("- {name: huge, num_embeddings: 1000000000, embedding_dim: 128, feature_names: [u]}\n")
    assert main(["plan", str(f), "--world-size", "8", "--device-memory", "16GB"]) == 2
    err = capsys.readouterr().err
    assert "missing" in err and "'huge'" in err


@pytest.mark.skipif(shutil.which("lightning-rec") is None, reason="console script not installed")
def test_console_script(tmp_path) -> None:
    f = tmp_path / "t.yaml"
    f.write_text(YAML)
    r = subprocess.run(["lightning-rec", "plan", str(f), "--world-size", "16", "--local-size", "8"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "estimated step time" in r.stdout
