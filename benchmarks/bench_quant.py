"""Quantized CPU lookups side by side in one run: the fp32 model, int8 / int4 through each path, and TorchRec's
quantized EmbeddingBagCollection on the same tables and ids.

Job: ``--tables`` tables (default 26, DLRM-like) of ``--rows`` x ``--dim`` (20,000 x 64), one feature each, SUM,
``--batch`` bags (512) of 1-3 ids, one thread. lightning_rec paths: the fp32 ``EmbeddingBagCollection``; quantized
``kernel="auto"`` (the row-wise kernels on CPU), ``"fbgemm"`` (fbgemm's inference kernel), ``"torch"`` (dequantize
in aten ops), and ``"auto"`` over rows of the previous default layout (``row_alignment=16``). TorchRec 1.9.2 runs
in a subprocess with the side environment's site-packages on PYTHONPATH (``benchmarks/.side_env/torchrec-1.9.2``,
see bench_vs_torchrec.py), on the same float weights (saved to a file) and ids; its output is checked against ours.
Median over ``--iters`` forwards (``torch.inference_mode``), after warmup; the rounds alternate the contenders so a
slow phase of the machine hits them all.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_quant.py [--out benchmarks/results/quant.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SIDE = ROOT / "benchmarks" / ".side_env" / "torchrec-1.9.2"

_TORCHREC = r"""
import json, sys, time, statistics, torch
torch.set_num_threads(1)
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.inference.modules import quantize_embeddings
data = torch.load(sys.argv[1])
iters, rounds = int(sys.argv[2]), int(sys.argv[3])
W = data["weights"]
cfg = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=w.shape[0], embedding_dim=w.shape[1], feature_names=[f"f{i}"])
       for i, w in enumerate(W)]
ebc = EmbeddingBagCollection(tables=cfg, device=torch.device("cpu"))
with torch.no_grad():
    for i, w in enumerate(W):
        ebc.embedding_bags[f"t{i}"].weight.copy_(w)
class M(torch.nn.Module):
    def __init__(self): super().__init__(); self.ebc = ebc
    def forward(self, kjt): return self.ebc(kjt)
out = {}
for name, dt in [("int8", torch.qint8), ("int4", torch.quint4x2)]:
    q = quantize_embeddings(M(), dtype=dt, inplace=False)
    kjt = KeyedJaggedTensor(keys=[f"f{i}" for i in range(len(W))], values=data["values"], lengths=data["lengths"])
    times = []
    with torch.inference_mode():
        res = q(kjt).values()
        for _ in range(10): q(kjt)
        for _ in range(rounds):
            for _ in range(iters):
                t0 = time.perf_counter(); q(kjt); times.append(time.perf_counter() - t0)
    out[name] = {"ms": statistics.median(times) * 1e3, "out": res.flatten()[:4096].tolist()}
print(json.dumps(out))
"""


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tables", type=int, default=26)
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-torchrec", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "quant.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, quantize_embeddings

    T, R, D, B = args.tables, args.rows, args.dim, args.batch
    cfg = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=R, embedding_dim=D, feature_names=[f"f{i}"]) for i in range(T)
    ]
    ebc = EmbeddingBagCollection(cfg).eval()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 4, (T * B,), generator=g)
    values = torch.randint(0, R, (int(lengths.sum()),), generator=g)
    kjt = KeyedJaggedTensor([f"f{i}" for i in range(T)], values, lengths=lengths)
    models = {"fp32 (EmbeddingBagCollection)": ebc}
    for dt, label in [(torch.qint8, "int8"), (torch.quint4x2, "int4")]:
        for kernel, what in [("auto", "row-wise, auto"), ("fbgemm", "fbgemm inference"), ("torch", "torch dequant")]:
            models[f"{label} {what}"] = quantize_embeddings(ebc, dt, inplace=False, kernel=kernel)
        # the previous default layout (16-byte rows), against the compact default above
        models[f"{label} row-wise, auto, align 16"] = quantize_embeddings(ebc, dt, inplace=False, row_alignment=16)
    times: dict[str, list[float]] = {k: [] for k in models}
    with torch.inference_mode():
        outs = {k: m(kjt).values() for k, m in models.items()}
        for _ in range(args.rounds):
            for k, m in models.items():
                for _ in range(5):
                    m(kjt)
                for _ in range(args.iters):
                    t0 = time.perf_counter()
                    m(kjt)
                    times[k].append(time.perf_counter() - t0)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    for label in ("int8", "int4"):
        ref = outs[f"{label} torch dequant"]
        for what in ("row-wise, auto", "fbgemm inference", "row-wise, auto, align 16"):
            err = float((outs[f"{label} {what}"] - ref).abs().max())
            assert err < 1e-4, (label, what, err)
    tr: dict[str, dict] = {}
    if not args.no_torchrec and SIDE.is_dir():
        site = next(SIDE.glob("lib/python*/site-packages"))
        with tempfile.TemporaryDirectory() as tmp:
            f = Path(tmp) / "job.pt"
            weights = [ebc.embedding_bags[f"t{i}"].weight.detach() for i in range(T)]
            torch.save({"weights": weights, "values": values, "lengths": lengths}, f)
            env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
            run = subprocess.run(
                [sys.executable, "-c", _TORCHREC, str(f), str(args.iters), str(args.rounds)],
                capture_output=True,
                text=True,
                env=env,
                check=False,
                cwd=tempfile.gettempdir(),
            )
            if run.returncode:
                print(run.stderr[-3000:])
            else:
                tr = json.loads(run.stdout.strip().splitlines()[-1])
        for label in tr:
            ours = outs[f"{label} torch dequant"].flatten()[:4096]
            tr[label]["max_diff_vs_ours"] = float((torch.tensor(tr[label]["out"]) - ours).abs().max())
            ms[f"{label} TorchRec 1.9.2 quant EBC"] = tr[label]["ms"]
    fp32 = ms["fp32 (EmbeddingBagCollection)"]
    lines = [
        "# Quantized CPU lookups",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} with `PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_quant.py` -- "
        f"{machine()}, one thread, shared machine (other jobs running: medians of {args.rounds} x {args.iters}).",
        "",
        f"Job: {T} tables of {R:,} x {D}, one feature each, SUM, batch {B}, bags of 1-3 ids "
        f"({values.numel():,} ids). Full forward of the collection (KJT in, KeyedTensor out).",
        "",
        "| model / path | ms per batch | samples/s | vs fp32 |",
        "| --- | ---: | ---: | ---: |",
    ]
    for k, v in ms.items():
        lines.append(f"| {k} | {v:.3f} | {B / v * 1e3:,.0f} | {fp32 / v:.2f}x |")
    for label in ("int8", "int4"):
        key = f"{label} TorchRec 1.9.2 quant EBC"
        if key in ms:
            lines.append("")
            lines.append(
                f"{label}: row-wise {ms[key] / ms[f'{label} row-wise, auto']:.1f}x TorchRec's quantized EBC; TorchRec's "
                f"output against ours (same weights, its own quantizer): max abs diff {tr[label]['max_diff_vs_ours']:.3g}."
            )
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
