"""The planner's run time, before and after a change, side by side in one run, and whether the plans agree.

The "before" planner package (``lightning_rec/plans/planner/``) is read from git (``--before``, default the
commit before the vectorised search) and imported next to the working tree's one; both plan the same tables,
alternately, ``--repeats`` times; the table reports the fastest run of each (the least disturbed by other
processes) and their ratio (a ratio is meaningful on a loaded machine, an absolute time less so), and checks
that both chose the same placement for every table and estimated the same step time.

Cases: the DLRM job's 26 Criteo-shaped tables (2 hosts x 8 GPUs), and 1,000 tables x 4,096 ranks
(model-parallel groups of 8 and of 4,096; CUDA defaults, 80 GB per rank, 2 TB host memory, fused
row-wise Adagrad) as in ``bench_planner.py``.

Usage:
    python benchmarks/bench_planner_speed.py [--before REV] [--repeats 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_rec import EmbeddingBagConfig  # noqa: E402
from lightning_rec.data.synthetic import CRITEO_CARDINALITIES  # noqa: E402
from lightning_rec.plans import planner as new_planner  # noqa: E402

BEFORE = "5ee0af6"  # the planner package before the search scored placements per shard and per host
PACKAGE = "lightning_rec/sharding/planner"


def load_before(rev: str):
    """The planner package at ``rev`` as the module ``planner_before`` (its own imports redirected to it)."""
    names = subprocess.run(
        ["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:{PACKAGE}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    pkg = Path(tempfile.mkdtemp()) / "planner_before"
    pkg.mkdir()
    for name in (n for n in names if n.endswith(".py")):
        src = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:{PACKAGE}/{name}"], capture_output=True, text=True, check=True
        ).stdout
        # the package's own imports, under its name at ``rev``
        (pkg / name).write_text(src.replace("lightning_rec.sharding.planner.", "planner_before."))
    spec = importlib.util.spec_from_file_location(
        "planner_before", pkg / "__init__.py", submodule_search_locations=[str(pkg)]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses and submodules look their module up
    spec.loader.exec_module(mod)
    return mod


def cases():
    dlrm = [EmbeddingBagConfig(int(c), 128, f"t_{i}", [f"cat_{i}"]) for i, c in enumerate(CRITEO_CARDINALITIES)]
    yield (
        "DLRM 26 Criteo tables, 16 ranks (2 hosts x 8)",
        dlrm,
        {f"cat_{i}": 1.0 for i in range(26)},
        dict(world_size=16, model_parallel_size=16, local_size=8, device_memory="80GB", device="cuda"),
    )
    for mp in (8, 4096):
        rng = random.Random(0)
        tables = [
            EmbeddingBagConfig(
                int(10 ** rng.uniform(3, 7.3)), rng.choice([16, 32, 64, 128, 256]), f"table_{i}", [f"f{i}"]
            )
            for i in range(1000)
        ]
        pooling = {f"f{i}": rng.choice([1, 1, 5, 20, 50]) for i in range(1000)}
        yield (
            f"1,000 tables x 4,096 ranks, model-parallel group {mp}",
            tables,
            pooling,
            dict(
                world_size=4096,
                model_parallel_size=mp,
                local_size=min(8, mp),
                device_memory="80GB",
                host_memory="2TB",
                device="cuda",
            ),
        )


def run(mod, tables, pooling, topo_kw) -> tuple[tuple[float, float], list]:
    planner = mod.Planner(
        mod.Topology(**topo_kw), batch_size=512, pooling_factors=pooling, optimizer="rowwise_adagrad", gradients="fused"
    )
    t0, c0 = time.perf_counter(), time.process_time()
    planner.plan(tables)
    dt = (time.perf_counter() - t0, time.process_time() - c0)
    rep = planner.explain()
    placements = [
        (c.table, c.sharding.sharding_type.value, c.sharding.ranks, c.sharding.host_indexes, c.sharding.compute_kernel)
        for c in rep.tables
    ]
    return dt, [placements, rep.step_time_ms]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default=BEFORE)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", default="all", help="'all', or 'big' for the 1,000-table group of 4,096 only")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "planner_speed.md"))
    args = ap.parse_args(argv)
    before = load_before(args.before)
    load0 = os.getloadavg()
    lines = [
        "# Planner run time: before vs after, one run",
        "",
        f"Before: `{PACKAGE}/` at {args.before[:10]}; after: the working tree. "
        f"Alternating, {args.repeats} runs each, fastest run in seconds; fused row-wise Adagrad, 512 samples "
        "per rank.",
        "",
        "| case | before s | after s | speed-up | before CPU s | after CPU s | same plans |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, tables, pooling, topo_kw in cases():
        if args.cases == "big" and "group 4096" not in name:
            continue
        times: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
        results = {}
        for r in range(args.repeats):
            order = [("before", before), ("after", new_planner)]
            for label, mod in order if r % 2 == 0 else order[::-1]:
                dt, res = run(mod, tables, pooling, topo_kw)
                times[label].append(dt)
                results[label] = res
        (b, bc), (a, ac) = (tuple(min(x[i] for x in times[k]) for i in (0, 1)) for k in ("before", "after"))
        same = results["before"][0] == results["after"][0]
        step_b, step_a = results["before"][1], results["after"][1]
        same_text = "yes" if same and abs(step_a - step_b) <= 1e-9 * abs(step_b) else "NO"
        lines.append(f"| {name} | {b:.3f} | {a:.3f} | {b / a:.1f}x | {bc:.3f} | {ac:.3f} | {same_text} |")
        print(lines[-1], flush=True)
    lines += [
        "",
        f"Machine: {os.cpu_count()} cores; load average {load0[0]:.1f} at start, {os.getloadavg()[0]:.1f} "
        "at end (other processes share the cores: compare the ratio, not the seconds). CPU s: the process's "
        "own CPU time, fastest run (closer to a quiet machine's wall time than the wall time under load).",
        "",
        f"Command: `python benchmarks/bench_planner_speed.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
