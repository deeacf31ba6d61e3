"""TorchRec and lightning_rec on the same simulated hosts: 2 hosts x 2 ranks joined by a shaped link, steps/s.

The hosts are those of ``benchmarks/bench_hosts.py`` (``tests/distributed/hosts.py`` with ``own_network``:
each host its own UTS, pid, mount and network namespaces, its ``eth0`` plugged into a bridge through a veth pair
that ``tbf`` limits to ``--rate`` in each direction, no added latency). The job is ``bench_vs_torchrec.py``'s
DLRM-like one, its code reused unchanged (``run_config``): 26 tables of Criteo-like sizes x ``--dlrm-scale``,
``--dim`` columns, ``--batch`` samples per rank, bags of about ``--ids`` Zipf ids, the fused update (fbgemm
EXACT_SGD inside backward) and every table placed with one sharding type, the same plan on both sides.
TorchRec runs in its side environment (``benchmarks/.side_env/torchrec-<version>``, built by
``bench_vs_torchrec.py --build-only``): each of its ranks starts as the project's Python under the hosts'
launcher environment and replaces itself (``exec``) with the side environment's Python, without PYTHONPATH, so
TorchRec imports nothing of this checkout but the job's code. Both go through gloo between hosts; within a host
lightning_rec's groups take its shared-memory transport, TorchRec's gloo over loopback. lightning_rec's output
dist is the default, hierarchical where a host holds a column twice (``LIGHTNING_REC_OUTPUT_DIST=auto``).

Each round runs both libraries, one after the other (the order alternates between rounds), every sharding type
in one set of processes per library; a type that fails is recorded (the first rank's error that is not a
peer's disappearance, and the exit codes), and the types after it run in new processes.

    python benchmarks/bench_hosts_torchrec.py [--plans ...] [--rounds 2] [--rate 1gbit] [--dim 64] [--batch 512]

Needs root, iproute2, tc and the side environment. Writes benchmarks/results/hosts_torchrec.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

PLANS = ("table_wise", "row_wise", "column_wise", "data_parallel", "table_row_wise", "grid_shard")
LIBS = ("lightning_rec", "torchrec")
N_HOSTS, PER_HOST = 2, 2
WORLD = N_HOSTS * PER_HOST
_ROLE = "LIGHTNING_REC_BENCH_HOSTS_TORCHREC_RANK"  # set on the ranks: this file is their program too
_EXECED = "LIGHTNING_REC_BENCH_HOSTS_TORCHREC_SIDE"  # set once a rank runs in the side environment
# what a rank raises when another rank failed first: not the failure to report
_FOLLOWER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "left the group", "Timed out")
RESULTS = ROOT / "benchmarks" / "results"


def rank_main(out_dir: Path, lib: str, job: dict) -> None:
    """One rank: every plan of ``job`` in turn, each plan's result written to ``rank<R>.json`` as it ends."""
    rank = int(os.environ["RANK"])
    if lib == "torchrec" and not os.environ.get(_EXECED):
        # the same process (the host's pid 1 reaps it) continues as the side environment's Python
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env[_EXECED] = "1"
        py = job["side_python"]
        os.execve(py, [py, "-m", "benchmarks.bench_hosts_torchrec", str(out_dir), lib, json.dumps(job)], env)
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from benchmarks.bench_vs_torchrec import run_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=job["timeout_s"]))  # env:// as under a launcher
    results: dict = {"python": sys.executable}
    path = out_dir / f"rank{rank}.json"
    for plan in job["plans"]:
        cmd = {"job": "dlrm", "plan": plan, "variant": job["variant"], "cfg": job["cfg"]}
        try:
            got = run_config(lib, rank, WORLD, cmd)
            keep = ("elapsed", "step_times", "checksum", "trained")
            results[plan] = {"ok": True, "python": sys.executable, **{k: got[k] for k in keep}}
        except BaseException as e:
            where = traceback.extract_tb(e.__traceback__)[-1]
            # an assertion without a message says only where it stands
            last = (str(e).strip().splitlines() or [f"at {where.filename}:{where.lineno} {where.line}"])[-1]
            results[plan] = {"ok": False, "error": f"{type(e).__name__}: {last}"[:400], "trace": traceback.format_exc()}
            path.write_text(json.dumps(results))
            # gone at once: peers waiting in a collective with this rank see its socket close and fail too
            os._exit(3)
        path.write_text(json.dumps(results))
    if lib == "lightning_rec":
        from lightning_rec import transport

        transport.close_all()
    dist.destroy_process_group()


# -- the driver --------------------------------------------------------------------------------------------


def _run(lib: str, plans: list[str], job: dict, rate: str) -> dict[str, dict]:
    """Every plan of ``plans`` on the hosts with ``lib``: ``{plan: result}``; a failed plan's result says how,
    and the plans after it run in new processes."""
    from tests.distributed.hosts import run_hosts

    out: dict[str, dict] = {}
    left = list(plans)
    while left:
        d = Path(tempfile.mkdtemp(prefix=f"bench_hosts_{lib}_"))
        run = run_hosts(
            "benchmarks.bench_hosts_torchrec",
            [lib, json.dumps({**job, "plans": left})],
            d,
            N_HOSTS,
            PER_HOST,
            deadline_s=job["deadline_s"],
            own_network=True,
            link_rate=rate,
            env={_ROLE: "1", "LIGHTNING_REC_OUTPUT_DIST": "auto", "PYTHONWARNINGS": "ignore"},
        )
        ranks = [r or {} for r in run["ranks"]]
        codes = {r: c for h in run["hosts"] if h for r, c in h["exit_codes"].items()}
        for plan in list(left):
            per = [r.get(plan) for r in ranks]
            if all(p is not None and p["ok"] for p in per):
                out[plan] = _timing(per)  # type: ignore[arg-type]
                left.remove(plan)
                continue
            errors = [p["error"] for p in per if p is not None and not p["ok"]]
            first = next((e for e in errors if not any(f in e for f in _FOLLOWER)), errors[0] if errors else None)
            if first is None:  # no rank said why: killed at the deadline, or died without a word
                logs = [t.strip().splitlines()[-1] for t in run["logs"] if t.strip()]
                first = f"no error recorded (timed out: {run['timed_out']}); last log line: {logs[-1] if logs else '-'}"
            out[plan] = {"ok": False, "error": first, "exit_codes": codes}
            left.remove(plan)
            print(f"{lib} {plan}: FAILED {first} (exit codes {codes})", flush=True)
            break
        if run["leftover"]:
            raise SystemExit(f"processes left after a run: {run['leftover']}")
    return out


def _timing(per: list[dict]) -> dict:
    steps = len(per[0]["step_times"])
    slowest = [max(p["step_times"][i] for p in per) for i in range(steps)]
    return {
        "ok": True,
        "steps_per_s": steps / max(p["elapsed"] for p in per),
        "median_steps_per_s": 1 / statistics.median(slowest),
        "trained": [p["trained"] for p in per],
        "checksums": [p["checksum"] for p in per],
        "python": per[0].get("python"),
    }


def _cell(g: dict | None) -> str:
    if g is None:
        return "-"
    if not g["ok"]:
        return "fails"
    return f"{g['median_steps_per_s']:.2f} ({g['steps_per_s']:.2f})"


def _rel(text: str) -> str:
    """Paths of this checkout relative to it (the report is read in other checkouts)."""
    return text.replace(str(ROOT) + "/", "")


def _write(res: dict, args: argparse.Namespace, loads: list[str], seconds: float, name: str) -> None:
    import torch

    (RESULTS / f"{name}.json").write_text(
        json.dumps({"args": vars(args), "loads": loads, "seconds": seconds, "results": res}, indent=1)
    )
    lines = [
        "# TorchRec and lightning_rec on 2 simulated hosts x 2 ranks (shaped link), steps/s",
        "",
        f"`python benchmarks/bench_hosts_torchrec.py {' '.join(sys.argv[1:])}` ({seconds:.0f} s). "
        f"{os.cpu_count()} CPU cores, torch {torch.__version__} on both sides, TorchRec from `{_rel(args.side_env)}`.",
        "",
        f"Hosts as in `hosts.md`: each its own namespaces (network included), its link `tbf`-limited to {args.rate}",
        "each way, no added latency; Lightning's multi-node launcher environment (RANK, LOCAL_RANK, NODE_RANK,",
        "LOCAL_WORLD_SIZE=2, MASTER_ADDR = host 0's address); gloo between hosts. The job: `bench_vs_torchrec.py`'s",
        f"DLRM-like `dlrm` job (26 tables, Criteo-like sizes x {args.dlrm_scale}, {args.dim} dims, {args.batch} samples",
        f"per rank, about {args.ids} Zipf({args.zipf}) ids per bag, {args.variant} update, SGD lr {args.lr}), every table",
        f"placed with one sharding type, the same plan on both sides; {args.warmup} untimed steps, then {args.steps}",
        "timed between barriers. Within a host lightning_rec's groups use its shared-memory transport and TorchRec",
        "gloo over loopback; lightning_rec's output dist is its default (`auto`: hierarchical where a host holds a",
        "column twice: row_wise, table_row_wise, grid_shard).",
        "",
        "Median step (the slowest rank's time of each timed step, then the median), whole window's mean in brackets,",
        f"of the fastest of {args.rounds} rounds; rounds alternate which library runs first. Load averages (1 / 5 / 15",
        "min) at the end of each round: " + "; ".join(loads) + ".",
        "",
        "| sharding | lightning_rec | TorchRec | lightning_rec / TorchRec | rounds (ours; TorchRec) |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    failures = []
    for plan in args.plans:
        ours, theirs = res["lightning_rec"].get(plan), res["torchrec"].get(plan)
        ratio = "-"
        if ours and theirs and ours["ok"] and theirs["ok"]:
            ratio = f"{ours['median_steps_per_s'] / theirs['median_steps_per_s']:.2f}"

        def rounds(g: dict | None) -> str:
            return ", ".join(f"{x:.2f}" for x in (g or {}).get("rounds", [])) or "-"

        lines.append(f"| {plan} | {_cell(ours)} | {_cell(theirs)} | {ratio} | {rounds(ours)}; {rounds(theirs)} |")
        for lib, g in (("lightning_rec", ours), ("TorchRec", theirs)):
            if g is not None and not g["ok"]:
                failures.append(f"- {lib}, {plan}: `{_rel(g['error'])}` (exit codes {g['exit_codes']})")
    if failures:
        lines += ["", "Failures (the first error a rank recorded that was not a peer's disappearance):", "", *failures]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    from benchmarks.bench_vs_torchrec import DEFAULT_ENV, side_python
    from tests.distributed.hosts import namespaces_unavailable
    from tests.distributed.hosts_net import network_unavailable

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plans", nargs="+", default=list(PLANS), choices=PLANS)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--variant", default="fused", choices=("fused", "dense"))
    ap.add_argument("--dlrm-scale", type=float, default=0.1)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=512, help="samples per rank per step")
    ap.add_argument("--ids", type=int, default=20, help="mean ids per bag")
    ap.add_argument("--zipf", type=float, default=1.05)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--distinct", type=int, default=4, help="distinct batches per rank, cycled")
    ap.add_argument("--side-env", default=os.environ.get("LIGHTNING_REC_TORCHREC_ENV", str(DEFAULT_ENV)))
    ap.add_argument("--deadline", type=float, default=400.0, help="seconds one set of processes may run")
    ap.add_argument("--out", default="hosts_torchrec", help="results file name under benchmarks/results")
    args = ap.parse_args()
    why = namespaces_unavailable() or network_unavailable()
    if why is not None:
        raise SystemExit(why)
    py = side_python(Path(args.side_env))
    if not py.exists():
        raise SystemExit(f"no TorchRec side environment at {args.side_env}: bench_vs_torchrec.py --build-only")
    cfg = {k: getattr(args, k) for k in ("dlrm_scale", "dim", "batch", "ids", "zipf", "lr", "warmup", "steps")}
    cfg["distinct"] = args.distinct
    job = {
        "cfg": cfg,
        "variant": args.variant,
        "side_python": str(py),
        "timeout_s": 120,
        "deadline_s": args.deadline,
    }
    res: dict[str, dict] = {lib: {} for lib in LIBS}
    loads = []
    t0 = time.perf_counter()
    for i in range(args.rounds):
        for lib in LIBS if i % 2 == 0 else LIBS[::-1]:
            for plan, got in _run(lib, args.plans, job, args.rate).items():
                best = res[lib].get(plan)
                if got["ok"]:
                    got["rounds"] = [*(best or {}).get("rounds", []), got["median_steps_per_s"]]
                    if best is None or not best["ok"] or got["median_steps_per_s"] > best["median_steps_per_s"]:
                        res[lib][plan] = got
                    else:
                        best["rounds"] = got["rounds"]
                    print(f"round {i} {lib} {plan}: {got['median_steps_per_s']:.2f} steps/s (median)", flush=True)
                elif best is None:
                    res[lib][plan] = got
        loads.append(" / ".join(f"{x:.1f}" for x in os.getloadavg()))
        print(f"round {i} done, load {loads[-1]}", flush=True)
    for plan in args.plans:  # the same ids on both sides (plain torch generators, one torch build)
        a, b = res["lightning_rec"].get(plan), res["torchrec"].get(plan)
        if a and b and a["ok"] and b["ok"] and a["checksums"] != b["checksums"]:
            print(f"WARNING {plan}: the two libraries saw different batches", flush=True)
    _write(res, args, loads, time.perf_counter() - t0, args.out)
    print(f"wrote {RESULTS / args.out}.md and .json")


if __name__ == "__main__":
    if os.environ.get(_ROLE):
        rank_main(Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]))
    else:
        main()
