"""The plan report adds up and fits the terminal: every rank's time columns sum to its total (the collectives'
latency is a column), and no line is wider than 100 characters."""

from __future__ import annotations

import random
import re

import pytest
import torch

from lightning_rec import EmbeddingBagConfig
from lightning_rec.plans.planner import TIME_PARTS
from lightning_rec.sharding import Planner, ShardingPlan, TableConstraint, Topology, column_wise, data_parallel

WIDTH = 100


def _reports():
    rng = random.Random(3)
    out = []
    for world, mp, local, grads, device in [
        (1, 1, 1, "sparse", "cpu"),
        (2, 2, 2, "fused", "cpu"),
        (8, 4, 2, "fused", "cuda"),
        (64, 64, 8, "dense", "cuda"),
    ]:
        tables = [
            EmbeddingBagConfig(
                rng.choice([10, 10**4, 10**6]),
                rng.choice([16, 64, 128]),
                f"a table with a rather long name number {i}",
                [f"f{i}", f"g{i}"][: rng.randint(1, 2)],
                dtype=rng.choice([torch.float32, torch.float16]),
            )
            for i in range(rng.randint(3, 30))
        ]
        planner = Planner(
            Topology(world, mp, local, device=device),
            batch_size=rng.choice([64, 4096]),
            default_pooling_factor=rng.choice([1, 30]),
            gradients=grads,
            optimizer="adagrad" if grads != "fused" else "sgd",
            constraints={tables[0].name: TableConstraint(sharding_types=["data_parallel"])},
        )
        planner.plan(tables)
        out.append(planner.explain())
        fixed = {t.name: data_parallel() for t in tables}
        if mp > 1:
            fixed[tables[-1].name] = column_wise(list(range(2)))
        out.append(planner.estimate(tables, ShardingPlan({"": fixed})))
    return out


REPORTS = _reports()


@pytest.mark.parametrize("report", REPORTS)
def test_time_columns_add_up_to_the_total(report) -> None:
    text = str(report)
    header = next(line for line in text.splitlines() if line.startswith("per rank, ms: "))
    columns = header.removeprefix("per rank, ms: ").split(", ")
    assert columns == [*TIME_PARTS, "latency"]
    rows = re.findall(r"rank +\d+: +([\d.]+) ms = ([\d. ]+)$", text, flags=re.M)
    assert rows
    for total, parts in rows:
        values = [float(x) for x in parts.split()]
        assert len(values) == len(columns)
        # each printed value is rounded to 0.001 ms
        assert abs(sum(values) - float(total)) <= 0.0005 * (len(values) + 1), (total, parts)
    for r in report.as_dict()["ranks"]:
        parts = sum(r[f"{p}_ms"] for p in (*TIME_PARTS, "latency"))
        assert parts == pytest.approx(r["time_ms"], rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("report", REPORTS)
def test_lines_fit_in_100_columns(report) -> None:
    report.notes.append("a note long enough to need wrapping: " + "every word of it matters " * 8)
    lines = str(report).splitlines()
    assert max(len(line) for line in lines) <= WIDTH, [line for line in lines if len(line) > WIDTH]
    assert "every word of it matters" in str(report)


def test_times_below_a_microsecond_keep_two_digits() -> None:
    # a GPU's per-table times: printed as 0.000 they said nothing
    from lightning_rec.plans.planner.topology import human_ms

    assert [human_ms(x) for x in (0, 2.613, 0.002, 0.00012, 0.0000123)] == [
        "0.000",
        "2.613",
        "0.002",
        "0.00012",
        "0.000012",
    ]
    tables = [EmbeddingBagConfig(100, 16, f"t{i}", [f"f{i}"]) for i in range(3)]
    planner = Planner(Topology(1, device="cuda"), batch_size=8)
    planner.plan(tables)
    table_rows = [line for line in str(planner.explain()).splitlines() if line.startswith("t")]
    assert table_rows and not any(line.split()[-1] == "0.000" for line in table_rows), table_rows
