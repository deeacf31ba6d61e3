"""One rank of a job on simulated hosts (``tests/distributed/hosts.py``); run by ``test_two_hosts.py``,
``test_hosts_network.py`` and ``test_four_hosts.py``.

``python -m tests.distributed.host_ranks OUT_DIR PHASE...`` with the launcher's environment set. Phases:

- ``transport``: where the shared-memory transport is on (a group within this host) and where it is not
  (a group spanning both hosts), what identity each rank shows, and that each group's all-reduce and
  all-gather through the transport equal gloo's;
- ``row_groups``: table-row-wise and grid plans (rows over the ranks of one host, ``local_size=2``) on the
  4-rank world, trained a few SGD steps, equal to one process on the global batch;
- ``replicas_2d``: 2 replicas (one per host) x 2-way model parallel (shard group within a host), equal to one
  process on the global batch; ``replicas_2d:M``: M-way model parallel over consecutive ranks instead (with one
  rank per host, shard groups and replica groups both span hosts);
- ``replicas_within_host``: the reverse arrangement: 2 replicas within each host x 2-way model parallel across the
  hosts (each shard group takes one rank of each host), equal to one process on the global batch;
- ``kill:R``: 2D training where rank R SIGKILLs itself after a forward; the others record what they raised;
- ``all_types``: each sharding type in turn (every table of a case one type; rows and grids over one host's
  ranks) on the 4-rank world, pooled and sequence, equal to one process on the global batch;
- ``wire`` (hosts on their own network only): what the transport's accounting says each host sent the other,
  per collective, against what left through the host's link (its ``eth0`` counter).

The rank writes ``OUT_DIR/rank<R>.json`` after each phase: ``{phase: {"ok", "error", "data"}}``. A phase that
raises ends the process (its peers then raise too, and the phases after it do not run).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, transport
from lightning_rec.plans.mesh import init_2d_mesh
from lightning_rec.sharding import (
    ShardingPlan,
    column_wise,
    data_parallel,
    row_wise,
    shard_modules,
    table_wise,
)
from lightning_rec.transport import accounting
from lightning_rec.transport import shm as _shm
from tests.distributed.cases import ALL_TYPES, random_case, random_placement
from tests.distributed.hosts_net import interface_bytes
from tests.distributed.test_sharded_equivalence import _check_case

WORLD_TIMEOUT_S = 60  # what every group waits; nothing in these phases may wait it out
ROW_GROUP_SEEDS = (3100, 3101, 3102, 3103, 3104, 3105)
REPLICA_SEEDS = (3200, 3201, 3202, 3203, 3204)
KILL_AT_STEP = 3


def _row_group_case(seed: int, ws: int, per_host: int, sequence: bool) -> dict:
    """A random case whose tables alternate table-row-wise and grid plans (rows over one host's ranks), with
    any other type after the first two tables."""
    case = random_case(seed, ws, sequence=sequence, world=ws)
    rng = random.Random(seed + 1)
    case["local_size"] = per_host
    first = ("table_row_wise", "grid_shard")[seed % 2]
    for i, t in enumerate(case["tables"]):
        kind = (
            (first, "grid_shard" if first == "table_row_wise" else "table_row_wise")[i]
            if i < 2
            else rng.choice(ALL_TYPES)
        )
        case["plan"][t.name] = random_placement(rng, kind, t.num_embeddings, t.embedding_dim, ws, per_host)
    return case


def _describe_plan(case: dict) -> dict:
    return {
        name: f"{getattr(p.sharding_type, 'value', p.sharding_type)} hosts={p.host_indexes}"
        for name, p in case["plan"].items()
    }


def phase_transport(rank: int, ws: int, per_host: int) -> dict:
    host = rank // per_host
    mesh = init_2d_mesh(model_parallel_size=per_host, data_parallel_size=ws // per_host)
    # every rank makes every host's group (new_group is collective over the world); keeps its own
    host_groups = [
        dist.new_group(list(range(h * per_host, (h + 1) * per_host)), timeout=timedelta(seconds=WORLD_TIMEOUT_S))
        for h in range(ws // per_host)
    ]
    tables = [EmbeddingBagConfig(name="t", num_embeddings=12, embedding_dim=4, feature_names=["f"])]
    kjt = KeyedJaggedTensor(["f"], torch.tensor([1, 7, 11]), lengths=torch.tensor([1, 2]))
    model_2d = shard_modules(
        EmbeddingBagCollection(tables),
        ShardingPlan({"": {"t": row_wise()}}),
        process_group=mesh.shard_group,
        replica_group=mesh.replica_group,
    )
    model_2d(kjt).values().sum().backward()
    model_world = shard_modules(
        EmbeddingBagCollection(tables), ShardingPlan({"": {"t": row_wise()}}), local_size=per_host
    )
    model_world(kjt).values().sum().backward()
    groups = {
        "host_group": host_groups[host],
        "mesh.shard_group": mesh.shard_group,
        "model_2d.shard_group": model_2d.shard_group,
        "mesh.replica_group": mesh.replica_group,
        "model_world.shard_group": model_world.shard_group,
        "world": None,
    }
    shared, agree = {}, {}
    for name, g in groups.items():
        shared[name] = transport.shared_group(g) is not None
        # the transport's results (or gloo's, where it is off) against torch.distributed's own
        x = torch.arange(6, dtype=torch.float32) * (rank + 1) + 0.25
        got, want = x.clone(), x.clone()
        transport.all_reduce_sum(got, g)
        dist.all_reduce(want, group=g)
        n = dist.get_world_size(g)
        gathered, expect = torch.empty(n * 6), torch.empty(n * 6)
        transport.all_gather_single(gathered, x, g)
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(expect, x, group=g)
        agree[name] = bool(torch.equal(got, want) and torch.equal(gathered, expect))
    hostname, boot, pid_ns = _shm._identity()
    return {
        "shared": shared,
        "agree": agree,
        "hostname": hostname,
        "boot_id": boot,
        "pid_namespace": pid_ns,
        "pid": os.getpid(),
        "groups": {k: dist.get_process_group_ranks(g) if g is not None else list(range(ws)) for k, g in groups.items()},
    }


def phase_row_groups(rank: int, ws: int, per_host: int) -> dict:
    out = []
    for i, seed in enumerate(ROW_GROUP_SEEDS):
        sequence = i == len(ROW_GROUP_SEEDS) - 1  # the last case: the sequence collection
        case = _row_group_case(seed, ws, per_host, sequence)
        got = _check_case(rank, ws, case, sequence)
        out.append({"seed": seed, "sequence": sequence, "plan": _describe_plan(case), "worst": got["worst"]})
    return {"cases": out}


def phase_replicas_2d(
    rank: int, ws: int, per_host: int, model_parallel: int | None = None, within_host: bool = False
) -> dict:
    mp = model_parallel or per_host
    mesh = init_2d_mesh(model_parallel_size=mp, data_parallel_size=ws // mp, replicas_within_host=within_host)
    out = []
    for i, seed in enumerate(REPLICA_SEEDS):
        sequence = i == len(REPLICA_SEEDS) - 1
        case = random_case(seed, mp, sequence=sequence, world=ws)
        if within_host:
            case["local_size"] = mesh.local_size  # host-local kinds then keep to the ranks a host really holds
        got = _check_case(rank, ws, case, sequence, mesh)
        out.append({"seed": seed, "sequence": sequence, "plan": _describe_plan(case), "worst": got["worst"]})
    return {
        "cases": out,
        "shard_group": dist.get_process_group_ranks(mesh.shard_group),
        "replica_group": dist.get_process_group_ranks(mesh.replica_group),
        "shard_group_shared": transport.shared_group(mesh.shard_group) is not None,
        "replica_group_shared": transport.shared_group(mesh.replica_group) is not None,
        "local_size": mesh.local_size,
    }


def phase_replicas_within_host(rank: int, ws: int, per_host: int) -> dict:
    return phase_replicas_2d(rank, ws, per_host, ws // per_host, within_host=True)


ALL_TYPES_SEED = 3300
WIRE_ELEMENTS = 1 << 20  # 4 MiB of float32 per collective: large beside the barriers' and ACKs' bytes


def phase_all_types(rank: int, ws: int, per_host: int) -> dict:
    out = []
    for i, kind in enumerate(ALL_TYPES):
        for sequence in (False, True):
            seed = ALL_TYPES_SEED + 10 * i + sequence
            case = random_case(seed, ws, sequence=sequence, types=(kind,), world=ws)
            rng = random.Random(seed + 1)
            case["local_size"] = per_host
            for t in case["tables"]:
                case["plan"][t.name] = random_placement(rng, kind, t.num_embeddings, t.embedding_dim, ws, per_host)
            got = _check_case(rank, ws, case, sequence)
            out.append({"kind": kind, "sequence": sequence, "plan": _describe_plan(case), "worst": got["worst"]})
    return {"cases": out}


def phase_wire(rank: int, ws: int, per_host: int) -> dict:
    """Per collective over the world (gloo: it spans both hosts), the cross-host bytes counted against the bytes
    the host's link carried. Rank 0 of each host reads the counter (both ranks share the link) between
    barriers, so the window holds that collective and one barrier."""
    x = torch.ones(WIRE_ELEMENTS)
    quarter = WIRE_ELEMENTS // ws
    collectives = {
        "all_to_all": lambda: transport.all_to_all_single(torch.empty_like(x), x, [quarter] * ws, [quarter] * ws, None),
        "all_gather": lambda: transport.all_gather_single(torch.empty(ws * WIRE_ELEMENTS), x, None),
        "all_reduce": lambda: transport.all_reduce_sum(x.clone(), None),
    }
    out = {}
    for name, run in collectives.items():
        accounting.reset()
        dist.barrier()
        before = interface_bytes()["tx_bytes"]
        dist.barrier()
        with accounting.counting(), transport.stage(name):
            run()
        dist.barrier()
        sent = interface_bytes()["tx_bytes"] - before
        counted = accounting.gather_byte_counts()
        host = rank // per_host
        out[name] = {
            "link_tx": sent if rank % per_host == 0 else None,
            "counted": sum(n for (s, d, _), n in counted.items() if s == host and d != host),
        }
        dist.barrier()
    return out


def phase_kill(rank: int, ws: int, per_host: int, victim: int, out_dir: Path) -> dict:
    """Train a 2D model; ``victim`` SIGKILLs itself after its forward at step KILL_AT_STEP (its peers are then
    inside that step's exchanges, within its host over shared memory and across hosts over gloo)."""
    mesh = init_2d_mesh(model_parallel_size=per_host, data_parallel_size=ws // per_host)
    tables = [
        EmbeddingBagConfig(name="rows", num_embeddings=40, embedding_dim=8, feature_names=["a"]),
        EmbeddingBagConfig(name="cols", num_embeddings=20, embedding_dim=8, feature_names=["b"]),
        EmbeddingBagConfig(name="whole", num_embeddings=10, embedding_dim=4, feature_names=["c"]),
        EmbeddingBagConfig(name="replicated", num_embeddings=10, embedding_dim=4, feature_names=["d"]),
    ]
    plan = {"rows": row_wise(), "cols": column_wise([0, 1]), "whole": table_wise(1), "replicated": data_parallel()}
    model = shard_modules(
        EmbeddingBagCollection(tables),
        ShardingPlan({"": plan}),
        process_group=mesh.shard_group,
        replica_group=mesh.replica_group,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    step = 0
    try:
        for step in range(200):
            lengths = torch.randint(0, 3, (4 * 8,), generator=g)
            values = torch.cat(
                [
                    torch.randint(0, t.num_embeddings, (int(n),), generator=g)
                    for t, n in zip(tables, lengths.view(4, 8).sum(1))
                ]
            )
            out = model(KeyedJaggedTensor(["a", "b", "c", "d"], values, lengths=lengths, stride=8))
            if rank == victim and step == KILL_AT_STEP:
                (out_dir / f"killed{rank}.json").write_text(json.dumps({"step": step, "at": time.monotonic()}))
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            out.values().pow(2).sum().backward()
            opt.step()
    except Exception as e:  # what the user's program would see
        return {"raised": True, "error": f"{type(e).__name__}: {e}", "step": step, "at": time.monotonic()}
    return {"raised": False, "error": "", "step": step, "at": time.monotonic()}


def _write(out_dir: Path, rank: int, results: dict) -> None:
    path = out_dir / f"rank{rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(results))
    path.with_suffix(".tmp").rename(path)


def main(out_dir: Path, phases: list[str]) -> None:
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    per_host = int(os.environ["LOCAL_WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=WORLD_TIMEOUT_S))  # env:// as under a launcher
    results: dict = {
        "env": {
            k: os.environ.get(k)
            for k in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
        }
    }
    for phase in phases:
        name, _, arg = phase.partition(":")
        t0 = time.monotonic()
        try:
            if name == "kill":
                data = phase_kill(rank, ws, per_host, int(arg), out_dir)
            elif name == "replicas_2d" and arg:
                data = phase_replicas_2d(rank, ws, per_host, int(arg))
            else:
                data = {
                    "transport": phase_transport,
                    "row_groups": phase_row_groups,
                    "replicas_2d": phase_replicas_2d,
                    "replicas_within_host": phase_replicas_within_host,
                    "all_types": phase_all_types,
                    "wire": phase_wire,
                }[name](rank, ws, per_host)
            results[phase] = {"ok": True, "error": "", "data": data, "seconds": time.monotonic() - t0}
        except BaseException as e:
            results[phase] = {
                "ok": False,
                "error": traceback.format_exc(),
                "data": None,
                "message": f"{type(e).__name__}: {e}",
            }
            _write(out_dir, rank, results)
            raise  # ends this rank: its peers raise in turn, as in a real job
        _write(out_dir, rank, results)
        if name == "kill" and data["raised"]:
            raise SystemExit(1)  # a real program ends on the error it got (the exit gloo's peers notice)
    transport.close_all()  # before the groups go, as the harness does (lightning_rec.testing)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
