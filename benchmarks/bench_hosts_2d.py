"""The two 2D arrangements measured on simulated hosts: 2 hosts x 2 ranks joined by a shaped link, 2 replicas x
2-way model parallel, against the planner's choice (``plans.planner.choose_arrangement``).

- ``model parallel within a host`` (the default): each host holds one shard group, the replicas' sync of the
  sharded tables crosses the link;
- ``replicas within a host``: each host holds one replica group, each shard group takes one rank of each host,
  so the embedding exchanges cross the link and the replicas' sync stays on the host.

Per workload, each arrangement trains an ``EmbeddingBagCollection`` with the plan the planner makes for that
arrangement (told the link's speed, the batch size and the ids per sample), with SGD on sparse rows, as
``shard_modules`` runs it under a mesh from ``init_2d_mesh``; the ranks' batches are their own (uniform ids,
lengths Poisson around the pooling factor). The timed window runs from step ``--warmup`` to the last step
between barriers; a run reports the slowest rank's steps/s, and the best of ``--rounds`` runs is kept. The
hosts' network is ``tests/distributed/hosts.py``'s ``own_network`` (``tbf`` on each host's veth, both
directions); the ranks of a host share its memory (the transport's shared memory within a host).

    python benchmarks/bench_hosts_2d.py [--rate 1gbit] [--steps 20] [--rounds 2] [--out hosts_2d]

Needs root, iproute2 and tc. Writes benchmarks/results/<out>.md and <out>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

N_HOSTS, PER_HOST = 2, 2
WORLD = N_HOSTS * PER_HOST
MP, DP = 2, 2
RESULTS = ROOT / "benchmarks" / "results"
_ROLE = "LIGHTNING_REC_BENCH_HOSTS_2D_RANK"
# name -> (tables, rows, dim, ids per sample, batch per rank)
WORKLOADS = {
    "one id per sample, wide rows": (8, 1000, 128, 1.0, 1024),
    "20 ids per sample": (8, 20000, 64, 20.0, 256),
}
ARRANGEMENTS = {False: "model parallel within a host", True: "replicas within a host"}


def _tables(workload: str) -> list:
    from lightning_rec import EmbeddingBagConfig

    n, rows, dim, _, _ = WORKLOADS[workload]
    return [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=dim, feature_names=[f"f{i}"])
        for i in range(n)
    ]


def _planner(workload: str, within: bool, rate: str) -> object:
    from lightning_rec.plans.mesh import group_local_size
    from lightning_rec.plans.planner import automatic_plan

    _, _, _, pf, b = WORKLOADS[workload]
    local = group_local_size(PER_HOST, DP, MP, within)
    tables = _tables(workload)
    planner = automatic_plan(
        tables, MP, local, WORLD, batch_size=b, default_pooling_factor=pf, host_link=rate, replicas_within_host=within
    )
    planner.plan(tables)
    return planner


def _batches(workload: str, rank: int, steps: int) -> list:
    import torch

    from lightning_rec import KeyedJaggedTensor

    n, rows, _, pf, b = WORKLOADS[workload]
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(steps):
        lengths = torch.poisson(torch.full((n * b,), pf), generator=g).long()
        values = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
        out.append(KeyedJaggedTensor.from_lengths_sync([f"f{i}" for i in range(n)], values, lengths))
    return out


def _train(workload: str, within: bool, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    from lightning_rec import EmbeddingBagCollection
    from lightning_rec.plans.mesh import init_2d_mesh
    from lightning_rec.sharding import shard_modules

    rank = dist.get_rank()
    steps, warmup = cfg["steps"], cfg["warmup"]
    mesh = init_2d_mesh(MP, DP, replicas_within_host=within)
    plan = _planner(workload, within, cfg["rate"]).explain().plan  # type: ignore[attr-defined]
    torch.manual_seed(0)
    model = shard_modules(
        EmbeddingBagCollection(_tables(workload)),
        plan,
        process_group=mesh.shard_group,
        replica_group=mesh.replica_group,
        local_size=mesh.local_size,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = _batches(workload, rank, steps)
    step_s = []
    for i, kjt in enumerate(batches):
        if i == warmup:
            dist.barrier()
            start = time.perf_counter()
        t0 = time.perf_counter()
        loss = model(kjt).values().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i >= warmup:
            step_s.append(time.perf_counter() - t0)
    dist.barrier()
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "timed_steps": steps - warmup,
        "median_step_s": statistics.median(step_s),
        "shard_group": dist.get_process_group_ranks(mesh.shard_group),
        "replica_group": dist.get_process_group_ranks(mesh.replica_group),
    }


def rank_main(out_dir: Path, cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    from lightning_rec import transport

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results: dict = {}
    for workload in cfg["workloads"]:
        for within in (False, True):
            results[f"{workload}|{within}"] = _train(workload, within, cfg)
            (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    transport.close_all()
    dist.destroy_process_group()


def _run(cfg: dict) -> dict:
    from tests.distributed.hosts import run_bench_ranks

    out = Path(tempfile.mkdtemp(prefix="bench_hosts_2d_"))
    run = run_bench_ranks(
        "benchmarks.bench_hosts_2d", cfg, out, N_HOSTS, PER_HOST, cfg["rate"], {_ROLE: "1"}, "the run"
    )
    return {k: [r[k] for r in run["ranks"]] for k in run["ranks"][0]}


def main() -> None:
    import torch

    from lightning_rec.plans.planner import choose_arrangement

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="hosts_2d")
    args = parser.parse_args()
    cfg = {"rate": args.rate, "steps": args.steps, "warmup": args.warmup, "workloads": list(WORKLOADS)}
    t0 = time.perf_counter()
    rounds: dict[str, list[float]] = {}
    groups: dict[str, object] = {}
    for r in range(args.rounds):
        got = _run(cfg)
        for key, per_rank in got.items():
            rounds.setdefault(key, []).append(min(x["timed_steps"] / x["seconds"] for x in per_rank))  # slowest rank
            groups[key] = {"shard_group": per_rank[0]["shard_group"], "replica_group": per_rank[0]["replica_group"]}
        print(f"round {r}: {json.dumps({k: round(v[-1], 2) for k, v in rounds.items()})}", flush=True)
    rows = []
    summary: dict = {}
    for workload, (n, nrows, dim, pf, b) in WORKLOADS.items():
        choice = choose_arrangement(
            _tables(workload), MP, WORLD, PER_HOST, batch_size=b, default_pooling_factor=pf, host_link=args.rate
        )
        measured = {w: max(rounds[f"{workload}|{w}"]) for w in (False, True)}
        best = max(measured, key=lambda w: measured[w])
        kinds = {}
        for w in (False, True):
            report = _planner(workload, w, args.rate).explain()  # type: ignore[attr-defined]
            kinds[w] = sorted({str(t.sharding.sharding_type.value) for t in report.tables})
        summary[workload] = {
            "measured_steps_per_s": {ARRANGEMENTS[w]: measured[w] for w in measured},
            "rounds": {ARRANGEMENTS[w]: rounds[f"{workload}|{w}"] for w in measured},
            "estimated_step_ms": {ARRANGEMENTS[w]: choice.step_ms[w] for w in choice.step_ms},
            "planner_choice": ARRANGEMENTS[choice.replicas_within_host],
            "measured_best": ARRANGEMENTS[best],
            "kinds": {ARRANGEMENTS[w]: kinds[w] for w in kinds},
            "groups_rank0": {ARRANGEMENTS[w]: groups[f"{workload}|{w}"] for w in (False, True)},
        }
        spread = {w: (max(v) - min(v)) / max(v) for w, v in ((w, rounds[f"{workload}|{w}"]) for w in (False, True))}
        for w in (False, True):
            rows.append(
                f"| {workload} ({n} tables x {nrows} rows x {dim}, {pf:g} ids/sample, batch {b}/rank) | "
                f"{ARRANGEMENTS[w]} | {', '.join(kinds[w])} | {choice.step_ms[w]:.1f} | {measured[w]:.2f} | "
                f"{100 * spread[w]:.0f}% | {'yes' if choice.replicas_within_host == w else ''} | "
                f"{'yes' if best == w else ''} |"
            )
    text = [
        "# 2D arrangements on simulated hosts (`benchmarks/bench_hosts_2d.py`)",
        "",
        __doc__.split("\n\n")[0].replace("\n", " "),
        "",
        f"{N_HOSTS} hosts x {PER_HOST} ranks, link {args.rate} each way, {DP} replicas x {MP}-way model parallel, "
        f"{args.steps - args.warmup} timed steps after {args.warmup}, best of {args.rounds} runs "
        f"(spread: (max - min) / max over the runs). {os.cpu_count()} CPU cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}; {time.perf_counter() - t0:.0f} s.",
        "",
        "| workload | arrangement | planner's kinds | estimated step (ms) | measured steps/s | spread | "
        "planner's choice | measured best |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.md").write_text("\n".join(text))
    (RESULTS / f"{args.out}.json").write_text(json.dumps({"args": vars(args), "summary": summary}, indent=1))
    print("\n".join(text))


if __name__ == "__main__":
    if os.environ.get(_ROLE):
        rank_main(Path(sys.argv[1]), json.loads(sys.argv[2]))
    else:
        main()
