"""DLRM training throughput and per-rank peak memory for every sharding type and the automatic plan.

Each configuration is a real ``Trainer(strategy=RecShardedStrategy(...))`` fit of ``lightning_rec.models.DLRM``
on ``world_size`` processes (gloo on CPU, NCCL on CUDA): 26 Criteo-shaped tables, all placed with one
sharding type (or by the automatic planner). Batches come from ``SyntheticClicks`` and are built before
the clock starts; the timed window runs from the start of step ``--warmup`` to the end of the last step,
between barriers. Memory is each process's peak resident set size (CPU) or peak allocated GPU memory
(CUDA), plus the bytes of embedding parameters and optimizer state that rank holds.

``table_row_wise`` and ``grid_shard`` place blocks on hosts; at 2 and 4 processes the run pretends to have
2 hosts (half the processes each), so table_row_wise alternates tables between the hosts and grid_shard
puts one column half on each host, row-split inside it. With one host they would equal row_wise; at 2
processes (one per host) they equal table_wise and column_wise, at 4 they differ from every other type.

    python benchmarks/bench_dlrm.py [--world-sizes 1 2 4] [--steps 20] [--rounds 2] [--batch-size 1024] [--size 0.003]

Writes benchmarks/results/dlrm.md, dlrm.csv and dlrm.png.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TYPES = ["data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "grid_shard", "auto"]
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _hosts(kind: str, ws: int) -> int:
    return 2 if kind in ("table_row_wise", "grid_shard") and ws >= 2 else 1


def _plan(kind: str, tables, ws: int):
    from lightning_rec.sharding import (
        ShardingPlan,
        column_wise,
        data_parallel,
        grid_shard,
        row_wise,
        table_row_wise,
        table_wise,
    )

    if kind == "auto":
        return None
    hosts = _hosts(kind, ws)

    def placement(i: int):  # i: the table's position by size, largest first
        if kind == "data_parallel":
            return data_parallel()
        if kind == "table_wise":  # round robin from the largest: as even as whole tables get
            return table_wise(rank=i % ws)
        if kind == "row_wise":
            return row_wise()
        if kind == "column_wise":
            return column_wise(ranks=list(range(ws)))
        if kind == "table_row_wise":
            return table_row_wise(host_index=i % hosts)
        return grid_shard(host_indexes=list(range(hosts)))

    by_size = sorted(tables, key=lambda t: -t.num_embeddings)
    return ShardingPlan({"sparse_arch.embedding_bag_collection": {t.name: placement(i) for i, t in enumerate(by_size)}})


def _job(rank: int, ws: int, kind: str, args: dict) -> dict:
    import resource

    import lightning as L

    from lightning_rec import RecShardedStrategy
    from lightning_rec.data import SyntheticClicks
    from lightning_rec.models import DLRM

    cuda = args["accelerator"] == "cuda"
    steps, warmup, b = args["steps"], args["warmup"], args["batch_size"]
    # one thread per process in every configuration (a process per core): Lightning would otherwise give
    # cores // processes-per-host threads, which differs between layouts of the same world size
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    ds = SyntheticClicks(num_rows=ws * b * steps, batch_size=b, size=args["size"], rank=rank, world_size=ws)
    batches = list(ds)
    torch.manual_seed(0)
    model = DLRM(
        num_dense=ds.num_dense,
        feature_names=ds.feature_names,
        num_embeddings_per_feature=ds.cardinalities,
        embedding_dim=args["dim"],
        dense_arch_layer_sizes=[256, 64, args["dim"]],
        over_arch_layer_sizes=[256, 64, 1],
        plan=_plan(kind, model_tables(ds, args["dim"]), ws),
    )

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == warmup:
                torch.distributed.barrier()
                if cuda:
                    torch.cuda.synchronize()
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == steps - 1:
                if cuda:
                    torch.cuda.synchronize()
                torch.distributed.barrier()
                self.seconds = time.perf_counter() - self.start

    timer = Timer()
    hosts = _hosts(kind, ws)
    trainer = L.Trainer(
        accelerator=args["accelerator"],
        devices=ws // hosts,
        num_nodes=hosts,
        max_steps=steps,
        strategy=RecShardedStrategy(model_parallel_size=ws),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=[timer],
    )
    trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    emb = model.sparse_arch.embedding_bag_collection
    emb_params = {id(p) for p in emb.parameters()}
    state_bytes = sum(p.numel() * p.element_size() for p in emb.parameters())
    for opt in trainer.optimizers:
        for p, st in opt.state.items():
            if id(p) in emb_params:
                state_bytes += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "seconds": timer.seconds,
        "peak_bytes": peak,
        "table_bytes": state_bytes,
        "types": _types_of(emb, ws) if kind == "auto" else {},
    }


def model_tables(ds, dim: int):
    from lightning_rec.models import tables_from_cardinalities

    return tables_from_cardinalities(ds.feature_names, ds.cardinalities, dim)


def _types_of(emb, ws: int) -> dict[str, int]:
    """How many tables of each layout the automatic plan chose, read from the sharded module's shards.

    Row-split tables are reported as row_wise whether the plan said row_wise or table_row_wise (one host).
    """
    counts: dict[str, int] = {}
    for shards in getattr(emb, "_shards", {}).values():  # {table: [ShardMeta] or None for data-parallel}
        if shards is None:
            kind = "data_parallel"
        else:
            shards = [s for s in shards if s.rows > 0]
            cols = {s.col_offset for s in shards}
            rows = {s.row_offset for s in shards}
            kind = (
                "table_wise"
                if len(shards) == 1
                else "column_wise"
                if len(rows) == 1
                else "row_wise"
                if len(cols) == 1
                else "grid_shard"
            )
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def _machine(accelerator: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            cpu = names[0]
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        pass
    text = f"{os.cpu_count()} CPU cores ({cpu}){mem}, Python {platform.python_version()}, torch {torch.__version__}"
    if accelerator == "cuda":
        text += f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return text


def _plot(rows: list[dict], path: str, world_sizes: list[int], unit: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(world_sizes)
    for j, ws in enumerate(world_sizes):
        sel = {r["sharding"]: r for r in rows if r["world_size"] == ws}
        xs = [i + (j - (len(world_sizes) - 1) / 2) * width for i in range(len(TYPES))]
        a1.bar(xs, [sel[k]["samples_per_s"] if k in sel else 0 for k in TYPES], width, label=f"{ws} proc")
        a2.bar(xs, [sel[k]["peak_mib"] if k in sel else 0 for k in TYPES], width, label=f"{ws} proc")
    # room for the legends above the bars
    a1.set_ylim(0, max(r["samples_per_s"] for r in rows) * 1.2)
    a2.set_ylim(0, max(r["peak_mib"] for r in rows) * 1.25)
    for ax, title in ((a1, "training samples/s (all ranks)"), (a2, f"peak {unit} per rank (MiB, max over ranks)")):
        ax.set_xticks(range(len(TYPES)))
        ax.set_xticklabels(TYPES, rotation=30, ha="right")
        ax.set_title(title)
        ax.legend(loc="upper right", ncols=len(world_sizes))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    from lightning_rec.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--types", nargs="+", default=TYPES, choices=TYPES)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="runs per configuration; the fastest is reported")
    parser.add_argument("--batch-size", type=int, default=1024, help="per process")
    parser.add_argument("--size", type=float, default=0.003, help="scale of Criteo's table sizes")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--accelerator", choices=["auto", "cpu", "cuda"], default="auto")
    args = parser.parse_args()
    acc = args.accelerator if args.accelerator != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    world_sizes = args.world_sizes
    if acc == "cuda":
        world_sizes = [w for w in world_sizes if w <= torch.cuda.device_count()]
    job_args = {
        "accelerator": acc,
        "steps": args.steps,
        "warmup": args.warmup,
        "batch_size": args.batch_size,
        "size": args.size,
        "dim": args.dim,
    }
    rows, auto_types = [], {}
    t0 = time.perf_counter()
    for ws in world_sizes:
        for kind in args.types:
            hosts = _hosts(kind, ws)
            runs = [
                run_distributed(
                    _job, ws, kind, job_args, init_process_group=False, timeout_s=600, ranks_per_node=ws // hosts
                )
                for _ in range(args.rounds)
            ]
            res = min(runs, key=lambda rs: max(r["seconds"] for r in rs))
            seconds = max(r["seconds"] for r in res)
            row = {
                "device": acc,
                "world_size": ws,
                "sharding": kind,
                "hosts": hosts,
                "samples_per_s": round(ws * args.batch_size * (args.steps - args.warmup) / seconds),
                "peak_mib": round(max(r["peak_bytes"] for r in res) / 2**20),
                "table_mib_max": round(max(r["table_bytes"] for r in res) / 2**20, 1),
                "table_mib_sum": round(sum(r["table_bytes"] for r in res) / 2**20, 1),
            }
            if kind == "auto":
                auto_types[ws] = res[0]["types"]
            rows.append(row)
            print(row, flush=True)
    total = time.perf_counter() - t0
    _write(rows, auto_types, args, acc, world_sizes, total)


def _write(rows, auto_types, args, acc, world_sizes, total) -> None:
    from lightning_rec.data import SyntheticClicks

    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "dlrm.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    unit = "GPU memory allocated" if acc == "cuda" else "RSS"
    _plot(rows, os.path.join(RESULTS, "dlrm.png"), world_sizes, unit)
    cards = SyntheticClicks(num_rows=1, batch_size=1, size=args.size).cardinalities
    n_rows = sum(cards)
    lines = [
        f"# DLRM training: throughput and memory per sharding type ({acc})",
        "",
        f"Machine: {_machine(acc)}.",
        "",
        (
            f"Workload: `lightning_rec.models.DLRM` under `Trainer(strategy=RecShardedStrategy())`, 26 tables "
            f"(Criteo cardinalities x {args.size}: {n_rows:,} rows x {args.dim} dims, "
            f"{n_rows * args.dim * 4 / 2**20:.0f} MiB of fp32 weights), bottom MLP 13-256-64-{args.dim}, top MLP "
            f"256-64-1, Adam on the MLPs and sparse-gradient Adagrad on the tables, SyntheticClicks batches of "
            f"{args.batch_size} rows per process (3 multi-hot features), one thread per process, {args.steps} steps of which {args.warmup} "
            f"untimed warm-up. Every table uses the row's sharding type; `auto` is the automatic planner. "
            f"`table_row_wise` / `grid_shard` at 2 and 4 processes pretend to have 2 hosts (see the script). "
            f"Each configuration ran {args.rounds} times; the table shows the fastest round (the one least disturbed "
            f"by other work on the machine). Total benchmark time {total / 60:.1f} min."
        ),
        "",
        (
            f"samples/s counts all ranks' samples (weak scaling: each process has its own batch). Peak {unit} is "
            "the maximum over ranks; table MiB is embedding weights plus optimizer state held by the busiest rank "
            "(max) and by all ranks together (sum)."
        ),
        "",
        f"| processes | sharding | samples/s | peak {unit} MiB / rank | table MiB max rank | table MiB all ranks |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['world_size']} | {r['sharding']} | {r['samples_per_s']:,} | {r['peak_mib']:,} | "
            f"{r['table_mib_max']:,} | {r['table_mib_sum']:,} |"
        )
    if any(auto_types.values()):
        lines += [
            "",
            "Automatic plan chose: "
            + "; ".join(
                f"{ws} proc: " + ", ".join(f"{n} {t}" for t, n in sorted(c.items())) for ws, c in auto_types.items()
            ),
        ]
    if acc == "cpu" and os.cpu_count() and max(world_sizes) > os.cpu_count():
        lines += [
            "",
            (
                f"With more processes than the {os.cpu_count()} cores, processes share cores: those figures "
                "show communication and scheduling cost, not scaling."
            ),
        ]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(RESULTS, "dlrm.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
