r"""A newcomer's walk of one training step, counted: which ``lightning_rec`` files run, and the hops between them.

Two gloo processes on CPU train a small model whose collection has one data-parallel, one row-wise and one
table-wise table, every table updated by a fused optimizer in backward, and a dense head stepped by SGD. After
one untraced warm-up step, a second step runs under ``sys.setprofile``; every Python call whose code lives in
the ``lightning_rec`` package that was imported is recorded, by phase:

- ``setup``: sharding the model (``DistributedModelParallel(...)``; under Lightning: the strategy's setup);
- ``forward``: the model's forward and the loss;
- ``backward``: ``loss.backward()``, the fused update included (it runs inside backward);
- ``optimizer``: the dense optimizer's step and the fused optimizer's ``step()``.

Per phase it reports the distinct files executed and the hops: distinct (caller file -> callee file) edges
between two different ``lightning_rec`` files, the caller being the nearest ``lightning_rec`` frame above the
call (torch and Lightning frames in between are skipped; a call with none above it is an entry, not a hop).
The same figures restricted to the spine leave out the generic helpers (``HELPERS``): there the caller is the
nearest frame of a spine file. Both ranks' sets are joined.

The *library hops* count only calls from one package file into another through torch and the standard library:
the search for the caller stops at any other frame (Lightning's loops, the user's model, this script, or the
process harness that runs it, ``lightning_rec.testing``), which makes the call an entry. The plain hops count,
for example, ``testing.py -> model_parallel.py`` for the script's own ``DistributedModelParallel(...)`` (its worker
runs under ``run_distributed``), a launcher wrapper -> every strategy hook Lightning calls, and the optimizer's
``step`` -> ``training_step`` (Lightning runs the step inside the optimizer's closure).

It runs against any checkout of the package: put the checkout first on ``PYTHONPATH``. Only public imports
are used, so the same script counts the code of an older commit:

    git worktree add /tmp/walk_old 29631f8
    for fe in dmp trainer; do
      PYTHONPATH=/tmp/walk_old .venv/bin/python benchmarks/walk_one_step.py --front-end $fe \
        --label "filed (29631f8)" --json /tmp/walk/old_$fe.json
      PYTHONPATH=$PWD .venv/bin/python benchmarks/walk_one_step.py --front-end $fe \
        --label "now" --json /tmp/walk/now_$fe.json
    done
    git worktree remove /tmp/walk_old
    .venv/bin/python benchmarks/walk_one_step.py --md benchmarks/results/walk_one_step.md \
      --compare /tmp/walk/old_dmp.json /tmp/walk/now_dmp.json /tmp/walk/old_trainer.json /tmp/walk/now_trainer.json

``--front-end trainer`` walks the same step through ``Trainer(strategy=RecShardedStrategy(...))`` instead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from collections import defaultdict
from pathlib import Path
from types import FrameType
from typing import Any

import torch

PHASES = ("setup", "forward", "backward", "optimizer")
STEP_PHASES = PHASES[1:]

# Generic helpers left out of the spine: sparse types, version shims, the host-sync counter, the byte
# accounting, table configs and the process memory policy. A path matches by prefix, relative to the package.
HELPERS = (
    "sparse/",
    "_compat/",
    "_compat.py",
    "host_syncs.py",
    "transport/accounting.py",
    "configs.py",
    "memory/",
    "memory.py",
)

TABLES = (("t_dp", 40), ("t_rw", 60), ("t_tw", 50))
DIM = 8
BATCH = 6


def is_helper(rel: str) -> bool:
    return rel.startswith(HELPERS)


class Walk:
    """Records, per phase, the package's files that run and the caller -> callee edges between them."""

    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root) + os.sep
        self.phase: str | None = None
        self._rel: dict[str, str | None] = {}
        self.files: dict[str, set[str]] = defaultdict(set)
        self.edges: dict[str, set[tuple[str, str]]] = defaultdict(set)
        self.spine_edges: dict[str, set[tuple[str, str]]] = defaultdict(set)
        self.lib_edges: dict[str, set[tuple[str, str]]] = defaultdict(set)
        # frames a library call may pass through: torch's and the standard library's
        self._through = tuple(
            os.path.realpath(p) + os.sep for p in (os.path.dirname(torch.__file__), os.path.dirname(os.__file__))
        )
        self.entries: dict[str, set[str]] = defaultdict(set)

    def rel(self, filename: str) -> str | None:
        if filename not in self._rel:
            path = os.path.realpath(filename)
            self._rel[filename] = path[len(self.root) :] if path.startswith(self.root) else None
        return self._rel[filename]

    def _caller(self, frame: FrameType | None, spine: bool) -> str | None:
        while frame is not None:
            rel = self.rel(frame.f_code.co_filename)
            if rel is not None and not (spine and is_helper(rel)):
                return rel
            frame = frame.f_back
        return None

    def _library_caller(self, frame: FrameType | None) -> str | None:
        while frame is not None:
            rel = self.rel(frame.f_code.co_filename)
            if rel is not None:
                return rel
            path = os.path.realpath(frame.f_code.co_filename)
            if not path.startswith(self._through) and not frame.f_code.co_filename.startswith("<"):
                return None
            frame = frame.f_back
        return None

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or self.phase is None:
            return
        callee = self.rel(frame.f_code.co_filename)
        if callee is None:
            return
        phase = self.phase
        self.files[phase].add(callee)
        caller = self._caller(frame.f_back, spine=False)
        if caller is None:
            self.entries[phase].add(callee)
        elif caller != callee:
            self.edges[phase].add((caller, callee))
            lib_caller = self._library_caller(frame.f_back)
            if lib_caller is not None and lib_caller != callee:
                self.lib_edges[phase].add((lib_caller, callee))
        if not is_helper(callee):
            spine_caller = self._caller(frame.f_back, spine=True)
            if spine_caller is not None and spine_caller != callee:
                self.spine_edges[phase].add((spine_caller, callee))

    def start(self, phase: str) -> None:
        self.phase = phase
        sys.setprofile(self.profile)
        threading.setprofile(self.profile)

    def stop(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        self.phase = None

    def result(self) -> dict[str, Any]:
        return {
            p: {
                "files": sorted(self.files[p]),
                "edges": sorted(self.edges[p]),
                "spine_edges": sorted(self.spine_edges[p]),
                "lib_edges": sorted(self.lib_edges[p]),
                "entries": sorted(self.entries[p]),
            }
            for p in PHASES
        }


def _tables() -> list[Any]:
    from lightning_rec import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(name=n, num_embeddings=rows, embedding_dim=DIM, feature_names=[f"f_{n[2:]}"])
        for n, rows in TABLES
    ]


def _plan(path: str) -> Any:
    from lightning_rec.sharding import ShardingPlan, data_parallel, row_wise, table_wise

    return ShardingPlan({path: {"t_dp": data_parallel(), "t_rw": row_wise(), "t_tw": table_wise(rank=1)}})


def _batch(rank: int, step: int) -> tuple[Any, torch.Tensor]:
    from lightning_rec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(100 * rank + step)
    keys = [f"f_{n[2:]}" for n, _ in TABLES]
    lengths = torch.randint(1, 4, (len(keys) * BATCH,), generator=g)
    values = torch.cat(
        [
            torch.randint(0, rows, (int(lengths[i * BATCH : (i + 1) * BATCH].sum()),), generator=g)
            for i, (_, rows) in enumerate(TABLES)
        ]
    )
    return KeyedJaggedTensor.from_lengths_sync(keys, values, lengths), torch.rand(BATCH, 1, generator=g)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        from lightning_rec import EmbeddingBagCollection

        super().__init__()
        torch.manual_seed(0)
        self.ebc = EmbeddingBagCollection(_tables())
        self.head = torch.nn.Linear(DIM * len(TABLES), 1)

    def forward(self, kjt: Any) -> torch.Tensor:
        return self.head(self.ebc(kjt).values())


def _package_root() -> str:
    import lightning_rec

    return os.path.dirname(lightning_rec.__file__)


def _dmp_worker(rank: int, world: int) -> dict[str, Any]:
    from lightning_rec.distributed import (
        DistributedModelParallel,
        RowWiseAdagrad,
        apply_optimizer_in_backward,
        in_backward_optimizer_filter,
    )

    torch.set_num_threads(1)
    walk = Walk(_package_root())
    model = _Model()
    apply_optimizer_in_backward(RowWiseAdagrad, model.ebc.parameters(), {"lr": 0.1})
    walk.start("setup")
    dmp = DistributedModelParallel(model, plan=_plan("ebc"))
    walk.stop()
    dense = torch.optim.SGD([p for _, p in in_backward_optimizer_filter(dmp.named_parameters())], lr=0.1)
    assert dmp.fused_optimizer is not None
    for step in range(2):
        traced = step == 1  # step 0 warms up: lazily built state is not the step's walk
        kjt, y = _batch(rank, step)
        if traced:
            walk.start("forward")
        loss = torch.nn.functional.mse_loss(dmp(kjt), y)
        if traced:
            walk.start("backward")
        loss.backward()
        if traced:
            walk.start("optimizer")
        dense.step()
        dmp.fused_optimizer.step()
        dense.zero_grad()
        walk.stop()
    return walk.result()


def _trainer_worker(rank: int, world: int) -> dict[str, Any]:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_rec import RecModule, RecShardedStrategy

    torch.set_num_threads(1)
    walk = Walk(_package_root())

    class Module(RecModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = _Model()

        def configure_sharding(self) -> Any:
            return _plan("model.ebc")

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            kjt, y = batch
            return torch.nn.functional.mse_loss(self.model(kjt), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.model.head.parameters(), lr=0.1)

    class Phases(L.Callback):  # type: ignore[misc]
        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            walk.start("setup")

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            walk.stop()

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 1:
                walk.start("forward")

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
            if walk.phase is not None:
                walk.start("backward")

        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            if walk.phase is not None:
                walk.start("optimizer")

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            walk.stop()

    batches = [_batch(rank, step) for step in range(2)]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=RecShardedStrategy(embedding_optimizer={"kind": "rowwise_adagrad", "lr": 0.1}),
        max_steps=2,
        callbacks=[Phases()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    trainer.fit(Module(), DataLoader(batches, batch_size=None))
    walk.stop()
    return walk.result()


def _join(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    joined: dict[str, Any] = {}
    for p in PHASES:
        joined[p] = {
            key: sorted({tuple(x) if isinstance(x, list) else x for r in per_rank for x in r[p][key]})
            for key in per_rank[0][p]
        }
    return joined


def _figures(phases: dict[str, Any], names: tuple[str, ...]) -> dict[str, int]:
    files = {f for p in names for f in phases[p]["files"]}
    edges = {tuple(e) for p in names for e in phases[p]["edges"]}
    spine_edges = {tuple(e) for p in names for e in phases[p]["spine_edges"]}
    lib_edges = {tuple(e) for p in names for e in phases[p].get("lib_edges", [])}
    return {
        "files": len(files),
        "hops": len(edges),
        "library hops": len(lib_edges),
        "spine files": len([f for f in files if not is_helper(f)]),
        "spine hops": len(spine_edges),
    }


def run(front_end: str) -> dict[str, Any]:
    from lightning_rec.testing import run_distributed

    worker = _dmp_worker if front_end == "dmp" else _trainer_worker
    per_rank = run_distributed(worker, 2, timeout_s=600)
    return _join(per_rank)


def _commit(root: str) -> str:
    try:
        return subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


ROWS = (
    ("setup", ("setup",)),
    ("forward", ("forward",)),
    ("backward", ("backward",)),
    ("optimizer", ("optimizer",)),
    ("step (fwd+bwd+opt)", STEP_PHASES),
    ("walk (setup+step)", PHASES),
)


def markdown(runs: list[dict[str, Any]]) -> str:
    commands = __doc__.split("    git worktree add", 1)[1].split("\n\n", 1)[0]
    lines = [
        "# One training step, walked: files and hops (`benchmarks/walk_one_step.py`)",
        "",
        __doc__.split("\n\n", 1)[1].split("\n\nIt runs against", 1)[0],
        "",
        f"Helpers left out of the spine: {', '.join(f'`{h}`' for h in HELPERS)}.",
        "",
        "Commands:",
        "",
        "```",
        "git worktree add" + commands.replace("\n    ", "\n").rstrip(),
        "```",
        "",
    ]
    for front_end in sorted({r["front_end"] for r in runs}):
        chosen = [r for r in runs if r["front_end"] == front_end]
        lines += [
            f"### Front end: {front_end}",
            "",
            "| phase | "
            + " | ".join(f"{r['label']} files / hops" for r in chosen)
            + " | "
            + " | ".join(f"{r['label']} spine files / hops" for r in chosen)
            + " | "
            + " | ".join(f"{r['label']} library hops" for r in chosen)
            + " |",
            "| --- |" + " --- |" * (3 * len(chosen)),
        ]
        for name, phases in ROWS:
            figs = [_figures(r["phases"], phases) for r in chosen]
            lines.append(
                f"| {name} | "
                + " | ".join(f"{f['files']} / {f['hops']}" for f in figs)
                + " | "
                + " | ".join(f"{f['spine files']} / {f['spine hops']}" for f in figs)
                + " | "
                + " | ".join(str(f["library hops"]) for f in figs)
                + " |"
            )
        lines.append("")
        for r in chosen:
            files = sorted({f for p in PHASES for f in r["phases"][p]["files"]})
            lines.append(f"Files of the walk, {r['label']}, spine files in bold:")
            lines.append("")
            lines.append(", ".join(f"`{f}`" if is_helper(f) else f"**`{f}`**" for f in files))
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--front-end", choices=("dmp", "trainer"), default="dmp")
    ap.add_argument("--label", default="now")
    ap.add_argument("--json", type=Path, help="write this run's figures and sets here")
    ap.add_argument("--compare", type=Path, nargs="+", help="JSON files of earlier runs: print them side by side")
    ap.add_argument("--md", type=Path, help="with --compare: write the table here")
    args = ap.parse_args(argv)
    if args.compare:
        text = markdown([json.loads(p.read_text()) for p in args.compare])
        if args.md:
            args.md.write_text(text + "\n")
        print(text)
        return 0
    root = _package_root()
    result = {"label": args.label, "commit": _commit(root), "front_end": args.front_end, "root": root}
    result["phases"] = run(args.front_end)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    print(f"{args.label} ({result['commit']}, {root}), front end {args.front_end}")
    for name, phases in ROWS:
        print(f"  {name:20s} {_figures(result['phases'], phases)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
