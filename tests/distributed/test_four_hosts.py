"""Four simulated hosts of one rank each (the issue's 4 x 1 shape), each in its own network namespace, joined by
1 Gbit/s links (``tests/distributed/hosts.py`` with ``own_network=True``).

With one rank per host every group of more than one rank spans hosts, so nothing takes the shared-memory
transport and every exchange crosses a link; the hierarchical output dist has no host with two row blocks and
keeps the flat exchange. On that network: every sharding type (pooled and sequence; table-row-wise and grid
placed over hosts of one rank) and 2D (2-way model parallel x 2 replicas, both groups across hosts) train equal to
one process on the global batch, and the transport's cross-host byte count matches what each of the four links
carried. One run of about 20-30 s on 2 cores, like ``test_hosts_network.py``'s.
"""

from __future__ import annotations

import pytest

from lightning_rec.transport import shm
from tests.distributed.cases import ALL_TYPES
from tests.distributed.hosts import check_all_types, check_link_bytes, namespaces_unavailable, run_hosts
from tests.distributed.hosts import explain as _explain
from tests.distributed.hosts import phase_data as _phase
from tests.distributed.hosts_net import IFNAME, network_unavailable

N_HOSTS, PER_HOST = 4, 1
WORLD = N_HOSTS * PER_HOST
MODEL_PARALLEL = 2  # the 2D phase: shard groups {0, 1} and {2, 3}, replica groups {0, 2} and {1, 3}
RATE = "1gbit"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    why = namespaces_unavailable() or network_unavailable()
    if why is not None:
        pytest.skip(why)
    return run_hosts(
        "tests.distributed.host_ranks",
        ["transport", "all_types", f"replicas_2d:{MODEL_PARALLEL}", "wire"],
        tmp_path_factory.mktemp("four_hosts"),
        N_HOSTS,
        PER_HOST,
        deadline_s=400.0,
        own_network=True,
        link_rate=RATE,
    )


def test_four_hosts_each_with_its_own_network_and_nothing_left(run: dict) -> None:
    assert not run["timed_out"], _explain(run)
    namespaces = set()
    for h, host in enumerate(run["hosts"]):
        assert host is not None, f"host {h} wrote no report:\n{_explain(run)}"
        assert host["hostname"] == f"lr-host{h}"
        assert host["interfaces"] == sorted([IFNAME, "lo"]), host["interfaces"]
        assert host["exit_codes"] == {str(h): 0}, _explain(run)
        assert host["dev_shm_left"] == [], f"host {h} left {host['dev_shm_left']} in its /dev/shm"
        assert host["net"]["after"]["tx_bytes"] > host["net"]["before"]["tx_bytes"]
        namespaces.add(host["pid_namespace"])
    assert len(namespaces) == N_HOSTS
    for rank in range(WORLD):
        assert run["ranks"][rank]["env"]["NODE_RANK"] == str(rank)
        assert run["ranks"][rank]["env"]["LOCAL_WORLD_SIZE"] == "1"
    assert run["leftover"] == [], f"processes still running: {run['leftover']}"
    assert not run["switch_left"], "the switch's namespace (and its links) outlived the run"


def test_no_group_across_hosts_takes_shared_memory(run: dict) -> None:
    if not shm._wanted():
        pytest.skip("the shared-memory transport needs Linux x86-64 (and LIGHTNING_REC_SHM unset)")
    for rank in range(WORLD):
        seen = _phase(run, rank, "transport")
        assert seen["hostname"] == f"lr-host{rank}"
        for name in ("world", "mesh.replica_group", "model_world.shard_group"):
            assert not seen["shared"][name], (rank, name, seen["shared"])
        assert all(seen["agree"].values()), seen["agree"]


def test_every_sharding_type_on_four_hosts_equals_one_process(run: dict) -> None:
    check_all_types(run, WORLD, set(ALL_TYPES))


def test_2d_across_four_hosts_equals_one_process(run: dict) -> None:
    for rank in range(WORLD):
        got = _phase(run, rank, f"replicas_2d:{MODEL_PARALLEL}")
        first = rank - rank % MODEL_PARALLEL
        assert got["shard_group"] == list(range(first, first + MODEL_PARALLEL))
        assert got["replica_group"] == list(range(rank % MODEL_PARALLEL, WORLD, MODEL_PARALLEL))
        assert not got["shard_group_shared"] and not got["replica_group_shared"], got
        assert any(c["sequence"] for c in got["cases"]) and any(not c["sequence"] for c in got["cases"])


def test_counted_cross_host_bytes_are_what_each_link_carried(run: dict) -> None:
    check_link_bytes(run, N_HOSTS, PER_HOST)
