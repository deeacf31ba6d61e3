"""Training throughput of every sharding type on gloo CPU processes, against the unsharded module.

Workload (defaults; shrink with flags): 26 tables x 100,000 rows x 64 dims (fp32, SUM), one feature per
table, 2,048 samples per rank per step, bags of 10..30 ids (mean 20), ids Zipf-like (p(k) ~ 1/(k+1)^a,
a=1.05) and scattered over the table by one fixed permutation per table. Each rank draws its own batches.

For each world size and each sharding type (applied to all tables), every rank runs forward +
``loss.backward()`` + ``torch.optim.SGD.step()`` on an ``EmbeddingBagCollection(sparse_grad=True)``
sharded with ``shard_modules``; one thread per process (``torch.set_num_threads(1)``). After ``--warmup``
steps, ``--steps`` steps are timed between two barriers: global samples/s = world x batch x steps / time.
Also reported: median-step samples/s = world x batch / median over steps of the slowest rank's step
time, which resists interference from other processes. The unsharded module runs the same step on one
process with the same per-rank batch. One group of processes per world size runs every type in turn.

Time breakdown (ms per step, mean over ranks), measured in the worker with ``time.perf_counter`` by
wrapping, on the sharded instance or in the library modules the pipeline looks them up from:
  * input dist  -- ``_start`` of the sharded module: id range check, bucketing, the header all-to-all (batch
    sizes, id counts) and the payload all-to-all (lengths, ids, weights)
  * lookup fwd  -- ``kernels.torch_pooled`` (the shard lookups, and the replica lookup for data_parallel)
  * out dist fwd/bwd -- the pooled output dist (``output_dist._PooledOutputDist``) forward and backward: the
    exchange of pooled rows and of their gradients, its waits and the placement into the output's columns
  * dp grad sync -- ``comm._sum_touched_rows`` (data-parallel gradient all-reduce of touched rows, backward)
  * bwd rest -- ``loss.backward()`` minus out dist bwd and dp grad sync: the lookup backward (sparse grads)
  * optimizer -- ``opt.zero_grad()`` + ``opt.step()``
Collective times include waiting for the slowest rank.

Usage:
    python benchmarks/bench_sharding.py                         # full workload, world sizes 2 and 4
    python benchmarks/bench_sharding.py --rows 20000 --steps 5  # smaller
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, kernels
from lightning_rec.pipeline import collectives as comm
from lightning_rec.pipeline import output_dist
from lightning_rec.sharding import (
    ShardingPlan,
    column_wise,
    data_parallel,
    fused_optimizer,
    grid_shard,
    row_wise,
    shard_modules,
    table_row_wise,
    table_wise,
)
from lightning_rec.testing import run_distributed

TYPES = ("data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "grid_shard")
PARTS = ("input_dist", "lookup_fwd", "out_dist_fwd", "out_dist_bwd", "dp_grad_sync", "bwd_rest", "optimizer")


# -- workload ---------------------------------------------------------------------------------------------
def make_tables(cfg: dict) -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(cfg["rows"], cfg["dim"], f"t{i}", [f"f{i}"]) for i in range(cfg["tables"])]


def make_batches(cfg: dict, seed: int) -> list[KeyedJaggedTensor]:
    """``cfg['distinct']`` batches of ``cfg['batch']`` samples; Zipf-like ids through a fixed permutation."""
    rows, n_tables, b = cfg["rows"], cfg["tables"], cfg["batch"]
    ranks = torch.arange(1, rows + 1, dtype=torch.float64)
    cdf = torch.cumsum(ranks.pow(-cfg["zipf"]), 0)
    cdf /= cdf[-1].clone()
    perm_gen = torch.Generator().manual_seed(1234)  # the same permutations on every rank and run
    perms = [torch.randperm(rows, generator=perm_gen) for _ in range(n_tables)]
    gen = torch.Generator().manual_seed(seed)
    lo, hi = max(1, cfg["ids"] // 2), cfg["ids"] + cfg["ids"] // 2
    out = []
    for _ in range(cfg["distinct"]):
        lengths = torch.randint(lo, hi + 1, (n_tables * b,), generator=gen)
        per_table = lengths.view(n_tables, b).sum(1).tolist()
        values = []
        for t, n in enumerate(per_table):
            k = torch.searchsorted(cdf, torch.rand(n, generator=gen, dtype=torch.float64)).clamp_(max=rows - 1)
            values.append(perms[t][k])
        out.append(KeyedJaggedTensor([f"f{i}" for i in range(n_tables)], torch.cat(values), lengths=lengths))
    return out


def make_plan(kind: str, cfg: dict, world: int) -> tuple[dict, int | None]:
    """Plan for all tables of one kind, and the local_size it needs (None: the default)."""
    n = cfg["tables"]
    if kind == "data_parallel":
        return {f"t{i}": data_parallel() for i in range(n)}, None
    if kind == "table_wise":
        return {f"t{i}": table_wise(i % world) for i in range(n)}, None
    if kind == "row_wise":
        return {f"t{i}": row_wise() for i in range(n)}, None
    if kind == "column_wise":  # 2 column shards on a pair of ranks, pairs round-robin
        return {f"t{i}": column_wise([(2 * i) % world, (2 * i + 1) % world]) for i in range(n)}, None
    if kind == "table_row_wise":  # hosts of 2 ranks, tables round-robin over hosts
        return {f"t{i}": table_row_wise(i % (world // 2)) for i in range(n)}, 2
    if kind == "grid_shard":  # 2 column shards, one per host of 2 ranks
        return {f"t{i}": grid_shard([0, 1]) for i in range(n)}, 2
    raise ValueError(kind)


def applicable(kind: str, world: int) -> str | None:
    """Why ``kind`` cannot run at ``world`` (None if it can)."""
    if kind in ("column_wise", "table_row_wise") and world < 2:
        return "needs 2 ranks"
    if kind == "grid_shard" and world < 4:
        return "needs 2 hosts of 2 ranks, world 4"
    if kind in ("table_row_wise", "grid_shard") and world % 2:
        return "needs an even world size"
    return None


# -- instrumentation ----------------------------------------------------------------------------------------
class Timers:
    def __init__(self) -> None:
        self.t: dict[str, float] = defaultdict(float)
        self.on = False
        self.phase = "fwd"
        self.in_input_dist = False

    def add(self, name: str, dt: float) -> None:
        if self.on:
            self.t[name] += dt

    @contextmanager
    def time(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)


TIMERS = Timers()  # the current run's timers (one process runs the sharding types one after the other)


def patch_library() -> None:
    """Time the lookups and the all-to-alls where the pipeline looks them up (once per process)."""
    if getattr(comm, "_bench_patched", False):
        return
    orig_pooled, orig_sum = kernels.torch_pooled, comm._sum_touched_rows
    place = output_dist._PooledOutputDist
    orig_fwd, orig_bwd = place.forward, place.backward

    def pooled(*a, **kw):
        with TIMERS.time("lookup_fwd"):
            return orig_pooled(*a, **kw)

    def out_fwd(*a, **kw):
        with TIMERS.time("out_dist_fwd"):
            return orig_fwd(*a, **kw)

    def out_bwd(*a, **kw):
        with TIMERS.time("out_dist_bwd"):
            return orig_bwd(*a, **kw)

    def sum_rows(*a, **kw):
        with TIMERS.time("dp_grad_sync"):
            return orig_sum(*a, **kw)

    kernels.torch_pooled, comm._sum_touched_rows = pooled, sum_rows
    place.forward, place.backward = staticmethod(out_fwd), staticmethod(out_bwd)  # type: ignore[method-assign]
    comm._bench_patched = True


def instrument(module) -> None:
    """Time the input dist of one sharded collection (instance attributes shadow the methods)."""
    for name in ("_start",):  # input checks, bucketing, the header and payload all-to-alls
        if not hasattr(module, name):
            continue
        orig = getattr(module, name)

        def wrapped(*a, _orig=orig, **kw):
            t0 = time.perf_counter()
            TIMERS.in_input_dist = True
            try:
                return _orig(*a, **kw)
            finally:
                TIMERS.in_input_dist = False
                TIMERS.add("input_dist", time.perf_counter() - t0)

        setattr(module, name, wrapped)


# -- one process --------------------------------------------------------------------------------------------
def run_one(rank: int, world: int, kind: str, cfg: dict, batches: list[KeyedJaggedTensor]) -> dict:
    global TIMERS
    torch.manual_seed(0)
    tables = make_tables(cfg)
    distributed = kind != "unsharded"
    if distributed:
        dist.barrier()
    t_setup = time.perf_counter()
    if kind == "unsharded":
        model = EmbeddingBagCollection(tables, sparse_grad=True)
    else:
        plan, local = make_plan(kind, cfg, world)
        # meta: no rank materialises the full tables; each allocates and initialises only what it holds
        ebc = EmbeddingBagCollection(tables, device="meta", sparse_grad=True)
        fused = {"kind": "sgd", "lr": 0.01} if cfg.get("fused") else None
        model = shard_modules(ebc, ShardingPlan({"": plan}), local_size=local, embedding_optimizer=fused)
    setup_s = time.perf_counter() - t_setup
    params = [p for p in model.parameters() if p.requires_grad]
    if kind != "unsharded" and cfg.get("fused"):
        # fbgemm EXACT_SGD inside backward; step() closes the step. Data-parallel tables look up the union
        # of every rank's batch (each replica applies the same update): world x the lookup, no gradient sync
        opt = fused_optimizer(model)
    else:
        opt = torch.optim.SGD(params, lr=0.01) if params else None  # a rank may hold no table (few tables)
    TIMERS = timers = Timers()
    patch_library()
    instrument(model)

    step_times: list[float] = []

    def step(kjt: KeyedJaggedTensor) -> None:
        t0 = time.perf_counter()
        timers.phase = "fwd"
        out = model(kjt).values()
        loss = out.square().mean()
        t1 = time.perf_counter()
        timers.phase = "bwd"
        bwd_before = timers.t["out_dist_bwd"] + timers.t["dp_grad_sync"]
        loss.backward()
        t2 = time.perf_counter()
        timers.add("bwd_rest", (t2 - t1) - (timers.t["out_dist_bwd"] + timers.t["dp_grad_sync"] - bwd_before))
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        timers.add("optimizer", t3 - t2)
        timers.add("fwd_total", t1 - t0)
        timers.add("step_total", t3 - t0)
        if timers.on:
            step_times.append(t3 - t0)

    for i in range(cfg["warmup"]):
        step(batches[i % len(batches)])
    if distributed:
        dist.barrier()
    timers.on = True
    t0 = time.perf_counter()
    for i in range(cfg["steps"]):
        step(batches[i % len(batches)])
    if distributed:
        dist.barrier()
    elapsed = time.perf_counter() - t0
    timers.on = False
    return {
        "elapsed": elapsed,
        "setup_s": setup_s,
        "step_times": step_times,
        "ms": {k: 1e3 * v / cfg["steps"] for k, v in timers.t.items()},
    }


def worker(rank: int, world: int, kinds: list[str], cfg: dict) -> dict:
    """Run each sharding type in turn in this process; ``{kind: result}``."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=r".*Sparse invariant checks are implicitly disabled.*")
    batches = make_batches(cfg, seed=1000 + rank)
    out = {}
    for kind in kinds:
        out[kind] = run_one(rank, world, kind, cfg, batches)
        gc.collect()
    return out


# -- driver --------------------------------------------------------------------------------------------------
def machine() -> str:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
        mem_s = f"{mem:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        mem_s = "RAM unknown"
    nproc = subprocess.run(["nproc"], capture_output=True, text=True, check=False).stdout.strip() or str(os.cpu_count())
    return (
        f"nproc={nproc}, CPU: {model}, {mem_s}; {platform.system()} {platform.release()}; "
        f"Python {platform.python_version()}, torch {torch.__version__}, gloo backend, 1 thread per process"
    )


def load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--types", nargs="+", default=list(TYPES), choices=TYPES)
    ap.add_argument("--tables", type=int, default=26)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2048, help="samples per rank per step")
    ap.add_argument("--ids", type=int, default=20, help="mean ids per bag (uniform in [ids/2, 3 ids/2])")
    ap.add_argument("--zipf", type=float, default=1.05)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--distinct", type=int, default=2, help="distinct batches per rank, cycled")
    ap.add_argument(
        "--fused",
        action="store_true",
        help="sharded tables update inside backward (fbgemm EXACT_SGD) instead of sparse-grad SGD",
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sharding.md"))
    args = ap.parse_args(argv)
    cfg = {
        k: getattr(args, k)
        for k in ("tables", "rows", "dim", "batch", "ids", "zipf", "steps", "warmup", "distinct", "fused")
    }
    timeout = 1800.0
    t_start = time.perf_counter()
    load0 = load()

    print("unsharded, 1 process ...", flush=True)
    base = run_distributed(worker, 1, ["unsharded"], cfg, timeout_s=timeout)[0]["unsharded"]
    base_sps = cfg["batch"] * cfg["steps"] / base["elapsed"]
    base_med = cfg["batch"] / statistics.median(base["step_times"])
    print(f"  {base_sps:,.0f} samples/s", flush=True)

    rows = []
    for world in args.world_sizes:
        kinds = [k for k in args.types if applicable(k, world) is None]
        print(f"world {world}: {', '.join(kinds)} ...", flush=True)
        res = run_distributed(worker, world, kinds, cfg, timeout_s=timeout) if kinds else []
        for kind in args.types:
            why = applicable(kind, world)
            if why:
                rows.append((world, kind, None, why))
                continue
            per_rank = [r[kind] for r in res]
            elapsed = max(r["elapsed"] for r in per_rank)
            sps = world * cfg["batch"] * cfg["steps"] / elapsed
            # a step of the group lasts as long as its slowest rank; median over steps resists interference
            med = world * cfg["batch"] / statistics.median(max(ts) for ts in zip(*(r["step_times"] for r in per_rank)))
            ms = {k: sum(r["ms"].get(k, 0.0) for r in per_rank) / world for k in PARTS + ("fwd_total", "step_total")}
            rows.append(
                (world, kind, {"sps": sps, "med": med, "ms": ms, "setup": max(r["setup_s"] for r in per_rank)}, None)
            )
            print(
                f"  {kind}: {sps:,.0f} samples/s global ({sps / base_sps:.2f}x unsharded), "
                f"setup {max(r['setup_s'] for r in per_rank):.1f} s",
                flush=True,
            )
    total_s = time.perf_counter() - t_start

    lines = [
        "# Sharded training throughput (gloo, CPU)",
        "",
        f"Machine: {machine()}.",
        "",
        (
            f"Workload: {cfg['tables']} tables x {cfg['rows']:,} rows x {cfg['dim']} dims (fp32, SUM, one feature each), "
            f"{cfg['batch']:,} samples per rank per step, bags of {max(1, cfg['ids'] // 2)}..{cfg['ids'] + cfg['ids'] // 2} "
            f"ids (mean ~{cfg['ids']}), Zipf-like ids (a={cfg['zipf']}) through a fixed per-table permutation; "
            f"`EmbeddingBagCollection(sparse_grad=True)`, forward + backward (loss = mean of squared outputs) + "
            f"`torch.optim.SGD` step; {cfg['warmup']} warm-up steps, then {cfg['steps']} timed steps between barriers."
        ),
        "",
        (
            f"Unsharded reference (`EmbeddingBagCollection`, 1 process, same per-rank batch): "
            f"**{base_sps:,.0f} samples/s** (median step: {base_med:,.0f}); {base['ms']['step_total']:.0f} ms/step = "
            f"lookup fwd {base['ms'].get('lookup_fwd', 0):.0f} + backward {base['ms'].get('bwd_rest', 0):.0f} + "
            f"optimizer {base['ms'].get('optimizer', 0):.0f} ms + rest."
        ),
        "",
        (
            "Plans (all tables the same type): table_wise round-robin over ranks; row_wise even blocks over all ranks; "
            "column_wise 2 column shards on ranks (2i, 2i+1) mod world; table_row_wise local_size=2, tables "
            "round-robin over hosts; grid_shard local_size=2, 2 column shards on hosts 0 and 1 (world 4 only)."
        ),
        "",
    ]
    if cfg["fused"]:
        lines += [
            (
                "Fused (`--fused`): every sharded table, data-parallel ones included, updates inside backward "
                "(fbgemm EXACT_SGD, `embedding_optimizer=`) instead of sparse-grad SGD; the kernel's lookup is not "
                "timed separately (it is in `step ms`), and `optimizer` is only the step bookkeeping. Data-parallel "
                "tables look up the union of all ranks' batches (world x the lookup, an all-gather of ids and of "
                "pooled gradients) so that every replica applies the same update; there is no gradient sync."
            ),
            "",
        ]
    lines += [
        (
            "| world | sharding | global samples/s | vs unsharded | median-step samples/s | vs unsharded (median) "
            "| step ms | input dist | lookup fwd | out dist fwd | out dist bwd | dp grad sync | bwd rest | optimizer |"
        ),
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for world, kind, r, why in rows:
        if r is None:
            lines.append(f"| {world} | {kind} | n/a ({why}) |" + " |" * 11)
            continue
        ms = r["ms"]
        cells = " | ".join(f"{ms[p]:.0f}" for p in PARTS)
        lines.append(
            f"| {world} | {kind} | {r['sps']:,.0f} | {r['sps'] / base_sps:.2f}x | {r['med']:,.0f} | "
            f"{r['med'] / base_med:.2f}x | {ms['step_total']:.0f} | {cells} |"
        )
    nproc = os.cpu_count() or 1
    lines += [
        "",
        (
            "`global samples/s` = world x batch x timed steps / wall time between the barriers; `vs unsharded` = that / "
            "the unsharded single-process samples/s. `median-step` = world x batch / the median over steps of the slowest "
            "rank's step time (less sensitive to interference from other processes). `step ms` and the columns after it "
            "are ms per step, mean over ranks."
        ),
        "",
        (
            "How the breakdown is measured: `time.perf_counter` around wrapped calls in each worker: "
            "input dist = `_start` of the sharded module (id range check, bucketing, the header and payload "
            "all-to-alls); lookup fwd = `kernels.torch_pooled`; out dist fwd / bwd = the pooled output dist "
            "(`output_dist._PooledOutputDist`) forward and backward (the exchange, its waits, the placement); "
            "dp grad sync = `comm._sum_touched_rows` (data-parallel gradient all-reduce of touched rows); "
            "bwd rest = `loss.backward()` minus out dist bwd and dp grad sync (mostly the sparse lookup backward); "
            "optimizer = `SGD.step()` + `zero_grad()`. Collective times include waiting for the slowest rank."
        ),
        "",
        (
            "Noise gauge: at world 2, table_row_wise (one host of 2 ranks) has exactly the layout of row_wise, so the gap "
            "between those two rows is run-to-run noise (other processes share this machine; see the load average)."
        ),
        "",
        f"Caveat: this machine has {nproc} cores; a world of 4 runs 4 single-threaded processes on them, so ranks "
        "time-share cores and the world-4 numbers measure oversubscription, not scaling."
        if nproc < 4
        else "",
        "",
        f"Load average (1/5/15 min) at start: {load0}; at end: {load()}.",
        "",
        (
            f"Command: `{' '.join(['python benchmarks/bench_sharding.py'] + (sys.argv[1:] if argv is None else argv))}` "
            f"({total_s:.0f} s in all)."
        ),
    ]
    text = "\n".join(lines).rstrip() + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print()
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
