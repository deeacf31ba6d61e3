"""The planner's profile on simulated hosts (``tests/distributed/hosts.py``): 2 hosts x 2 ranks and 4 x 1.

Every rank profiles at once (``profile.measure`` then ``profile.fitted``, what ``profile_speeds`` runs), on its
own batches. The profile must tell the hosts apart (by hostname, as the ranks' namespaces give each host its
own), measure the bandwidth among the ranks of each host only (none with one rank per host), a rank's share of
its host's link (an all-to-all over every rank), and the latency over every rank, across the hosts: a tiny all-to-all and the data-parallel sync's ring collectives, fitted into
the ``collective_latency`` the cost model charges per hop (at least; more where a training step with the small
tables data-parallel says its sync waited more). No wall-clock assertions: only what was measured
where, and that every rank fitted the same speeds.

This file is also the ranks' program: ``python -m tests.distributed.test_profile_hosts OUT_DIR``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.distributed.hosts import namespaces_unavailable, run_hosts

_SPEEDS = (
    "collective_latency",
    "intra_host_bandwidth",
    "inter_host_bandwidth",
    "step_overhead",
    "processes",
    "hosts",
    "tables",
)


def _rank(out_dir: Path) -> None:
    """Profile 4 small tables on this rank's batches; write the speeds and the raw exchange timings."""
    import torch
    import torch.distributed as dist

    from lightning_rec import EmbeddingBagConfig, KeyedJaggedTensor
    from lightning_rec.plans.planner.profile import fitted, host_groups, measure

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    tables = [EmbeddingBagConfig(200, 8, f"t{i}", [f"f{i}"]) for i in range(4)]
    g = torch.Generator().manual_seed(rank)
    batches = [
        KeyedJaggedTensor(
            [f"f{i}" for i in range(4)],
            torch.randint(0, 200, (4 * 32,), generator=g),
            lengths=torch.ones(4 * 32, dtype=torch.long),
        )
        for _ in range(2)
    ]
    hosts, _ = host_groups()
    timings = measure(tables, batches, max_batches=2, repeats=1)
    speeds = fitted(timings, tables)
    raw = {
        k: getattr(timings, k)
        for k in (
            "latency_a2a_s",
            "latency_ring_s",
            "a2a_bytes",
            "processes",
            "hosts",
            "step_mixed_s",
            "world_a2a_peer_bytes",
        )
    }
    got = {"hosts": hosts, "timings": raw, "speeds": speeds.as_dict()}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


@pytest.mark.parametrize(("n_hosts", "per_host"), [(2, 2), (4, 1)])
def test_profile_measures_latency_across_hosts_and_bandwidth_within(tmp_path, n_hosts: int, per_host: int) -> None:
    why = namespaces_unavailable()
    if why is not None:
        pytest.skip(why)
    from lightning_rec.plans.planner.fit import fit_latency

    run = run_hosts("tests.distributed.test_profile_hosts", [], tmp_path, n_hosts, per_host, deadline_s=240.0)
    logs = "\n".join(text[-3000:] for text in run["logs"] if text.strip())
    assert not run["timed_out"] and all(r is not None for r in run["ranks"]), logs
    world = n_hosts * per_host
    first = run["ranks"][0]
    # hosts by hostname: the launcher numbers ranks host by host
    assert first["hosts"] == [list(range(h * per_host, (h + 1) * per_host)) for h in range(n_hosts)]
    t, sp = first["timings"], first["speeds"]
    assert t["processes"] == world and t["hosts"] == n_hosts and sp["hosts"] == n_hosts
    assert t["latency_a2a_s"] > 0 and t["latency_ring_s"] > 0
    # alone, or more where the mixed reference step's sync waited more (a step of each reference plan measured)
    assert t["step_mixed_s"] > 0
    assert sp["collective_latency"] >= fit_latency(t["latency_a2a_s"], t["latency_ring_s"], world)
    if per_host > 1:  # among a host's ranks: each sent its one peer there a step's pooled rows (64 KiB at least)
        assert t["a2a_bytes"] == (per_host - 1) * (1 << 16) and sp["intra_host_bandwidth"] > 0
    else:  # no two ranks share a host: the topology's speed stays
        assert t["a2a_bytes"] is None and sp["intra_host_bandwidth"] is None
    # over every rank, across the hosts: a rank's share of its host's link
    assert t["world_a2a_peer_bytes"] == 1 << 16 and sp["inter_host_bandwidth"] > 0
    for r in run["ranks"][1:]:  # every rank fitted the same speeds (averaged timings)
        assert {k: r["speeds"][k] for k in _SPEEDS} == {k: sp[k] for k in _SPEEDS}


if __name__ == "__main__":
    _rank(Path(sys.argv[1]))
