"""Lightning callbacks of lightning_rec."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_rec.export import export_program
from lightning_rec.front_end import fused_table_kinds, tables_optimizer_kind
from lightning_rec.pipeline.shard_modules import ShardedCollection
from lightning_rec.plans.planner import Planner, PlanReport, Topology


class ShardingSummary(L.Callback):
    """Prints, at fit start on rank 0, each table's placement and every rank's memory.

    Memory per rank is split into weights, optimizer state, gradients and lookup buffers, and the step
    time estimated by the planner's cost model is shown with its parts (see ``lightning_rec.plans.planner``).
    ``batch_size`` and ``pooling_factors`` refine the estimates; ``last_report`` keeps the report.
    """

    def __init__(self, batch_size: int | None = None, pooling_factors: dict[str, float] | None = None) -> None:
        self.batch_size = batch_size
        self.pooling_factors = pooling_factors
        self.last_report: PlanReport | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not any(isinstance(m, ShardedCollection) for m in pl_module.modules()):
            rank_zero_info("ShardingSummary: the model has no sharded embedding collections")
            return
        strategy = trainer.strategy
        mesh = getattr(strategy, "mesh_info", None)
        device = "cuda" if strategy.root_device.type == "cuda" else "cpu"
        # without the strategy's mesh (another strategy), the whole world is one model-parallel group on one host
        if mesh is not None:
            topo = Topology.from_mesh(mesh, device=device)
        else:
            topo = Topology(trainer.world_size, device=device)
        # the batch size and pooling the strategy's planner used (its report of an automatic plan must agree)
        auto = getattr(strategy, "planner", None)
        batch = self.batch_size or (auto.batch_size if auto is not None else None)
        kw: dict[str, Any] = {} if batch is None else {"batch_size": batch}
        pooling = self.pooling_factors
        if pooling is None and auto is not None:
            kw["default_pooling_factor"], pooling = auto.default_pooling_factor, auto.pooling_factors
        kind = tables_optimizer_kind(pl_module, trainer.optimizers) or "sgd"
        fused = fused_table_kinds(pl_module)  # per-table fused optimizers: each table's own state
        optimizer: str | dict[str, str] = fused if len(set(fused.values())) > 1 else kind
        planner = Planner(topo, optimizer=optimizer, pooling_factors=pooling, **kw)
        self.last_report = planner.estimate(pl_module)
        rank_zero_info(f"Sharding summary (memory of every rank; times are cost-model estimates):\n{self.last_report}")


class ExportProgram(L.Callback):
    """Write a ``torch.export`` program of the unsharded model when training ends (every rank takes part).

    Serve it with torch alone: ``torch.export.load(path).module()(dense, values, lengths)`` for any batch
    size and bag lengths (see :func:`lightning_rec.export.export_program`, whose keyword arguments
    ``export_kwargs`` are passed on: ``keys``, ``num_dense``, ``weighted``). ``last_path`` keeps the path.
    """

    def __init__(self, path: str | os.PathLike, **export_kwargs: Any) -> None:
        self.path = path
        self.export_kwargs = export_kwargs
        self.last_path: Path | None = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.last_path = export_program(pl_module, self.path, **self.export_kwargs)
        rank_zero_info(f"ExportProgram: wrote {self.last_path} (torch.export.load it to serve)")


# the state_dict export callback lives with the streaming writer it drives
from lightning_rec.export import ExportStateDict  # noqa: E402

__all__ = ["ExportProgram", "ExportStateDict", "ShardingSummary"]
