"""The 2D arrangement: which groups a host holds, what the cost model charges for each, and the planner's choice."""

from __future__ import annotations

import pytest

from lightning_rec import EmbeddingBagConfig
from lightning_rec.plans.mesh import MeshInfo, group_local_size
from lightning_rec.plans.planner import CostModel, Topology, choose_arrangement


def _tables(n: int, rows: int, dim: int) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=dim, feature_names=[f"f{i}"])
        for i in range(n)
    ]


def test_group_local_size_per_arrangement() -> None:
    # 2 hosts x 4 ranks, 2 replicas x 4-way model parallel
    assert group_local_size(4, 2, 4, False) == 4  # the shard group is one host
    assert group_local_size(4, 2, 4, True) == 2  # each host holds 2 ranks of each shard group
    assert group_local_size(2, 2, 2, True) == 1
    with pytest.raises(ValueError, match="3 replicas of a shard must sit on one host.*2 ranks"):
        group_local_size(2, 3, 2, True)


def test_topology_of_a_mesh_keeps_its_arrangement() -> None:
    mesh = MeshInfo(None, None, None, 2, 2, 1, True)  # type: ignore[arg-type]
    topo = Topology.from_mesh(mesh, host_link="1gbit")
    assert topo.replicas_within_host and topo.ranks_per_host == 2 and topo.num_hosts == 2
    # both ranks of a host send across its link at once
    assert topo.hardware is not None and topo.hardware.inter_host_bandwidth == pytest.approx(125e6 / 2)
    assert not Topology.from_mesh(MeshInfo(None, None, None, 2, 2, 2)).replicas_within_host  # type: ignore[arg-type]


def test_the_replicas_sync_is_charged_on_the_link_it_crosses() -> None:
    within = CostModel(Topology(4, 2, 1, host_link="1gbit", replicas_within_host=True), 64)
    assert within.hw is not None and within.replica_bw == within.hw.intra_host_bandwidth
    # model parallel within a host: no exchange of the group crosses, but the replicas' sync does, every rank of
    # the host at once
    across = CostModel(Topology(4, 2, 2, host_link="1gbit"), 64)
    assert across.replica_bw == pytest.approx(125e6 / 2)
    assert CostModel(Topology(4, 2, 2), 64).replica_bw == CostModel(Topology(4, 2, 2), 64).hw.inter_host_bandwidth


def test_the_planner_keeps_replicas_on_a_host_when_their_sync_outweighs_the_exchanges() -> None:
    # many ids per sample: each shard's replicas would sync thousands of touched rows across the link
    heavy = choose_arrangement(
        _tables(8, 20000, 64), 2, 4, 2, batch_size=256, default_pooling_factor=20.0, host_link="1gbit"
    )
    assert heavy.replicas_within_host and heavy.local_size == 1
    assert heavy.step_ms[True] < heavy.step_ms[False]
    assert heavy.planner.topology.replicas_within_host  # type: ignore[attr-defined]
    # one id per sample on wide rows: the pooled rows the exchanges carry outweigh the touched rows
    wide = choose_arrangement(
        _tables(8, 1000, 128), 2, 4, 2, batch_size=1024, default_pooling_factor=1.0, host_link="1gbit"
    )
    assert not wide.replicas_within_host and wide.local_size == 2
    assert wide.step_ms[False] < wide.step_ms[True]


@pytest.mark.parametrize(
    ("group", "world", "per_host"),
    [(4, 4, 2), (2, 4, 4), (2, 6, 2)],  # one replica; one host; a host cannot hold 3 replicas
)
def test_only_the_default_where_the_other_arrangement_cannot_be_built(group: int, world: int, per_host: int) -> None:
    got = choose_arrangement(_tables(2, 20000, 64), group, world, per_host, default_pooling_factor=20.0)
    assert not got.replicas_within_host and list(got.step_ms) == [False]
