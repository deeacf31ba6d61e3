"""Two simulated hosts on this machine (issue 31, item 9): 2 ranks each, launched as on a real 2-node job.

Each host is a set of UTS + pid + mount namespaces (its own hostname, pid space, /proc and /dev/shm) on the
shared loopback network (``tests/distributed/hosts.py``); the ranks run ``tests/distributed/host_ranks.py``.
Two jobs: one whose phases must all pass and exit 0 (where the transport is on, table-row-wise / grid
plans over one host's ranks, 2D replicas one per host, both equal to one process on the global batch), and
one where a rank SIGKILLs itself mid-training. Skipped where the namespaces cannot be made.
"""

from __future__ import annotations

import json

import pytest

from lightning_rec.transport import shm
from tests.distributed.hosts import explain as _explain
from tests.distributed.hosts import namespaces_unavailable, run_hosts
from tests.distributed.hosts import phase_data as _phase

N_HOSTS, PER_HOST = 2, 2
WORLD = N_HOSTS * PER_HOST
VICTIM = 3  # local rank 1 of host 1: it shares a shard group (shared memory) with rank 2, gloo with the rest
# what a rank raises when a peer is gone: the transport's liveness check, gloo's closed socket, or a peer's
# failure passed on by the transport
_FOLLOWER = (
    "left the group",
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "failed in collective",
)


def _need_hosts() -> None:
    why = namespaces_unavailable()
    if why is not None:
        pytest.skip(why)


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory) -> dict:
    _need_hosts()
    return run_hosts(
        "tests.distributed.host_ranks",
        ["transport", "row_groups", "replicas_2d", "replicas_within_host"],
        tmp_path_factory.mktemp("two_hosts"),
        N_HOSTS,
        PER_HOST,
    )


@pytest.fixture(scope="module")
def kill_run(tmp_path_factory) -> dict:
    _need_hosts()
    out = tmp_path_factory.mktemp("two_hosts_kill")
    run = run_hosts("tests.distributed.host_ranks", [f"kill:{VICTIM}"], out, N_HOSTS, PER_HOST)
    killed = out / f"killed{VICTIM}.json"
    run["killed"] = json.loads(killed.read_text()) if killed.exists() else None
    return run


def test_every_rank_runs_on_its_host_and_the_job_ends_cleanly(clean_run: dict) -> None:
    run = clean_run
    assert not run["timed_out"], _explain(run)
    for h, host in enumerate(run["hosts"]):
        assert host is not None, f"host {h} wrote no report:\n{_explain(run)}"
        assert host["hostname"] == f"lr-host{h}"
        assert host["killed_at_deadline"] == [], _explain(run)
        # a job that succeeded exits 0 on every rank (issue 31, item 5), on both hosts
        assert host["exit_codes"] == {str(h * PER_HOST + i): 0 for i in range(PER_HOST)}, _explain(run)
        assert host["dev_shm_left"] == [], f"host {h} left {host['dev_shm_left']} in its /dev/shm"
    assert run["hosts"][0]["pid_namespace"] != run["hosts"][1]["pid_namespace"]
    for rank in range(WORLD):
        seen = _phase(run, rank, "transport")
        host = rank // PER_HOST
        # the launcher's environment of a 2-node job
        assert run["ranks"][rank]["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank % PER_HOST),
            "NODE_RANK": str(host),
            "GROUP_RANK": str(host),
            "WORLD_SIZE": str(WORLD),
            "LOCAL_WORLD_SIZE": str(PER_HOST),
        }
        # what the transport compares: the host's name and pid namespace differ between hosts; the boot id is
        # the one machine's
        assert seen["hostname"] == f"lr-host{host}"
        assert seen["pid_namespace"] == run["hosts"][host]["pid_namespace"]
        assert seen["boot_id"] == _phase(run, 0, "transport")["boot_id"]
    assert run["leftover"] == [], f"processes still running: {run['leftover']}"


def test_transport_is_shared_memory_within_a_host_and_gloo_across(clean_run: dict) -> None:
    if not shm._wanted():
        pytest.skip("the shared-memory transport needs Linux x86-64 (and LIGHTNING_REC_SHM unset)")
    within = ("host_group", "mesh.shard_group", "model_2d.shard_group")
    across = ("mesh.replica_group", "model_world.shard_group", "world")
    pids = {}
    for rank in range(WORLD):
        seen = _phase(clean_run, rank, "transport")
        host = rank // PER_HOST
        for name in within:
            assert set(seen["groups"][name]) == set(range(host * PER_HOST, (host + 1) * PER_HOST)), (name, seen)
            assert seen["shared"][name], (
                f"rank {rank}: {name} (ranks {seen['groups'][name]}) is within host "
                f"{host} but not on the shared-memory transport"
            )
        for name in across:
            assert {r // PER_HOST for r in seen["groups"][name]} == set(range(N_HOSTS)), (name, seen)
            assert not seen["shared"][name], f"rank {rank}: {name} spans both hosts but took shared memory"
        # every group's all-reduce and all-gather equal torch.distributed's
        assert all(seen["agree"].values()), (rank, seen["agree"])
        pids[rank] = seen["pid"]
    # the hosts' pid spaces are separate; both may number their ranks alike (pid namespaces start at 1),
    # which the transport must not take for one host (it did not: the groups across are not shared)
    assert len({pids[r] for r in range(PER_HOST)}) == PER_HOST


def test_table_row_wise_and_grid_over_one_hosts_ranks_equal_one_process(clean_run: dict) -> None:
    kinds = set()
    for rank in range(WORLD):
        cases = _phase(clean_run, rank, "row_groups")["cases"]
        for case in cases:
            kinds |= {(label.split()[0], label.split(" ", 1)[1]) for label in case["plan"].values()}
    # both host-local layouts ran, on either host
    assert {("table_row_wise", "hosts=[0]"), ("table_row_wise", "hosts=[1]")} <= kinds, kinds
    assert any(k == "grid_shard" and "0" in h and "1" in h for k, h in kinds), kinds


@pytest.mark.parametrize(
    "phase, within",
    [("replicas_2d", "shard_group"), ("replicas_within_host", "replica_group")],
    ids=["model-parallel-within-host", "replicas-within-host"],
)
def test_2d_on_two_hosts_equal_one_process(clean_run: dict, phase: str, within: str) -> None:
    """Both arrangements: one group within each host, the other one rank per host."""
    across = "replica_group" if within == "shard_group" else "shard_group"
    for rank in range(WORLD):
        got = _phase(clean_run, rank, phase)
        host = rank // PER_HOST
        assert got[within] == list(range(host * PER_HOST, (host + 1) * PER_HOST))
        assert got[across] == [rank % PER_HOST + h * PER_HOST for h in range(N_HOSTS)]
        # a shard group's ranks per host: all of them, or one where each spreads over the hosts
        assert got["local_size"] == (PER_HOST if within == "shard_group" else 1)
        if shm._wanted():
            assert got[f"{within}_shared"] and not got[f"{across}_shared"], got
        assert any(c["sequence"] for c in got["cases"]) and any(not c["sequence"] for c in got["cases"])


def test_a_rank_killed_on_one_host_ends_every_rank_on_both_hosts(kill_run: dict) -> None:
    run = kill_run
    assert not run["timed_out"], _explain(run)
    assert run["killed"] is not None and run["killed"]["step"] >= 1, _explain(run)  # killed mid-training
    codes = {}
    for h, host in enumerate(run["hosts"]):
        assert host is not None, f"host {h} wrote no report:\n{_explain(run)}"
        # nobody had to be killed at the hosts' deadline: every rank ended by itself
        assert host["killed_at_deadline"] == [], _explain(run)
        assert host["dev_shm_left"] == [], f"host {h} left {host['dev_shm_left']} in its /dev/shm"
        codes.update({int(r): c for r, c in host["exit_codes"].items()})
    assert codes[VICTIM] == -9, codes
    latency = {}
    for rank in range(WORLD):
        if rank == VICTIM:
            continue
        got = _phase(run, rank, f"kill:{VICTIM}")
        assert got["raised"], f"rank {rank} trained on without rank {VICTIM}: {got}"
        msg = got["error"]
        # noticed, not waited out: the message is a peer-gone error, never a timeout (the world's is 60 s)
        assert any(m in msg for m in _FOLLOWER), f"rank {rank}: {msg}"
        assert "timeout" not in msg.lower() and "timed out" not in msg.lower(), f"rank {rank}: {msg}"
        assert codes[rank] == 1, f"rank {rank} exited with {codes[rank]} (the error it raised ends it)"
        latency[rank] = round(got["at"] - run["killed"]["at"], 2)
    # the victim's host-mate waited for it in their shared-memory shard group: the transport names it
    mate = _phase(run, VICTIM - 1, f"kill:{VICTIM}")["error"]
    assert f"rank {VICTIM}" in mate and "left the group" in mate, mate
    assert run["leftover"] == [], f"processes still running: {run['leftover']}"
    print(f"seconds from the kill to each rank's error: {latency}")  # shown with -s; not asserted
