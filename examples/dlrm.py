"""The main job: DLRM click-through training with sharded embedding tables, driven by LightningCLI.

Defaults come from ``examples/dlrm.yaml`` (next to this file): synthetic Criteo-shaped clicks, 2 CPU
processes, ``strategy=rec_sharded`` with the automatic plan, a rich progress bar, the plan and per-rank
memory at start, validation AUC / NE each epoch and a checkpoint at the end. The last line printed is
``final: val AUC ... NE ...``. Every setting can be changed in a YAML file or on the command line::

    python examples/dlrm.py                                        # the defaults
    python examples/dlrm.py --print_config                         # everything that can be set
    python examples/dlrm.py --trainer.devices 4 --model.embedding_dim 32 --data.size 0.1
    python examples/dlrm.py --config my.yaml                       # layered over dlrm.yaml
    python examples/dlrm.py --trainer.max_epochs 2 --ckpt_path runs/dlrm/checkpoints/dlrm-final.ckpt  # resume
    python examples/dlrm.py --trainer.default_root_dir runs/dlrm_export --export_program runs/dlrm_export/dlrm.pt2
    python examples/dlrm.py --data.source criteo_tsv --data.path /data/criteo/day_0 --trainer.max_epochs 1
    python examples/dlrm.py --data.raw_ids true                    # raw ids, managed collision: runs/dlrm_raw_ids
    python examples/dlrm.py --data.raw_ids true --model.managed_collision '{eviction_policy: lfu, num_buckets: 384}'

The model's ``num_dense``, ``feature_names`` and ``num_embeddings_per_feature`` are taken from the data
module (one table per categorical feature, named after it); give ``model.tables`` to choose tables yourself.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.cli import LightningCLI

import lightning_rec  # noqa: F401  registers strategy="rec_sharded"
from lightning_rec.data import ClickDataModule, SyntheticClicks
from lightning_rec.lightning.callbacks import ExportProgram
from lightning_rec.models import DLRM

DEFAULT_CONFIG = Path(__file__).with_name("dlrm.yaml")
RUN_DIR = "runs/dlrm"  # dlrm.yaml's trainer.default_root_dir; its logger and checkpoint paths sit under it


class DLRMCLI(LightningCLI):
    """LightningCLI that sizes the model from the data module (available right after its ``__init__``)."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        for source, target in (
            ("num_dense", "num_dense"),
            ("feature_names", "feature_names"),
            ("cardinalities", "num_embeddings_per_feature"),
            ("raw_ids", "raw_ids"),
        ):
            parser.link_arguments(f"data.{source}", f"model.{target}", apply_on="instantiate")
        parser.add_argument(
            "--ckpt_path",
            type=str | None,
            default=None,
            help="resume from a checkpoint directory (any world size, layout or plan)",
        )
        parser.add_argument(
            "--export_program",
            type=str | None,
            default=None,
            help="at the end of training, write a torch.export program of the unsharded model to "
            "this .pt2 file; serve it with torch.export.load(path).module()(dense, values, "
            "lengths)",
        )
        parser.add_argument(
            "--trust_checkpoint",
            type=bool,
            default=False,
            help="load --ckpt_path with full unpickling, which runs code the files name; only for "
            "checkpoints you wrote whose hyper-parameters hold arbitrary objects",
        )

    def before_instantiate_classes(self) -> None:
        """Keep each run's files apart: dlrm.yaml's paths under runs/dlrm (logs, checkpoints) follow
        ``--trainer.default_root_dir``, and a raw-ids run defaults to runs/dlrm_raw_ids (its checkpoint would not
        load into the hashed model that resumes from runs/dlrm/checkpoints)."""
        trainer = self.config.trainer
        root = trainer.default_root_dir
        if root == RUN_DIR and self.config.data.raw_ids:
            root = trainer.default_root_dir = RUN_DIR + "_raw_ids"
        if not isinstance(root, str) or root == RUN_DIR:
            return
        for entry in [trainer.logger, *(trainer.callbacks or [])]:
            init = getattr(entry, "init_args", None)
            for key in ("save_dir", "dirpath"):
                path = getattr(init, key, None)
                if isinstance(path, str) and (path == RUN_DIR or path.startswith(RUN_DIR + "/")):
                    setattr(init, key, root + path[len(RUN_DIR) :])


def final_line(metrics: dict[str, Any], seconds: float, achievable: float | None = None) -> str:
    """The job's last line: validation AUC and NE (and the synthetic data's achievable AUC when known)."""
    auc, ne = metrics.get("val_auroc"), metrics.get("val_ne")
    if auc is None or ne is None:
        return f"final: no validation metrics (was validation disabled?) after {seconds:.0f}s"
    extra = f" (achievable AUC {achievable:.4f})" if achievable is not None else ""
    if "mc/hit_rate" in metrics:  # managed collision (--data.raw_ids true): the last epoch's remap totals
        extra += f"  mc hit rate {float(metrics['mc/hit_rate']):.4f} evicted {int(metrics['mc/evicted']):,}"
    return f"final: val AUC {float(auc):.4f}  NE {float(ne):.4f}{extra}  after {seconds:.0f}s"


def main(args: list[str] | None = None) -> dict[str, float]:
    """Run the job; return the final callback metrics (on every rank)."""
    # Sparse gradients (Adagrad on the tables) are built by torch's own ops; checking their invariants on every
    # step costs time and torch warns when the check is left implicit: opt out explicitly.
    torch.sparse.check_sparse_tensor_invariants.disable()
    start = time.perf_counter()
    cli = DLRMCLI(
        DLRM,
        ClickDataModule,
        run=False,
        args=args,
        parser_kwargs={"default_config_files": [str(DEFAULT_CONFIG)]},
        save_config_kwargs={"overwrite": True},
    )
    # never run code from a checkpoint unless told to trust it; Lightning does not pass weights_only on to
    # strategies that restore after setup (rec_sharded), so the strategy is told directly
    trust = bool(cli.config.get("trust_checkpoint"))
    if trust and hasattr(cli.trainer.strategy, "trusted_checkpoints"):
        cli.trainer.strategy.trusted_checkpoints = True
    if cli.config.get("export_program"):
        cli.trainer.callbacks.append(ExportProgram(cli.config["export_program"]))
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=cli.config.get("ckpt_path"), weights_only=not trust)
    metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    if cli.trainer.is_global_zero:
        print(final_line(metrics, time.perf_counter() - start, achievable_auc(cli.datamodule)), flush=True)
    return metrics


def achievable_auc(dm: ClickDataModule) -> float | None:
    """The hidden model's AUC on the synthetic validation rows: the ceiling for any model (None for real data)."""
    if dm.source != "synthetic" or not dm.rows["val"]:
        return None
    return SyntheticClicks(
        dm.rows["val"],
        dm.batch_size,
        seed=dm.seed,
        split="val",
        multi_hot=dm.multi_hot,
        cardinalities=dm.cardinalities,
        raw_ids=dm.raw_ids,
    ).achievable_auc()


if __name__ == "__main__":
    main()
