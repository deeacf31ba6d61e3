"""The DLRM main job as a hand-written loop with Lightning Fabric: same data, model, sharding and final line.

::

    .venv/bin/python examples/dlrm_fabric.py                                   # 2 CPU processes, automatic plan
    .venv/bin/python examples/dlrm_fabric.py --devices 4 --embedding-optimizer '{"kind": "rowwise_adagrad", "lr": 0.05}'
    .venv/bin/python examples/dlrm_fabric.py --resume runs/dlrm/checkpoints/dlrm-final.ckpt   # a Trainer checkpoint

``fabric.launch()`` starts the other processes (or joins those torchrun / SLURM started). The model is
``lightning_rec.models.DLRM`` (a LightningModule, used here as a plain module: its ``configure_optimizers`` builds
the optimizers), the data ``SyntheticClicks`` (each rank reads its own rows). The checkpoint written at the end
(``runs/dlrm_fabric/checkpoints/dlrm-final.ckpt``) is a ``rec_sharded`` directory: it resumes here or under the
Trainer (``examples/dlrm.py --ckpt_path ...``), at any world size or plan.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from lightning.fabric import Fabric

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dlrm import final_line

from lightning_rec import RecShardedFabricStrategy
from lightning_rec.data import ClickLoader, SyntheticClicks
from lightning_rec.data.synthetic import FEATURE_NAMES, NUM_DENSE, scaled_cardinalities
from lightning_rec.metrics import rec_metrics
from lightning_rec.models import DLRM


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--train-rows", type=int, default=65536)
    p.add_argument("--val-rows", type=int, default=16384)
    p.add_argument("--size", type=float, default=1e-3, help="table sizes as a fraction of Criteo's")
    p.add_argument("--embedding-dim", type=int, default=16)
    p.add_argument(
        "--embedding-optimizer",
        type=json.loads,
        default=None,
        help='a fused optimizer spec as JSON, e.g. \'{"kind": "rowwise_adagrad", "lr": 0.05}\'',
    )
    p.add_argument("--model-parallel-size", type=int, default=None)
    p.add_argument("--root", default="runs/dlrm_fabric", help="where the checkpoint goes")
    p.add_argument("--resume", default=None, help="a checkpoint directory written by either front end")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def evaluate(fabric: Fabric, model: torch.nn.Module, loader: ClickLoader) -> dict[str, float]:
    """Validation AUC / NE / calibration / log loss, synced over ranks (torchmetrics)."""
    metrics = rec_metrics("val_").to(fabric.device)
    model.eval()
    with torch.no_grad():
        for batch in loader:
            batch = fabric.to_device(batch)
            metrics.update(torch.sigmoid(model(batch.dense, batch.sparse).float()), batch.labels.long())
    model.train()
    return {k: float(v) for k, v in metrics.compute().items()}


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Train, validate, save; return the validation metrics (on every rank)."""
    args = parse(argv)
    torch.sparse.check_sparse_tensor_invariants.disable()  # as examples/dlrm.py: torch's own ops build them
    start = time.perf_counter()
    strategy = RecShardedFabricStrategy(
        embedding_optimizer=args.embedding_optimizer, model_parallel_size=args.model_parallel_size
    )
    fabric = Fabric(accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(args.seed)
    cards = scaled_cardinalities(args.size)
    data = dict(
        batch_size=args.batch_size,
        seed=args.seed,
        rank=fabric.global_rank,
        world_size=fabric.world_size,
        cardinalities=cards,
    )
    train = ClickLoader(SyntheticClicks(args.train_rows, split="train", **data), what="train loader")
    val = ClickLoader(SyntheticClicks(args.val_rows, split="val", **data), what="val loader")

    model = DLRM(
        num_dense=NUM_DENSE,
        feature_names=list(FEATURE_NAMES),
        num_embeddings_per_feature=cards,
        embedding_dim=args.embedding_dim,
    )
    model = fabric.setup_module(model)  # shards the tables (the planner: no plan given), DDP for the rest
    optimizer = fabric.setup_optimizers(model.configure_optimizers())  # built from this rank's shards
    state = {"model": model, "optimizer": optimizer, "epoch": 0}
    if args.resume:
        fabric.load(args.resume, state)  # any world size or plan; a Trainer checkpoint's loops are not used
    for epoch in range(state["epoch"], args.epochs):
        for batch in train:
            batch = fabric.to_device(batch)
            logits = model(batch.dense, batch.sparse)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), batch.labels.float())
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        state["epoch"] = epoch + 1
    metrics = evaluate(fabric, model, val)
    fabric.save(Path(args.root) / "checkpoints" / "dlrm-final.ckpt", state)
    if fabric.is_global_zero:
        achievable = SyntheticClicks(args.val_rows, split="val", **{**data, "rank": 0, "world_size": 1})
        print(final_line(metrics, time.perf_counter() - start, achievable.achievable_auc()), flush=True)
    return metrics


if __name__ == "__main__":
    main()
