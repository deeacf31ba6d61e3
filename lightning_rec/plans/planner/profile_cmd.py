"""``lightning-rec profile``: measure the planner's speeds on a job's own data and write them as JSON.

The tables come from a table file (as ``lightning-rec plan`` reads it) or, without one, from the data: one
table per feature, sized by the data module's cardinalities. The batches are the first ``--batches`` of the
training loader of :class:`~lightning_rec.data.ClickDataModule` (the main job's data: synthetic click logs or
Criteo files). ``--processes N`` profiles in N processes of this host at once (gloo): the lookups then share
the memory system as in training, and the exchange between them is measured.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import yaml

from lightning_rec.data.datamodule import ClickDataModule
from lightning_rec.plans.planner.profile import profile_speeds
from lightning_rec.plans.planner.speeds import ProfiledSpeeds


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``profile`` subcommand on the ``lightning-rec`` parser."""
    p = sub.add_parser(
        "profile",
        help="measure lookup, update and exchange speeds on the job's own data and write them as JSON "
        "(for lightning-rec plan --speeds, Planner(speeds=...), RecShardedStrategy(planner_speeds=...))",
    )
    p.add_argument("tables", nargs="?", help="YAML or JSON table file (default: one table per feature of the data)")
    p.add_argument("-o", "--output", required=True, help="the speeds file to write (JSON)")
    p.add_argument(
        "--data",
        choices=("synthetic", "criteo_tsv", "criteo_npy", "criteo_parquet"),
        default="synthetic",
        help="ClickDataModule source (default: %(default)s)",
    )
    p.add_argument("--path", help="the Criteo data (criteo_* sources)")
    p.add_argument("--size", type=float, default=1e-3, help="table sizes: Criteo's x SIZE (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--multi-hot", action="append", default=[], metavar="FEATURE=N", help="synthetic data: bags of up to N ids"
    )
    p.add_argument("--batch-size", type=int, default=512, help="samples per batch (per rank)")
    p.add_argument("--embedding-dim", type=int, default=16, help="width of the tables made from the data")
    p.add_argument(
        "--embedding-optimizer",
        metavar="SPEC",
        help="the job's fused optimizer as JSON/YAML, e.g. '{kind: rowwise_adagrad, lr: 0.05}' (default: none, "
        "a torch SGD step over the tables' gradients)",
    )
    p.add_argument("--gradients", choices=("sparse", "dense"), default="sparse", help="without a fused optimizer")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--batches", type=int, default=16, help="batches profiled (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="passes over them; each time is the median")
    p.add_argument("--processes", type=int, default=1, help="processes of this host profiling at once (CPU only)")


def _options(args: argparse.Namespace, load_tables: Callable[[str], tuple]) -> dict[str, Any]:
    multi_hot = {}
    for item in args.multi_hot:
        name, sep, n = item.partition("=")
        if not sep or not n.isdigit():
            raise ValueError(f"--multi-hot {item!r}: expected FEATURE=N")
        multi_hot[name] = int(n)
    spec = yaml.safe_load(args.embedding_optimizer) if args.embedding_optimizer else None
    if spec is not None and not isinstance(spec, dict):
        raise ValueError(f"--embedding-optimizer: expected a mapping such as '{{kind: sgd, lr: 0.01}}', got {spec!r}")
    if args.processes < 1 or (args.processes > 1 and args.device != "cpu"):
        raise ValueError("--processes: a positive number, above 1 on the CPU only")
    if args.batches < 1 or args.repeats < 1:
        raise ValueError("--batches and --repeats must be positive")
    data = {
        "source": args.data,
        "path": args.path,
        "batch_size": args.batch_size,
        "train_rows": args.batch_size * args.batches,
        "size": args.size,
        "seed": args.seed,
        "multi_hot": multi_hot or None,
        "shuffle": False,
    }
    tables = load_tables(args.tables)[0] if args.tables else None
    return {
        "data": data,
        "tables": tables,
        "dim": args.embedding_dim,
        "spec": spec,
        "gradients": "fused" if spec is not None else args.gradients,
        "device": args.device,
        "batches": args.batches,
        "repeats": args.repeats,
    }


def run(opts: dict[str, Any]) -> ProfiledSpeeds:
    """Profile in this process (under its process group, if any) as the options say."""
    dm = ClickDataModule(**opts["data"])
    tables = opts["tables"] or dm.table_configs(opts["dim"])
    loader = dm.train_dataloader()
    return profile_speeds(
        tables,
        loader,
        device=opts["device"],
        embedding_optimizer=opts["spec"],
        gradients=None if opts["spec"] is not None else opts["gradients"],
        max_batches=opts["batches"],
        repeats=opts["repeats"],
    )


def _rank(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    return run(opts).as_dict()


def command(args: argparse.Namespace, load_tables: Callable[[str], tuple], launch: Callable[..., list]) -> int:
    """Run ``lightning-rec profile``: ``load_tables`` reads a table file as ``lightning-rec plan`` does, ``launch``
    runs a function on several processes of this host (``lightning_rec.testing.run_distributed``)."""
    opts = _options(args, load_tables)
    if args.processes > 1:
        speeds = ProfiledSpeeds.from_dict(launch(_rank, args.processes, opts, timeout_s=3600)[0])
    else:
        speeds = run(opts)
    speeds.save(args.output)
    print(f"wrote {args.output}: {speeds.describe()}")
    print(summary(speeds))
    return 0


def summary(speeds: ProfiledSpeeds) -> str:
    """One line per table: what was measured and the speeds fitted to it."""
    lines = [
        f"{'table':<24} {'rows':>11} {'ids/sample':>10} {'ms/batch':>9} {'lookup GB/s':>11} {'update GB/s':>11}",
    ]
    for t in speeds.tables:
        ms = t.lookup_ms + t.update_ms
        lines.append(
            f"{t.name[:24]:<24} {t.rows:>11,} {t.ids:>10.2f} {ms:>9.3f} {t.lookup_bandwidth / 1e9:>11.2f} "
            f"{t.update_bandwidth / 1e9:>11.2f}"
        )
    extra = {"step_overhead_ms": 1e3 * speeds.step_overhead, "grouped/per-table": speeds.group_scale}
    if speeds.collective_latency is not None:
        extra["collective_latency_us"] = 1e6 * speeds.collective_latency
    if speeds.intra_host_bandwidth is not None:
        extra["intra_host_GB/s"] = speeds.intra_host_bandwidth / 1e9
    lines.append(json.dumps({k: round(v, 3) for k, v in extra.items()}))
    return "\n".join(lines)
