"""Two simulated hosts, each in its own network namespace, joined by 1 Gbit/s links (issue 46).

``tests/distributed/hosts.py`` with ``own_network=True``: each host sees only ``lo`` and its ``eth0``
(``hosts_net.py``), gloo and the store reach the other host through the shaped link. On that network: the
shared-memory transport still serves the groups within a host; every sharding type trains equal to one process
on the global batch; and the transport's byte accounting matches what the links carried. Skipped where the
namespaces, veth links or tc cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import pytest

from lightning_rec.transport import shm
from tests.distributed.cases import ALL_TYPES
from tests.distributed.hosts import check_all_types, check_link_bytes, namespaces_unavailable, run_hosts
from tests.distributed.hosts import explain as _explain
from tests.distributed.hosts import phase_data as _phase
from tests.distributed.hosts_net import IFNAME, network_unavailable

N_HOSTS, PER_HOST = 2, 2
WORLD = N_HOSTS * PER_HOST
RATE = "1gbit"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    why = namespaces_unavailable() or network_unavailable()
    if why is not None:
        pytest.skip(why)
    return run_hosts(
        "tests.distributed.host_ranks",
        ["transport", "all_types", "wire"],
        tmp_path_factory.mktemp("hosts_network"),
        N_HOSTS,
        PER_HOST,
        deadline_s=400.0,
        own_network=True,
        link_rate=RATE,
    )


def test_each_host_has_its_own_network_and_leaves_nothing(run: dict) -> None:
    assert not run["timed_out"], _explain(run)
    for h, host in enumerate(run["hosts"]):
        assert host is not None, f"host {h} wrote no report:\n{_explain(run)}"
        assert host["interfaces"] == sorted([IFNAME, "lo"]), host["interfaces"]
        assert host["exit_codes"] == {str(h * PER_HOST + i): 0 for i in range(PER_HOST)}, _explain(run)
        # the other host's ranks were reached through the link: it carried the job's cross-host bytes
        assert host["net"]["after"]["tx_bytes"] > host["net"]["before"]["tx_bytes"]
    assert run["leftover"] == [], f"processes still running: {run['leftover']}"
    assert not run["switch_left"], "the switch's namespace (and its links) outlived the run"


def test_shared_memory_within_a_host_gloo_across(run: dict) -> None:
    if not shm._wanted():
        pytest.skip("the shared-memory transport needs Linux x86-64 (and LIGHTNING_REC_SHM unset)")
    for rank in range(WORLD):
        seen = _phase(run, rank, "transport")
        assert seen["shared"]["host_group"] and seen["shared"]["mesh.shard_group"], seen["shared"]
        assert not seen["shared"]["world"] and not seen["shared"]["mesh.replica_group"], seen["shared"]
        assert all(seen["agree"].values()), seen["agree"]


def test_every_sharding_type_equals_one_process(run: dict) -> None:
    check_all_types(run, WORLD, set(ALL_TYPES))


def test_counted_cross_host_bytes_are_what_the_links_carried(run: dict) -> None:
    check_link_bytes(run, N_HOSTS, PER_HOST)
