"""The planner across hosts: the link's speed (``Topology(host_link=...)``, ``lightning-rec plan --host-link``).

Cross-host bytes are charged at the inter-host speed, a host's link shared by its ranks; one host ignores it.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from lightning_rec import EmbeddingBagConfig
from lightning_rec.cli import _parser
from lightning_rec.plans.kinds import KINDS
from lightning_rec.plans.planner.cost import TIME_PARTS, CostModel
from lightning_rec.plans.planner.topology import parse_rate
from lightning_rec.sharding import (
    Hardware,
    Planner,
    ShardingPlan,
    Topology,
    row_wise,
    table_wise,
)

OUT = TIME_PARTS.index("output_dist")


@pytest.mark.parametrize(
    ("text", "bytes_per_s"),
    [("1gbit", 1.25e8), ("100Gb/s", 1.25e10), ("25Gbit/s", 3.125e9), ("12.5GB/s", 1.25e10), ("800mbit", 1e8)],
)
def test_parse_rate(text, bytes_per_s):
    assert parse_rate(text) == pytest.approx(bytes_per_s)
    assert parse_rate(3e9) == 3e9


@pytest.mark.parametrize("bad", ["fast", "0gbit", "-1gbit", True, 0, float("inf")])
def test_parse_rate_refuses(bad):
    with pytest.raises(ValueError, match="host_link"):
        parse_rate(bad)


def test_host_link_is_shared_by_the_hosts_ranks():
    topo = Topology(8, 8, 4, host_link="1gbit")
    assert topo.host_link == 1.25e8
    assert topo.hardware.inter_host_bandwidth == 1.25e8 / 4
    assert topo.hardware.intra_host_bandwidth == Hardware.defaults().intra_host_bandwidth
    # replace() runs __post_init__ again: the speed comes from the link, not halved twice
    again = replace(topo, hardware=topo.hardware)
    assert again.hardware.inter_host_bandwidth == 1.25e8 / 4
    given = Topology(8, 8, 4, hardware=Hardware.defaults("cuda"), host_link="400Gb/s")
    assert given.hardware.inter_host_bandwidth == 5e10 / 4
    assert given.hardware.lookup_bandwidth == Hardware.defaults("cuda").lookup_bandwidth
    assert Topology(8, 8, 4).host_link is None


def test_cli_host_link_flag():
    args = _parser().parse_args(["plan", "t.yaml", "--world-size", "4", "--local-size", "2", "--host-link", "1gbit"])
    assert args.host_link == "1gbit"


def _output_dist(topo: Topology, ps, hierarchical: bool = True) -> np.ndarray:
    """Per-rank output-dist seconds of one pooled table placed by ``ps`` (flat: no column blocks given)."""
    t = EmbeddingBagConfig(name="t", embedding_dim=64, num_embeddings=4096, feature_names=["f"])
    planner = Planner(topo, batch_size=256, default_pooling_factor=4)
    s = planner._stats("", t, "sparse")
    model = CostModel(planner.topology, 256)
    if hierarchical:
        return model.of_placement(s, ps).time[OUT]
    tiling = KINDS[ps.sharding_type].layout(t, ps, model.M, model.local)
    return model.sharded(s, tiling.rank, tiling.rows, tiling.cols, False, tiling.col_blocks, True).time[OUT]


def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=64, num_embeddings=50_000, feature_names=[f"f{i}"])
        for i in range(4)
    ]


def _estimate(link: str, plan: ShardingPlan) -> float:
    """The step estimate of ``plan`` on 2 hosts x 2 ranks joined by ``link``."""
    planner = Planner(Topology(4, 4, 2, host_link=link), batch_size=512, default_pooling_factor=20)
    return planner.estimate(_tables(), plan).step_time_ms


def test_slower_link_costs_more_where_more_crosses():
    rw = ShardingPlan({"": {f"t{i}": row_wise() for i in range(4)}})
    tw = ShardingPlan({"": {f"t{i}": table_wise(rank=i) for i in range(4)}})
    for plan in (rw, tw):
        assert _estimate("1gbit", plan) > _estimate("10gbit", plan) > _estimate("100gbit", plan)
    # row_wise sends every table's rows from both hosts, table_wise each from one rank
    assert _estimate("1gbit", rw) - _estimate("100gbit", rw) > _estimate("1gbit", tw) - _estimate("100gbit", tw)


def test_row_wise_against_table_wise_flips_with_the_link():
    # two tables on 2 hosts x 2 ranks: row_wise spreads every lookup over the 4 ranks, table_wise leaves 2 ranks
    # idle but sends each table's rows from one rank only (row_wise: from both hosts, added on each first)
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=64, num_embeddings=100_000, feature_names=[f"f{i}"])
        for i in range(2)
    ]
    rw = ShardingPlan({"": {"t0": row_wise(), "t1": row_wise()}})
    tw = ShardingPlan({"": {"t0": table_wise(rank=0), "t1": table_wise(rank=2)}})

    def est(link: str, plan: ShardingPlan) -> float:
        planner = Planner(Topology(4, 4, 2, host_link=link), batch_size=512, default_pooling_factor=1)
        return planner.estimate(tables, plan).step_time_ms

    assert est("400gbit", rw) < est("400gbit", tw)  # a fast link: spreading the lookups wins
    assert est("100mbit", rw) > est("100mbit", tw)  # a slow one: fewer bytes across win


def test_one_host_estimates_ignore_the_host_link():
    plan = ShardingPlan({"": {f"t{i}": row_wise() for i in range(4)}})
    one = Planner(Topology(4, 4, 4), batch_size=512, default_pooling_factor=20).estimate(_tables(), plan)
    again = Planner(Topology(4, 4, 4, host_link="1gbit"), batch_size=512, default_pooling_factor=20)
    assert again.estimate(_tables(), plan).step_time_ms == one.step_time_ms


def test_report_names_the_link():
    planner = Planner(Topology(4, 4, 2, host_link="1gbit"), batch_size=512, default_pooling_factor=20)
    planner.plan(_tables())
    rep = planner.explain()
    assert "1 Gbit/s link between hosts" in " ".join(str(rep).split())
    assert rep.as_dict()["layout"]["host_link_bytes_per_s"] == 1.25e8
