"""Cross-host bytes and steps/s of every sharding type on simulated hosts joined by a shaped link: 2 hosts x 2
ranks, or ``--hosts 4 --per-host 1``.

Each host is a set of Linux namespaces with its own network (``tests/distributed/hosts.py``, ``own_network``):
its ``eth0`` at ``10.77.0.<h+1>`` plugs into a bridge through a veth pair rate-limited by ``tbf`` in both
directions (by default 1 Gbit/s, then 10 Gbit/s). No latency is added (the kernel has no
``netem``). The two ranks of a host share its pid namespace, so their groups run on the shared-memory transport;
every byte between hosts goes through the link. The launcher's environment of a 2-node job is set (RANK,
LOCAL_RANK, NODE_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR = host 0's address), and each rank runs
``Trainer(num_nodes=2, devices=2, strategy=RecShardedStrategy(model_parallel_size=4))`` fits of
``lightning_rec.models.DLRM`` on ``SyntheticClicks`` (26 Criteo-shaped tables), one fit per sharding type, every
table of a fit placed with that type (table_row_wise alternates tables between the hosts; grid_shard puts one
column half on each host, row-split inside it).

Per fit, the timed window runs from the start of step ``--warmup`` to the end of the last step, between
barriers; within it the transport counts bytes (``LIGHTNING_REC_BYTE_COUNT=1``; DDP's dense all-reduce through
``transport.accounting.ddp_comm_hook``, registered on the DDP module) and each host's link counter is read. Reported per type: steps/s
(slowest rank), cross-host bytes per step by stage as counted, the analytic count of the flat exchange where
it follows from the plan alone (the pooled output dist, both directions: every destination rank receives, for
each of its samples, the columns of every non-empty shard held on another host; DDP's all-reduce: gloo's ring
crosses between hosts twice, each time with ``2 (n - 1) / n`` of the gradient), and the bytes the links
carried (both hosts' ``eth0`` transmit counters: payload plus TCP/IP headers plus the window's barriers).
The planner's candidates plan the same job (``PLANNED``): ``planner`` told the link's speed, ``planner_defaults``
with the device's default speeds, ``planner_profiled`` told the link's speed and given speeds measured by a profile
of the job (``profile.measure``, as ``lightning-rec profile`` runs it) on the same simulated hosts, links and
environment, every rank on its own batches, before the timed rounds (its speeds file in that run's temp dir).
Each (mode, rate) is a run of its own: ``hierarchical`` is the default output dist (``LIGHTNING_REC_OUTPUT_DIST=auto``:
host blocks where some host holds a column twice), ``flat`` sets ``LIGHTNING_REC_OUTPUT_DIST=flat``.

The input dist's bytes are set against what the timed batches themselves need (``_input_dist_bytes``, computed on
each rank from its own batches and the plan): the wire format's count, and the least (each id once to every
other host holding its row, its bag lengths once per such host). With more than 2 hosts the report adds the
bytes by ordered host pair.

    python benchmarks/bench_hosts.py [--rates 1gbit] [--modes hierarchical flat] [--types ...] [--steps 24] [--rounds 2]
        [--batch-size 512] [--dim 16] [--hosts 2 --per-host 2] [--out hosts]

Needs root, iproute2 and tc. Writes benchmarks/results/<out>.md and <out>.json (``hosts`` by default: a run
rewrites the whole file, so measure other shapes or subsets under another name and merge by hand).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

TYPES = ("data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "grid_shard")
# the planner's plans for the same job: told the shaped link's speed, with the device's default speeds, and told
# the link's speed with the speeds a profile measured on the simulated hosts before the timed rounds
PLANNED = {"planner": "1gbit", "planner_defaults": None, "planner_profiled": "1gbit"}
PROFILED = "planner_profiled"
CANDIDATES = TYPES + tuple(PLANNED)
N_HOSTS, PER_HOST = 2, 2  # the shape: --hosts and --per-host (2 x 2 or 4 x 1 on this machine)
WORLD = N_HOSTS * PER_HOST
RESULTS = ROOT / "benchmarks" / "results"
ID_BYTES = 4  # the input dist's word across hosts: int32 (no weights, ids within int32, gloo: not shared memory)
HEADER_BYTES = 8  # its header's words are int64
HEADER_WORDS = 4  # per rank pair, before the id count of each route: batch size and three flags
_ROLE = "LIGHTNING_REC_BENCH_HOSTS_RANK"  # set on the ranks: this file is their program too


def _set_shape(hosts: int, per_host: int) -> None:
    """Every function here reads the shape from these globals: the driver sets them from its options, each
    rank from the config it is given."""
    global N_HOSTS, PER_HOST, WORLD
    N_HOSTS, PER_HOST, WORLD = hosts, per_host, hosts * per_host


def _dlrm(cfg: dict, plan: object = None) -> object:
    import torch

    from lightning_rec.data import SyntheticClicks
    from lightning_rec.models import DLRM

    ds = SyntheticClicks(num_rows=1, batch_size=1, size=cfg["size"])
    torch.manual_seed(0)
    dim = cfg["dim"]
    return DLRM(
        num_dense=ds.num_dense,
        feature_names=ds.feature_names,
        num_embeddings_per_feature=ds.cardinalities,
        embedding_dim=dim,
        dense_arch_layer_sizes=[64, dim],
        over_arch_layer_sizes=[64, 1],
        plan=plan,
    )


def planner_for(cfg: dict, link: str | None, speeds: str | None = None) -> object:
    """The planner the strategy would run for this job on 2 hosts x 2 ranks (``link``: the hosts' link speed,
    None: the device's default speeds; ``speeds``: a speeds file, as ``RecShardedStrategy(planner_speeds=...)``
    takes it), told the data's ids per sample (rank 0's rows: the same on every rank)."""
    from lightning_rec.data import SyntheticClicks
    from lightning_rec.front_end import resolve_table_optimizers
    from lightning_rec.plans.planner import automatic_plan

    ds = SyntheticClicks(num_rows=4096, batch_size=cfg["batch_size"], size=cfg["size"])
    lengths = ds.rows(0, 4096)[1]
    pooling = {f: float(lengths[i].mean()) for i, f in enumerate(ds.feature_names)}
    model = _dlrm(cfg)
    specs = resolve_table_optimizers(model, None)  # type: ignore[arg-type]
    extra: dict = {} if link is None else {"host_link": link}
    if speeds is not None:
        extra["speeds"] = speeds
    planner = automatic_plan(
        model,  # type: ignore[arg-type]
        WORLD,
        PER_HOST,
        WORLD,
        table_optimizers=specs,
        device="cpu",
        batch_size=cfg["batch_size"],
        pooling_factors=pooling,
        **extra,
    )
    planner.plan(model)  # type: ignore[arg-type]
    return planner


def _planner(cfg: dict, kind: str) -> object:
    """The planner of candidate ``kind`` (one of ``PLANNED``); the profiled one reads ``cfg["speeds"]``."""
    return planner_for(cfg, PLANNED[kind], cfg["speeds"] if kind == PROFILED else None)


def _plan(kind: str, tables: list, cfg: dict) -> object:
    if kind in PLANNED:
        return _planner(cfg, kind).explain().plan  # type: ignore[attr-defined]
    from lightning_rec.sharding import (
        ShardingPlan,
        column_wise,
        data_parallel,
        grid_shard,
        row_wise,
        table_row_wise,
        table_wise,
    )

    def placement(i: int) -> object:  # i: the table's position by size, largest first
        if kind == "data_parallel":
            return data_parallel()
        if kind == "table_wise":
            return table_wise(rank=i % WORLD)
        if kind == "row_wise":
            return row_wise()
        if kind == "column_wise":
            return column_wise(ranks=list(range(WORLD)))
        if kind == "table_row_wise":
            return table_row_wise(host_index=i % N_HOSTS)
        return grid_shard(host_indexes=list(range(N_HOSTS)))

    by_size = sorted(tables, key=lambda t: -t.num_embeddings)
    return ShardingPlan({"sparse_arch.embedding_bag_collection": {t.name: placement(i) for i, t in enumerate(by_size)}})


def _describe_plans(cfg: dict) -> tuple[dict[str, str], dict[str, float]]:
    """Each candidate's placements in a few words, and the link-aware planner's estimate of its step."""
    from collections import Counter

    from lightning_rec.data import SyntheticClicks
    from lightning_rec.models import tables_from_cardinalities

    planners = {k: _planner(cfg, k) for k in PLANNED if k != PROFILED or cfg.get("speeds")}
    aware = planners["planner"]
    model = _dlrm(cfg)
    ds = SyntheticClicks(num_rows=1, batch_size=1, size=cfg["size"])
    tables = tables_from_cardinalities(ds.feature_names, ds.cardinalities, cfg["dim"])
    plans, estimates = {}, {}
    for kind in CANDIDATES:
        if kind in PLANNED and kind not in planners:
            continue  # profiled: no profile in this run
        plan = planners[kind].explain().plan if kind in PLANNED else _plan(kind, tables, cfg)  # type: ignore[attr-defined]
        estimates[kind] = aware.estimate(model, plan).step_time_ms  # type: ignore[attr-defined]
        if PROFILED in planners:  # the same plan as the profiled speeds see it
            estimates[kind + "@profiled"] = planners[PROFILED].estimate(model, plan).step_time_ms  # type: ignore[attr-defined]
        if kind in PLANNED:
            placed = [ps for per in plan.plan.values() for ps in per.values()]  # type: ignore[attr-defined]
            count = Counter(ps.sharding_type.value for ps in placed)
            ranks = ";".join(
                f"{n}:{ps.sharding_type.value}{ps.ranks or ''}" for per in plan.plan.values() for n, ps in per.items()
            )  # type: ignore[attr-defined]
            plans[kind] = ", ".join(f"{n} {k}" for k, n in count.most_common()) + f" ({ranks})"
    return plans, estimates


def _output_dist_bytes(model: object, batch: int) -> tuple[int, int]:
    """Cross-host bytes of one direction of the pooled output dist (fp32), from the plan: ``(flat, least)``.

    Flat: for each destination rank and table, its samples' columns of every non-empty shard on another host
    (row blocks of one host cross separately, to be added at the destination). Least: each of those columns
    once from each other host holding it (row blocks added on their host before crossing): what a hierarchical
    exchange could get down to.
    """
    from lightning_rec.sharding import sharded_collections

    flat = least = 0
    for _, coll in sharded_collections(model):
        ranks = coll.shard_group_ranks
        for shards in coll.shards.values():
            for dst in range(WORLD):
                remote = [s for s in shards or [] if s.rows > 0 and ranks[s.rank] // PER_HOST != dst // PER_HOST]
                flat += sum(batch * s.cols * 4 for s in remote)
                for h in {ranks[s.rank] // PER_HOST for s in remote}:
                    on_h = [s for s in remote if ranks[s.rank] // PER_HOST == h]
                    least += batch * len({c for s in on_h for c in range(s.col_offset, s.col_offset + s.cols)}) * 4
    return flat, least


def _input_dist_bytes(model: object, batches: list, rank: int) -> dict[str, int]:
    """Cross-host bytes this rank's input dist sends for ``batches``, as the wire format counts them and at the
    least the batches need (from the ids themselves).

    As sent: to every rank of another host, a header of ``HEADER_WORDS`` + one word per route it owns (int64),
    then per route (a feature and one shard of its table) the bag lengths of the whole batch and the ids that
    fall in the shard's rows (int32). Least: each id once to every other host that holds its row (any column
    of it), with its feature's bag lengths once per such host; no header.
    """
    from lightning_rec.sharding import sharded_collections

    host = rank // PER_HOST
    out = dict.fromkeys(("header", "lengths", "ids", "least_lengths", "least_ids"), 0)
    for _, coll in sharded_collections(model):
        routing = coll.routing  # type: ignore[attr-defined]
        ranks = coll.shard_group_ranks
        if len(ranks) == 1 or not any(routing.routes_to):
            continue  # nothing is exchanged (one rank, or only data-parallel tables)
        names = [f for t in coll.tables for f in t.feature_names]
        # (feature, host) -> row ranges of the routes that host owns
        held: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for dst, routes in enumerate(routing.routes_to):
            dst_host = ranks[dst] // PER_HOST
            if dst_host == host:
                continue
            for route in routes:
                s = route.shard
                held.setdefault((route.feature, dst_host), []).append((s.row_offset, s.row_offset + s.rows))
        for batch in batches:
            kjt = batch.sparse
            b = kjt.stride()
            ids = {f: kjt[names[f]].values() for f in {f for f, _ in held}}
            for dst, routes in enumerate(routing.routes_to):
                if ranks[dst] // PER_HOST == host:
                    continue
                out["header"] += HEADER_BYTES * (HEADER_WORDS + len(routes))
                for route in routes:
                    s = route.shard
                    v = ids[route.feature]
                    out["lengths"] += ID_BYTES * b
                    out["ids"] += ID_BYTES * int(((v >= s.row_offset) & (v < s.row_offset + s.rows)).sum())
            for (f, _), spans in held.items():
                v = ids[f]
                covered = sum(((v >= a) & (v < e)) for a, e in spans).bool()  # type: ignore[union-attr]
                out["least_lengths"] += ID_BYTES * b
                out["least_ids"] += ID_BYTES * int(covered.sum())
    return out


def _fit(kind: str, cfg: dict) -> dict:
    import lightning as L
    import torch
    import torch.distributed as dist

    from lightning_rec import RecShardedStrategy
    from lightning_rec.data import SyntheticClicks
    from lightning_rec.models import tables_from_cardinalities
    from lightning_rec.transport import accounting
    from tests.distributed.hosts_net import interface_bytes

    rank = int(os.environ["RANK"])
    steps, warmup, b, dim = cfg["steps"], cfg["warmup"], cfg["batch_size"], cfg["dim"]
    ds = SyntheticClicks(num_rows=WORLD * b * steps, batch_size=b, size=cfg["size"], rank=rank, world_size=WORLD)
    batches = list(ds)
    tables = tables_from_cardinalities(ds.feature_names, ds.cardinalities, dim)
    plan = _plan(kind, tables, cfg)
    model = _dlrm(cfg, plan)
    window: dict = {"step_s": []}

    class Window(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            # Lightning registers DDPStrategy(ddp_comm_hook=...) on CUDA only; DDP takes one before its first step
            trainer.strategy.model.register_comm_hook(None, accounting.ddp_comm_hook)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == warmup:
                dist.barrier()
                accounting.reset()
                window["tx"] = interface_bytes()["tx_bytes"]
                dist.barrier()
                window["start"] = time.perf_counter()
            window["step_start"] = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx >= warmup:
                window["step_s"].append(time.perf_counter() - window["step_start"])
            if batch_idx == steps - 1:
                dist.barrier()
                window["seconds"] = time.perf_counter() - window["start"]
                window["tx"] = interface_bytes()["tx_bytes"] - window["tx"]
                window["counts"] = [[s, d, k, n] for (s, d, k), n in accounting.byte_counts(by="rank").items()]
                window["calls"] = accounting.collective_counts()
                dist.barrier()

    trainer = L.Trainer(
        accelerator="cpu",
        devices=PER_HOST,
        num_nodes=N_HOSTS,
        max_steps=steps,
        strategy=RecShardedStrategy(
            model_parallel_size=WORLD,
            pipeline=bool(cfg.get("pipeline")),
            embedding_optimizer={"kind": "adagrad", "lr": 0.05} if cfg.get("fused") else None,
        ),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=[Window()],
    )
    trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    emb = model.sparse_arch.embedding_bag_collection
    emb_ids = {id(p) for p in emb.parameters()}
    dense = sum(p.numel() for p in model.parameters() if id(p) not in emb_ids and p.requires_grad)
    return {
        **window,
        "timed_steps": steps - warmup,
        "dense_params": dense,
        "output_dist_analytic": _output_dist_bytes(model, b),  # (flat, least)
        "input_dist_analytic": _input_dist_bytes(model, batches[warmup:steps], rank),
        "tables": len(tables),
    }


def _profile(out_dir: Path, cfg: dict) -> None:
    """``lightning-rec profile``'s measurement on this rank (every rank at once, over the hosts' links), on the
    job's model and its own batches; rank 0 writes ``out_dir/speeds.json``, every rank its exchange timings."""
    import torch.distributed as dist

    from lightning_rec.data import SyntheticClicks
    from lightning_rec.plans.planner import Topology
    from lightning_rec.plans.planner.profile import fitted, measure

    rank = int(os.environ["RANK"])
    b, steps = cfg["batch_size"], cfg["steps"]
    ds = SyntheticClicks(num_rows=WORLD * b * steps, batch_size=b, size=cfg["size"], rank=rank, world_size=WORLD)
    batches = list(ds)
    dist.init_process_group("gloo")  # the launcher's environment: MASTER_ADDR on host 0's link
    t0 = time.perf_counter()
    timings = measure(_dlrm(cfg), batches, max_batches=cfg["profile_batches"])
    # the job's topology, so that the steps' calibration knows which bytes crossed the link
    hardware = Topology(WORLD, WORLD, PER_HOST, host_link=PLANNED[PROFILED]).hardware
    speeds = fitted(timings, _dlrm(cfg), hardware=hardware)
    if rank == 0:
        speeds.save(out_dir / "speeds.json")
    keys = (
        "hosts",
        "latency_a2a_s",
        "latency_ring_s",
        "a2a_tiny_s",
        "a2a_big_s",
        "a2a_bytes",
        "step_s",
        "step_mixed_s",
    )
    raw = {"seconds": time.perf_counter() - t0, **{k: getattr(timings, k) for k in keys}}
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"profile": raw}))
    dist.destroy_process_group()


def rank_main(out_dir: Path, cfg: dict) -> None:
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    _set_shape(cfg["hosts"], cfg["per_host"])
    if cfg.get("phase") == "profile":
        _profile(out_dir, cfg)
        return
    results: dict = {}
    for kind in cfg["types"]:
        results[kind] = _fit(kind, cfg)
        (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    import torch.distributed as dist

    from lightning_rec import transport

    transport.close_all()
    if dist.is_initialized():
        dist.destroy_process_group()


# -- the report ---------------------------------------------------------------------------------------


def _summarize(ranks: list[dict], hosts: list[dict], kind: str, mode: str = "flat") -> dict:
    per = [r[kind] for r in ranks]
    steps = per[0]["timed_steps"]
    stages: dict[str, float] = {}
    pairs: dict[str, float] = {}  # "a->b": what host a sent host b, per step
    for r in per:
        for s, d, label, n in r["counts"]:
            if s // PER_HOST != d // PER_HOST:
                stages[label] = stages.get(label, 0) + n / steps
                pair = f"{s // PER_HOST}->{d // PER_HOST}"
                pairs[pair] = pairs.get(pair, 0) + n / steps
    input_dist = {k: sum(r["input_dist_analytic"][k] for r in per) / steps for k in per[0]["input_dist_analytic"]}
    dense = per[0]["dense_params"] * 4
    ring = 2 * (WORLD - 1) * dense // WORLD  # what each crossing of gloo's ring carries
    flat, least = per[0]["output_dist_analytic"]
    # the host blocks send the least where they are chosen (some host holds a column twice), else the flat count
    out = least if mode == "hierarchical" and least < flat else flat
    analytic = {"output_dist_fwd": out, "output_dist_bwd": out, "dense_grad_allreduce": N_HOSTS * ring}
    link = sum(per[h * PER_HOST]["tx"] for h in range(N_HOSTS)) / steps
    # the slowest rank's time of each step, then the median step: robust to a neighbour's burst on a shared machine
    slowest = [max(r["step_s"][i] for r in per) for i in range(steps)]
    return {
        "steps_per_s": steps / max(r["seconds"] for r in per),
        "median_steps_per_s": 1 / statistics.median(slowest),
        "stages": stages,
        "analytic": analytic,
        # the output dist both ways with row blocks added before they cross; the all-reduce as a
        # reduce-scatter within each host, then each host's half crossing once each way
        "least": {"output_dist": 2 * least, "dense_grad_allreduce": 2 * (N_HOSTS - 1) * dense},
        "flat": {"output_dist": 2 * flat},
        "counted": sum(stages.values()),
        "link": link,
        "pairs": pairs,
        "input_dist": input_dist,
    }


def _mb(n: float) -> str:
    return f"{n / 1e6:.3f}"


MODES = {"hierarchical": "auto", "flat": "flat"}  # report label -> LIGHTNING_REC_OUTPUT_DIST


def _write(summary: dict, cfg: dict, seconds: float) -> None:
    """``summary[mode][rate][kind]``: the fastest round's figures."""
    from tests.distributed.hosts_net import rate_bits

    load = cfg.setdefault("load", " / ".join(f"{x:.1f}" for x in os.getloadavg()))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / cfg.get("out", "hosts")
    out.with_suffix(".json").write_text(json.dumps({"config": cfg, "seconds": seconds, "results": summary}, indent=1))
    modes = list(summary)
    main_mode = modes[0]
    rates = list(summary[main_mode])
    both = "hierarchical" in summary and "flat" in summary
    lines = [
        f"# Cross-host bytes and steps/s: {N_HOSTS} simulated hosts x {PER_HOST} ranks, "
        + " and ".join(modes)
        + " output dist",
        "",
        # the command as given (every option it left out has its default)
        "`python benchmarks/bench_hosts.py " + " ".join(sys.argv[1:]) + f"` ({seconds:.0f} s). {_machine()}.",
        "",
        "Each host: its own UTS, pid, mount and network namespaces; its link to the bridge limited by `tbf` to the",
        "rate below in each direction, **no added latency** (`netem` is not in this kernel: a link is as fast as",
        "its rate and the loopback path's tens of microseconds). Within a host the ranks use the shared-memory",
        f"transport; between hosts gloo over the link. Lightning `Trainer(num_nodes={N_HOSTS}, devices={PER_HOST})` fits of DLRM",
        f"({cfg['batch_size']} samples per rank per step, 26 tables x {cfg['dim']} dims, Criteo sizes x {cfg['size']}),",
        "every table placed with one sharding type. Bytes are per training step, summed over every ordered pair",
        "of hosts (host 0 -> 1, 1 -> 0, ...), in MB (10^6). *hierarchical*: the default (`LIGHTNING_REC_OUTPUT_DIST=auto`: the",
        "pooled output dist adds a host's row blocks there before they cross, where some host holds a column twice;",
        (
            "row_wise, table_row_wise and grid_shard here, the other types keep the flat exchange); *flat*:"
            if PER_HOST > 1
            else "with one rank per host no host holds a column twice, so every type keeps the flat exchange); *flat*:"
        ),
        "`LIGHTNING_REC_OUTPUT_DIST=flat`, every rank's block crosses on its own."
        + ("" if PER_HOST > 1 else " With one rank per host no group lies within a host: no shared memory."),
        "",
        "## Steps/s",
        "",
        "Median step (the slowest rank's time of each timed step, then the median), and in brackets the whole",
        f"window's mean, of the fastest of {cfg['rounds']} rounds per rate and mode (rounds alternate the modes).",
        f"Load average when the run ended: {load} (other jobs shared the 2 cores).",
        "",
    ]
    head, rule = ["sharding"], ["---"]
    for r in rates:
        for m in modes:
            head.append(f"{m} at {r}")
            rule.append("---:")
        if both:
            head.append(f"hierarchical / flat at {r}")
            rule.append("---:")
    lines += ["| " + " | ".join(head) + " |", "| " + " | ".join(rule) + " |"]
    for kind in CANDIDATES:
        if kind not in summary[main_mode][rates[0]]:
            continue
        cells = []
        for r in rates:
            for m in modes:
                got = summary[m][r][kind]
                cells.append(f"{got['median_steps_per_s']:.2f} ({got['steps_per_s']:.2f})")
            if both:
                h, f = summary["hierarchical"][r][kind], summary["flat"][r][kind]
                cells.append(f"{h['median_steps_per_s'] / f['median_steps_per_s']:.2f}")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    rate = rates[0]
    for m in modes:
        stages = sorted({s for k in summary[m][rate].values() for s in k["stages"]})
        lines += [
            "",
            f"## Cross-host MB per step by stage, {m}, counted by the transport (at {rate})",
            "",
            "Counted = `transport.accounting` (what each rank's collectives sent to ranks of the other host). "
            "Analytic in brackets where the plan alone gives it: the pooled output dist (this mode's) and DDP's ring "
            "all-reduce. Link = both hosts' `eth0` transmit counters over the same window (payload, TCP/IP headers, "
            "the window's two barriers).",
            "",
            "| sharding | " + " | ".join(stages) + " | counted | link |",
            "| --- | " + " | ".join("---:" for _ in stages) + " | ---: | ---: |",
        ]
        for kind in CANDIDATES:
            got = summary[m][rate].get(kind)
            if got is None:
                continue
            cells = []
            for s in stages:
                n = got["stages"].get(s, 0.0)
                want = got["analytic"].get(s)
                cells.append(_mb(n) + (f" [{_mb(want)}]" if want is not None else ""))
            lines.append(f"| {kind} | " + " | ".join(cells) + f" | {_mb(got['counted'])} | {_mb(got['link'])} |")
    lines += [
        "",
        "## Output dist against the least the plan needs",
        "",
        "Counted cross-host output-dist bytes (forward + backward) per step in each mode. Least: each destination",
        "gets each column once from each other host holding it (the row blocks of one host added there before",
        "they cross); flat (analytic): every non-empty shard's columns cross on their own. DDP's all-reduce: gloo's",
        "ring against a reduce within each host and a ring of the hosts. The input dist's least: the next section.",
        "",
        "| sharding | "
        + " | ".join(f"output dist {m}" for m in modes)
        + " | flat (analytic) | least | "
        + " | ".join(f"{m} / least" for m in modes)
        + " | dense all-reduce | least |",
        "| --- | " + " | ".join("---:" for _ in range(2 * len(modes) + 4)) + " |",
    ]
    for kind in TYPES:
        if kind not in summary[main_mode][rate]:
            continue
        outs = [
            summary[m][rate][kind]["stages"].get("output_dist_fwd", 0.0)
            + summary[m][rate][kind]["stages"].get("output_dist_bwd", 0.0)
            for m in modes
        ]
        got = summary[main_mode][rate][kind]
        least = got["least"]["output_dist"]
        ratios = [f"{o / least:.2f}" if least else "-" for o in outs]
        dense = got["stages"].get("dense_grad_allreduce", 0.0)
        lines.append(
            f"| {kind} | "
            + " | ".join(_mb(o) for o in outs)
            + f" | {_mb(got['flat']['output_dist'])} | {_mb(least)} | "
            + " | ".join(ratios)
            + f" | {_mb(dense)} | {_mb(got['least']['dense_grad_allreduce'])} |"
        )
    lines += _input_dist_lines(summary[main_mode][rate], main_mode, rate)
    if N_HOSTS > 2:
        lines += _pair_lines(summary[main_mode][rate], main_mode, rate)
    lines += _planner_lines(summary, cfg)
    lines += ["", *(NOTES if (N_HOSTS, PER_HOST) == (2, 2) else ONE_RANK_NOTES if PER_HOST == 1 else NOTES[:5])]
    parts = []
    for kind in TYPES:
        got = summary[main_mode][rate].get(kind)
        if got is not None:
            wire = got["link"] * 8 / rate_bits(rate) * 1e3 / N_HOSTS
            parts.append(f"{kind} {wire:.0f} ms")
    lines += [
        f"- Link time per step at {rate}, {main_mode} (the step's cross-host bytes at the link's rate, every host",
        "  sending its share at once): " + "; ".join(parts) + ".",
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def _input_dist_lines(got: dict, mode: str, rate: str) -> list[str]:
    """The input dist's counted bytes against the least the timed batches need (``_input_dist_bytes``)."""
    lines = [
        "",
        f"## Input dist against the least the batches need ({mode}, {rate})",
        "",
        "Cross-host MB per step. *counted*: `transport.accounting`'s `input_dist` stage. *model*: the wire format",
        "applied to the timed batches (`_input_dist_bytes`): to every rank of another host a header (int64:",
        f"{HEADER_WORDS} words + one per route it owns), then per route (a feature and one shard of its table) the whole",
        "batch's bag lengths and the ids in the shard's rows (int32). *least*: each id once to every other host",
        "holding its row (any of its columns), its feature's bag lengths once per such host, no header. The excess",
        "(counted - least) splits into the header, lengths sent per route instead of once per host, and ids sent",
        "to several ranks of one host (a column shard each).",
        "",
        "| sharding | counted | model | least | counted / least | header | extra lengths | extra ids |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for kind in TYPES:
        if kind not in got:
            continue
        g = got[kind]
        i = g["input_dist"]
        counted = g["stages"].get("input_dist", 0.0)
        model = i["header"] + i["lengths"] + i["ids"]
        least = i["least_lengths"] + i["least_ids"]
        ratio = f"{counted / least:.2f}" if least else "-"
        lines.append(
            f"| {kind} | {_mb(counted)} | {_mb(model)} | {_mb(least)} | {ratio} | {_mb(i['header'])} | "
            f"{_mb(i['lengths'] - i['least_lengths'])} | {_mb(i['ids'] - i['least_ids'])} |"
        )
    return lines


def _pair_lines(got: dict, mode: str, rate: str) -> list[str]:
    """Cross-host MB per step by ordered host pair (every stage together)."""
    pairs = sorted({p for g in got.values() for p in g["pairs"]}, key=lambda p: tuple(map(int, p.split("->"))))
    lines = [
        "",
        f"## Cross-host MB per step by host pair ({mode}, {rate}), counted by the transport",
        "",
        "| sharding | " + " | ".join(pairs) + " | total |",
        "| --- | " + " | ".join("---:" for _ in pairs) + " | ---: |",
    ]
    for kind in CANDIDATES:
        if kind in got:
            g = got[kind]["pairs"]
            lines.append(
                f"| {kind} | " + " | ".join(_mb(g.get(p, 0.0)) for p in pairs) + f" | {_mb(sum(g.values()))} |"
            )
    return lines


NOTES = [
    "## Reading",
    "",
    "- Counted equals the analytic count exactly for the output dist (both directions, each mode) and DDP's",
    "  all-reduce; the links carried 0.4-4% more than counted (TCP/IP headers, the window's barriers, the loaders'",
    "  and Lightning's own small collectives), so nothing of size escapes the count.",
    "- With host blocks, row_wise, table_row_wise and grid_shard send the least: each host's two row blocks are",
    "  added on their host (over shared memory) and cross once; the flat exchange sends both (2x). table_wise,",
    "  column_wise and data_parallel hold no column twice on a host: both modes run the same flat exchange, so",
    "  their steps/s differ by noise alone. DDP's ring still crosses twice with 3/4 of the gradient (1.5x).",
    "- No latency is simulated: the links add only serialization time at their rate. The 2-core machine runs 4",
    "  ranks plus the kernel's forwarding of every byte, so compute takes most of a step at small widths.",
]


ONE_RANK_NOTES = [
    "## Reading",
    "",
    "- One rank per host: no host holds two row blocks of a table, so the hierarchical output dist keeps the",
    "  flat exchange (`auto` finds nothing to add on a host) and both modes send the same bytes; every group of",
    "  more than one rank spans hosts, so nothing takes the shared-memory transport. Counted equals the analytic",
    "  count for the output dist and DDP's ring (every one of its 4 hops crosses a host here). The two modes'",
    "  steps/s differ by the run's noise alone.",
    "- No latency is simulated: the links add only serialization time at their rate.",
]


def _planner_lines(summary: dict, cfg: dict) -> list[str]:
    """Where the planner's plans rank among the measured candidates, with every round's figure as the noise."""
    if not any(k in PLANNED for m in summary.values() for r in m.values() for k in r):
        return []
    mode = next(iter(summary))
    rate = next(iter(summary[mode]))
    got = summary[mode][rate]
    order = sorted(got, key=lambda k: -got[k]["median_steps_per_s"])
    best = got[order[0]]["median_steps_per_s"]
    lines = [
        "",
        f"## The planner's plan on the shaped link ({mode}, {rate})",
        "",
        '*planner*: the plan the strategy\'s planner makes for this job on `Topology(4, 4, 2, host_link="1gbit")`',
        "(2 hosts x 2 ranks, the link's speed shared by a host's ranks), told the data's ids per sample;",
        "*planner_defaults*: the same without `host_link` (the CPU defaults' inter-host speed, 8 Gbit/s per rank).",
        "*planner_profiled*: the same topology as *planner* with `speeds=` a profile of this job measured on these",
        "hosts before the timed rounds (`profile.measure` + `profile.fitted`, what `lightning-rec profile` and",
        "`profile_speeds` run: every rank at once, over the same links, on its own batches of the job), as",
        "`RecShardedStrategy(planner_speeds=...)` would plan with it (the fit told the topology's hardware, so that",
        "its steps' calibration knows which bytes crossed the link); its measurements are below the table.",
        f"Candidates ranked by their fastest round's median steps/s; every round's figure in brackets (rounds: {cfg['rounds']}).",
        "The planner's estimate of each candidate, from the link-aware cost model with the defaults' speeds and",
        "(where profiled) with the profile's, alongside.",
        "",
        "| rank | candidate | steps/s (median) | rounds | vs best | estimated step (ms) | with profile (ms) | plan |",
        "| ---: | --- | ---: | --- | ---: | ---: | ---: | --- |",
    ]
    estimates = cfg.get("estimates", {})
    for i, kind in enumerate(order, 1):
        g = got[kind]
        rounds = ", ".join(f"{x:.2f}" for x in g.get("rounds", []))
        est = [estimates.get(kind), estimates.get(kind + "@profiled")]
        lines.append(
            f"| {i} | {kind} | {g['median_steps_per_s']:.2f} | {rounds} | {g['median_steps_per_s'] / best:.2f} | "
            + " | ".join(f"{e:.1f}" if e is not None else "-" for e in est)
            + f" | {cfg.get('plans', {}).get(kind, kind)} |"
        )
    return lines + _profile_lines(cfg.get("profile"), cfg.get("per_host", PER_HOST))


def _profile_lines(prof: dict | None, per_host: int) -> list[str]:
    """What the profile measured across the hosts, and the exchange speeds fitted to it."""
    if not prof:
        return []
    from lightning_rec.plans.planner.fit import fit_latency

    world = N_HOSTS * per_host
    hops_a2a, hops_ring = max(1.0, math.log2(world)), 4 * (world - 1)
    ms = lambda x: "-" if x is None else f"{1e3 * x:.2f}"  # noqa: E731 - seconds as ms
    intra = prof.get("intra_host_bandwidth")
    alone = fit_latency(prof["latency_a2a_s"], prof["latency_ring_s"], world)
    text = (
        f"Profile: {prof['describe']}, at {prof['rate']}, {prof['wall_s']:.0f} s with the hosts' start. Over every"
        f" rank, on 8 bytes, an all-to-all took {ms(prof['latency_a2a_s'])} ms ({hops_a2a:.0f} hops in the cost"
        f" model: {ms(prof['latency_a2a_s'] / hops_a2a)} ms each) and the data-parallel sync's two all-gathers and"
        f" all-reduce {ms(prof['latency_ring_s'])} ms ({hops_ring} ring hops:"
        f" {ms(prof['latency_ring_s'] / hops_ring)} ms each): alone, {ms(alone)} ms per hop (`fit.fit_latency`: the"
        " model's latency of a step with both kinds' exchanges equals the measured one). The reference steps,"
        f" table-wise round-robin and with the smaller half of the tables data-parallel, took {ms(prof['step_s'])}"
        f" and {ms(prof['step_mixed_s'])} ms: in a step the sync's ring hops wait"
        f" {ms(prof['collective_latency'])} ms each (`fit.calibrate_step`: the model's extra time of the mixed"
        " step's sync as measured, where more than alone), the `collective_latency` the planner was given (the CPU"
        " defaults': 0.20 ms). Within each host (every"
        f" host's ranks at once): {ms(prof['a2a_tiny_s'])} ms tiny, {ms(prof['a2a_big_s'])} ms for"
        f" {(prof['a2a_bytes'] or 0) / 1e6:.2f} MB per rank: `intra_host_bandwidth` "
        + ("-" if intra is None else f"{intra / 1e9:.2f} GB/s")
        + f"; the fixed cost per step fitted to the steps {ms(prof['step_overhead'])} ms (added to every plan alike)."
    )
    return ["", *textwrap.wrap(text, 110)]


def _machine() -> str:
    import torch

    return f"{os.cpu_count()} CPU cores, Python {platform.python_version()}, torch {torch.__version__}"


def _on_hosts(cfg: dict, out: Path, rate: str, mode: str, what: str) -> dict:
    """This script's ranks on the simulated hosts, their links at ``rate``, the output dist in ``mode``; the run
    (:func:`run_hosts`'s result); exits naming ``what`` and the logs' tails where a rank failed."""
    from tests.distributed.hosts import run_bench_ranks

    env = {_ROLE: "1", "LIGHTNING_REC_BYTE_COUNT": "1", "LIGHTNING_REC_OUTPUT_DIST": MODES[mode]}
    return run_bench_ranks("benchmarks.bench_hosts", cfg, out, N_HOSTS, PER_HOST, rate, env, what)


def _run_profile(cfg: dict, rate: str, mode: str) -> tuple[str, dict]:
    """The profile of the job on the simulated hosts (the timed runs' harness, links and environment), before
    the timed rounds: (the speeds file, in the run's temp dir; what it measured, with the speeds fitted)."""
    from lightning_rec.plans.planner.speeds import ProfiledSpeeds

    out = Path(tempfile.mkdtemp(prefix="bench_hosts_profile_"))
    t0 = time.perf_counter()
    run = _on_hosts({**cfg, "phase": "profile"}, out, rate, mode, f"the profile at {rate}")
    path = out / "speeds.json"
    speeds = ProfiledSpeeds.load(path, "cpu")
    got = {
        **run["ranks"][0]["profile"],
        "wall_s": time.perf_counter() - t0,
        "rate": rate,
        "collective_latency": speeds.collective_latency,
        "intra_host_bandwidth": speeds.intra_host_bandwidth,
        "inter_host_bandwidth": speeds.inter_host_bandwidth,
        "step_overhead": speeds.step_overhead,
        "describe": speeds.describe(),
    }
    print(f"profile at {rate}: {json.dumps(got)}", flush=True)
    return str(path), got


def main() -> None:
    from tests.distributed.hosts import namespaces_unavailable
    from tests.distributed.hosts_net import network_unavailable

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", nargs="+", default=["1gbit"])
    parser.add_argument(
        "--modes", nargs="+", default=list(MODES), choices=list(MODES), help="output dist: host blocks, or flat"
    )
    parser.add_argument("--types", nargs="+", default=list(CANDIDATES), choices=CANDIDATES)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="runs per rate; the fastest (median step) is reported")
    parser.add_argument("--batch-size", type=int, default=512, help="per rank")
    parser.add_argument("--size", type=float, default=0.003, help="scale of Criteo's table sizes")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--hosts", type=int, default=2, help="simulated hosts")
    parser.add_argument("--per-host", type=int, default=2, help="ranks per host")
    parser.add_argument("--out", default="hosts", help="results file name under benchmarks/results (.md, .json)")
    parser.add_argument("--profile-batches", type=int, default=16, help=f"batches {PROFILED}'s profile times")
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="input pipelining (RecShardedStrategy(pipeline=True)): each batch's input dist runs during the step before",
    )
    parser.add_argument(
        "--fused",
        action="store_true",
        help="the tables train with fbgemm's fused Adagrad inside backward (RecShardedStrategy(embedding_optimizer="
        "...), the way TorchRec's examples train) instead of DLRM's sparse torch Adagrad",
    )
    args = parser.parse_args()
    _set_shape(args.hosts, args.per_host)
    why = namespaces_unavailable() or network_unavailable()
    if why is not None:
        raise SystemExit(why)
    keys = (
        "types",
        "steps",
        "warmup",
        "batch_size",
        "size",
        "dim",
        "hosts",
        "per_host",
        "profile_batches",
        "pipeline",
        "fused",
    )
    cfg = {k: getattr(args, k) for k in keys}
    profile = None
    if PROFILED in cfg["types"]:
        cfg["speeds"], profile = _run_profile(cfg, args.rates[0], args.modes[0])
    # the plans' descriptions and estimates serve the planner's section only
    plans, estimates = _describe_plans(cfg) if set(PLANNED) & set(cfg["types"]) else ({}, {})
    if "planner_defaults" in cfg["types"] and plans.get("planner_defaults") == plans.get("planner"):
        cfg["types"] = [k for k in cfg["types"] if k != "planner_defaults"]  # the same plan: timed once
    summary: dict = {}
    t0 = time.perf_counter()
    # rounds alternate the order of (mode, rate), so a neighbour's burst on the shared machine hits each alike
    pairs = [(m, r) for r in args.rates for m in args.modes]
    order = [p for i in range(args.rounds) for p in (pairs if i % 2 == 0 else pairs[::-1])]
    for mode, rate in order:
        out = Path(tempfile.mkdtemp(prefix="bench_hosts_"))
        run = _on_hosts(cfg, out, rate, mode, f"the run at {rate} ({mode})")
        got_now = {
            kind: _summarize(run["ranks"], run["hosts"], kind, mode) for kind in args.types if kind in run["ranks"][0]
        }
        for kind, got in got_now.items():
            best = summary.setdefault(mode, {}).setdefault(rate, {}).get(kind)
            rounds = [] if best is None else best["rounds"]
            got["rounds"] = [*rounds, got["median_steps_per_s"]]
            if best is None or got["median_steps_per_s"] > best["median_steps_per_s"]:
                summary[mode][rate][kind] = got  # the fastest round; its bytes are every round's
            else:
                best["rounds"] = got["rounds"]
        for kind, got in got_now.items():
            print(
                f"{rate} {mode} {kind}: {got['median_steps_per_s']:.2f} steps/s (median), {_mb(got['counted'])} MB/step "
                f"counted, {_mb(got['link'])} on the links, {json.dumps({k: round(v) for k, v in got['stages'].items()})}",
                flush=True,
            )
    _write(
        summary, {**vars(args), "plans": plans, "estimates": estimates, "profile": profile}, time.perf_counter() - t0
    )
    print(f"wrote {RESULTS / args.out}.md and .json")


if __name__ == "__main__":
    if os.environ.get(_ROLE):
        rank_main(Path(sys.argv[1]), json.loads(sys.argv[2]))
    else:
        main()
