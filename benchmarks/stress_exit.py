"""Short 2-process jobs in a row, alternating the flows users end a script with: every rank of every run must
exit 0 with nothing on stderr about an abort (``terminate called ...``). Not part of ``make test``:
``python benchmarks/stress_exit.py --runs 100`` (``--load`` keeps a third process busy meanwhile).

Flows: ``fit``; ``fit_save`` (fit + ``trainer.save_checkpoint`` of a checkpoint directory); ``fit_eval`` (fit +
validate + test + predict); ``fit_state`` (fit + ``full_state_dict``); ``fabric_save`` (a Fabric loop + ``fabric.save``).
Runs alternate two launches: ``external`` starts every rank itself (as torchrun does), so each rank's exit code
and stderr are read; ``lightning`` lets Lightning's launcher start rank 1 from rank 0, as ``python script.py``
does, and reads the launching process's exit code, which must report a child rank that failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.lightning.exit_flows import FLOWS, aborted, run_once  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--flows", default=",".join(FLOWS))
    parser.add_argument("--load", action="store_true", help="keep one core busy with another process meanwhile")
    args = parser.parse_args()
    flows = args.flows.split(",")
    load = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.load else None
    bad: list[str] = []
    counts: dict[str, list[int]] = {}
    t0 = time.monotonic()
    try:
        for i in range(args.runs):
            flow, launch = flows[i % len(flows)], ("external", "lightning")[(i // len(flows)) % 2]
            with tempfile.TemporaryDirectory() as out:
                codes, errs = run_once(flow, launch, out)
            ok = all(c == 0 for c in codes) and not any(aborted(e) for e in errs)
            tally = counts.setdefault(f"{flow} ({launch})", [0, 0])
            tally[0] += 1
            tally[1] += ok
            if ok:
                print(f"run {i} {flow} ({launch}): ok ({time.monotonic() - t0:.0f} s)", flush=True)
            else:
                tails = "\n".join(f"[process {r}, exit {c}]\n{e[-1500:]}" for r, (c, e) in enumerate(zip(codes, errs)))
                bad.append(f"run {i} {flow} ({launch}): exits {codes}")
                print(f"run {i} {flow} ({launch}): FAILED, exits {codes}\n{tails}", flush=True)
    finally:
        if load is not None:
            load.kill()
    print("| flow (launch) | runs | clean |\n| --- | ---: | ---: |")
    for name, (n, ok) in counts.items():
        print(f"| {name} | {n} | {ok} |")
    print(
        f"{args.runs - len(bad)} of {args.runs} runs exited 0 on every process with no abort "
        f"({time.monotonic() - t0:.0f} s)"
    )
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
