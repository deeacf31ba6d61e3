"""``lightning-rec plan``: table files in YAML and JSON, printed and JSON estimates, errors naming the line."""

from __future__ import annotations

import json
import re
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
    rc = main(
        [
            "plan",
            str(f),
            "--world-size",
            "512",
            "--model-parallel-size",
            "8",
            "--device-memory",
            "80GB",
            "--host-memory",
            "1TB",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "world 512 = 64 replica(s) x 8 model-parallel ranks" in text and "user id table" in text
    d = json.loads(out.read_text())
    assert [t["table"] for t in d["tables"]] == ["user id table", "item", "geo"]
    assert d["tables"][2]["sharding_type"] in ("data_parallel", "table_wise")
    assert len(d["ranks"]) == 8 and d["step_time_ms"] > 0


def test_plan_from_json_list_to_stdout(tmp_path, capsys) -> None:
    tables = [
        {"name": f"t{i}", "num_embeddings": 1000, "embedding_dim": 32, "feature_names": [f"f{i}"], "pooling_factor": 4}
        for i in range(5)
    ]
    f = tmp_path / "tables.json"
    f.write_text(json.dumps(tables, indent=1))
    assert main(["plan", str(f), "--world-size", "4", "--device", "cpu", "--json", "-"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["layout"]["world_size"] == 4 and len(d["tables"]) == 5


def test_plan_in_either_2d_arrangement(tmp_path, capsys) -> None:
    """The same job with replicas within a host: the replicas' sync stays off the link, and the plan says so."""
    tables = [
        {
            "name": f"t{i}",
            "num_embeddings": 20000,
            "embedding_dim": 64,
            "feature_names": [f"f{i}"],
            "pooling_factor": 20,
        }
        for i in range(8)
    ]
    f = tmp_path / "tables.json"
    f.write_text(json.dumps(tables))
    common = ["plan", str(f), "--world-size", "4", "--model-parallel-size", "2", "--device", "cpu"]
    common += ["--host-link", "1gbit", "--batch-size", "256", "--json", "-"]
    assert main([*common, "--local-size", "2"]) == 0
    across = json.loads(capsys.readouterr().out)
    assert main([*common, "--local-size", "1", "--replicas-within-host"]) == 0
    within = json.loads(capsys.readouterr().out)
    assert within["layout"]["replicas_within_host"] and "replicas_within_host" not in across["layout"]
    assert within["step_time_ms"] < across["step_time_ms"]  # as measured: benchmarks/results/hosts_2d.md
    assert main([*common[:-2], "--local-size", "1", "--replicas-within-host"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # the report wraps its lines
    assert "2 replica(s) x 2 model-parallel ranks, 1 ranks per host, replicas within a host" in text


@pytest.mark.parametrize(
    "body, message",
    [
        (
            "tables:\n  - name: a\n    num_embeddings: 10\n    embedding_dim: 4\n    feature_names: [f]\n"
            "  - name: b\n    num_embeddings: -1\n    embedding_dim: 4\n    feature_names: [g]\n",
            r"line 6: table 'b': num_embeddings must be a positive int",
        ),
        (
            "tables:\n  - name: a\n    embedding_dim: 4\n    feature_names: [f]\n",
            r"line 2, table 'a': missing \['num_embeddings'\]",
        ),
        (
            "- name: a\n  num_embeddings: 10\n  embedding_dim: 4\n  feature_names: [f]\n  colour: red\n",
            r"line 1, table 'a': unknown keys \['colour'\]",
        ),
        ("tables: [\n  {name: a,\n", r"line \d+: not valid YAML/JSON"),
        (
            "- name: a\n  num_embeddings: 10\n  embedding_dim: 4\n  feature_names: [f]\n  sharding_types: [diagonal]\n",
            r"line 1, table 'a': unknown sharding type 'diagonal'",
        ),
    ],
)
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
    r = subprocess.run(
        ["lightning-rec", "plan", str(f), "--world-size", "16", "--local-size", "8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "estimated step time" in r.stdout


# -- rough edges: one line naming the file / field / value, never a traceback --------------------------------
TABLE = "- {name: a, num_embeddings: 100, embedding_dim: 8, feature_names: [f]}\n"


@pytest.mark.parametrize(
    "body, args, message",
    [
        (
            "- {name: a, num_embeddings: 1e20, embedding_dim: 8, feature_names: [f]}\n",
            [],
            r"t.yaml line 1: table 'a': num_embeddings must be a positive int, got '1e20'",
        ),
        (
            "- {name: a, num_embeddings: 100000000000000000000, embedding_dim: 8, feature_names: [f]}\n",
            [],
            r"t.yaml line 1, table 'a': num_embeddings=100000000000000000000 is larger than the largest tensor size",
        ),
        (
            TABLE + "- {name: b, num_embeddings: 100, embedding_dim: 8, feature_names: [g, f]}\n",
            [],
            r"feature 'f' is listed by tables 'a' and 'b'; a feature may look up one table",
        ),
        (
            "- {name: a, num_embeddings: 100, embedding_dim: 64, feature_names: [f], "
            "sharding_types: [table_row_wise, grid_shard]}\n",
            [],
            r"table \['a'\]: no placement of the allowed sharding types \['table_row_wise', 'grid_shard'\].*1 host\(s\) x 4",
        ),
        (
            "- {name: a, num_embeddings: 100, embedding_dim: 8, feature_names: [f], "
            "placement: {sharding_type: table_wise, rank: 0}}\n",
            [],
            r"line 1, table 'a': placement keys \['rank'\] do not apply to table_wise; "
            r"it takes \['compute_kernel', 'ranks'\]",
        ),
        (
            TABLE,
            ["--json", "{tmp}/no/such/dir/plan.json"],
            r"--json .*no/such/dir/plan.json: the directory .* does not exist",
        ),
    ],
)
def test_rough_edges_are_one_line_errors(tmp_path, capsys, body: str, args: list[str], message: str) -> None:
    f = tmp_path / "t.yaml"
    f.write_text(body)
    rc = main(["plan", str(f), "--world-size", "4", *[a.replace("{tmp}", str(tmp_path)) for a in args]])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err


def test_a_binary_table_file_is_named(tmp_path, capsys) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(bytes(range(256)) * 4)
    assert main(["plan", str(f), "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "weights.bin" in err and "not a YAML or JSON text file" in err and len(err.strip().splitlines()) == 1


def test_json_into_an_unwritable_path_is_an_error_naming_it(tmp_path, capsys) -> None:
    f = tmp_path / "t.yaml"
    f.write_text(TABLE)
    target = tmp_path / "plan.json"
    target.mkdir()  # a directory where the file should go
    assert main(["plan", str(f), "--world-size", "2", "--json", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"--json {target}: cannot write" in err and "Traceback" not in err
