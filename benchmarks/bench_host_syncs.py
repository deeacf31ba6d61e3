"""Host syncs per training step (what would make a CUDA host wait for its device), counted on CPU.

2 gloo processes; one collection whose tables all use one sharding type (pooled ``EmbeddingBagCollection``
or sequence ``EmbeddingCollection``), fused SGD or torch SGD, the plain loop or ``TrainPipelineSparseDist``;
the third step is counted with :class:`lightning_rec.host_syncs.HostSyncCounter` (forward, backward and both
optimizers' steps), the most over the ranks. ``--where`` also lists the library lines that issued them.

    python benchmarks/bench_host_syncs.py [--where] [--out benchmarks/results/host_syncs.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_rec.testing import run_distributed  # noqa: E402
from tests.distributed.host_sync_cases import all_counts, main_job_counts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--where", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = run_distributed(all_counts, 2, args.where, timeout_s=600)
    lines = [
        "| collection | sharding | optimizer | pipeline | host syncs per step (max over 2 ranks) | by op (rank 0) |",
        "| --- | --- | --- | --- | ---: | --- |",
    ]
    sites: dict[str, int] = {}
    for i, (config, (_, ops0, sites0)) in enumerate(results[0]):
        pooled, kind, fused, pipelined = config
        total = max(r[i][1][0] for r in results)
        ops = ", ".join(f"{k} {v}" for k, v in sorted(ops0.items()))
        lines.append(
            f"| {'pooled' if pooled else 'sequence'} | {kind} | {'fused sgd' if fused else 'torch sgd'} | "
            f"{'on' if pipelined else 'off'} | {total} | {ops} |"
        )
        for k, v in sites0.items():
            sites[k] = max(sites.get(k, 0), v)
    for fused in (False, True):
        job = run_distributed(main_job_counts, 2, fused, init_process_group=False, timeout_s=600)
        lines.append("")
        lines.append(
            f"The main job's model (DLRM, Trainer + rec_sharded, mixed plan, {'fused Adagrad' if fused else 'torch Adagrad'}"
            f" tables), one training step: {max(r['total'] for r in job)} host syncs (most over 2 ranks; rank 0 by op: "
            + ", ".join(f"{k} {v}" for k, v in sorted(job[0]["by_op"].items()))
            + ")"
        )
        for site, n in sorted(job[0]["by_site"].items(), key=lambda kv: -kv[1]):
            lines.append(f"- {site}: {n}")
    text = "\n".join(lines)
    if args.where:
        text += "\n\nWhere (rank 0, most per step in any configuration):\n\n" + "\n".join(
            f"- {k}: {v}" for k, v in sorted(sites.items(), key=lambda kv: -kv[1])
        )
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
