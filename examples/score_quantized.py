"""Batch scoring with a quantized DLRM's ``torch.export`` program: click logs in, one click probability per row out.

The program (a ``.pt2`` file, from ``lightning_rec.export.export_program(model, path, quantize="int8")`` or
``lightning-rec export CKPT_DIR --quantize int8 --program -o dlrm_int8.pt2``) is served by torch alone; this script
uses lightning_rec only to read the logs (the library's synthetic, Criteo TSV / npy / Parquet readers, hashing ids
into the program's table sizes) and, without ``--program``, to train and export a small model first::

    python examples/score_quantized.py                                   # train, export int8, score synthetic rows
    python examples/score_quantized.py --program runs/dlrm_int8.pt2 --source criteo_tsv --path day_23 \\
        --output scores.txt                                              # one score per line (.npy: a numpy array)

Scores are written in the order of the rows read (for Criteo files: file order); the AUC against the logs' labels
is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from rich.progress import track

RUN_DIR = Path("runs/score_quantized")
SIGNATURE_FILE = "lightning_rec_signature.json"  # lightning_rec.export.SIGNATURE_FILE: keys, num_dense, rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--program", type=Path, help="the .pt2 program (default: train and export a small DLRM first)")
    ap.add_argument("--quantize", default="int8", choices=["int8", "int4", "int2", "fp16"], help="when training here")
    ap.add_argument(
        "--source", default="synthetic", choices=["synthetic", "criteo_tsv", "criteo_npy", "criteo_parquet"]
    )
    ap.add_argument("--path", help="the Criteo file or directory (the criteo_* sources)")
    ap.add_argument("--rows", type=int, default=65536, help="rows to score (Criteo: at most this many; 0: all)")
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--output", type=Path, default=RUN_DIR / "scores.npy", help=".npy, or text: one score a line")
    args = ap.parse_args(argv)
    if args.source != "synthetic" and not args.path:
        ap.error(f"--source {args.source} needs --path (the Criteo data)")
    if args.source == "synthetic" and args.rows <= 0:
        ap.error("--source synthetic needs --rows > 0")
    return args


def train_and_export(quantize: str, path: Path) -> Path:
    """A small DLRM trained for one pass over synthetic clicks in this process, exported with quantized tables."""
    import lightning as L  # only needed without --program

    from lightning_rec.data import ClickDataModule
    from lightning_rec.export import export_program
    from lightning_rec.models import DLRM

    L.seed_everything(0, verbose=False)
    torch.sparse.check_sparse_tensor_invariants.disable()  # as examples/dlrm.py: Adagrad's sparse gradients
    data = ClickDataModule(batch_size=1024, train_rows=32768, val_rows=0, test_rows=0)
    model = DLRM(
        num_dense=data.num_dense,
        feature_names=data.feature_names,
        num_embeddings_per_feature=data.cardinalities,
        embedding_dim=16,
        over_arch_layer_sizes=[32, 1],
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=data)
    return export_program(model, path, quantize=quantize)


def click_logs(args: argparse.Namespace, keys: list[str], rows: dict[str, int]):
    """The library's reader of ``args.source``, ids hashed into the program's table sizes."""
    from lightning_rec import data

    if keys != data.FEATURE_NAMES:
        raise ValueError(f"the program reads features {keys}; the click-log readers give {data.FEATURE_NAMES}")
    cards = [rows[k] for k in keys]
    if args.source == "synthetic":
        return data.SyntheticClicks(args.rows, args.batch_size, cardinalities=cards, split="test")
    reader = {"criteo_tsv": data.CriteoTSV, "criteo_npy": data.CriteoNpy, "criteo_parquet": data.CriteoParquet}
    return reader[args.source](args.path, args.batch_size, cards, num_rows=args.rows or None)


def write_scores(scores: np.ndarray, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".npy":
        np.save(path, scores)
    else:
        np.savetxt(path, scores, fmt="%.6f")


def main(argv: list[str] | None = None) -> Path:
    """Score the click logs; return the scores' file."""
    args = parse_args(argv)
    start = time.perf_counter()
    program_path = args.program or train_and_export(args.quantize, RUN_DIR / f"dlrm_{args.quantize}.pt2")
    extra = {SIGNATURE_FILE: ""}
    program = torch.export.load(program_path, extra_files=extra).module()
    sig = json.loads(extra[SIGNATURE_FILE])
    if sig.get("num_dense") is None or sig.get("weighted"):
        raise ValueError(
            f"{program_path}: expected a DLRM program taking (dense, values, lengths), got {sig['inputs']}"
        )
    logs = click_logs(args, sig["keys"], sig["rows"])
    scores, labels = [], []
    with torch.no_grad():
        for batch in track(logs, total=len(logs), description=f"scoring {args.source}"):
            logits = program(batch.dense, batch.sparse.values(), batch.sparse.lengths())
            scores.append(torch.sigmoid(logits).numpy())
            labels.append(batch.labels.numpy())
    out, y = np.concatenate(scores), np.concatenate(labels)
    write_scores(out, args.output)
    from lightning_rec.data import binary_auc

    stored = sorted(set(sig.get("quantized", {}).values())) or ["float"]
    print(
        f"scored {len(out):,} rows with {program_path} (tables {'/'.join(stored)}): AUC {binary_auc(out, y):.4f}, "
        f"wrote {args.output} in {time.perf_counter() - start:.0f}s"
    )
    return args.output


if __name__ == "__main__":
    main()
