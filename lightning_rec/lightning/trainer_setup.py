"""What the Trainer strategy (``strategy.py``) checks and arranges around Lightning's own set-up, as plain
functions its hooks call: features that cannot work on sharded or fused tables refused before any collective,
equal batch counts in training, norm clipping over every table, gradient scaling agreed over the ranks, the fused
optimizer stepped with the user's, the automatic plan explained.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import lightning as L
import torch
from lightning.pytorch import callbacks
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.plugins import Precision
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_rec import _compat
from lightning_rec.front_end import automatic_plan_report
from lightning_rec.fused_kinds import EmbeddingOptimizer
from lightning_rec.optim import CombinedOptimizer
from lightning_rec.pipeline.clip_grad_norm import clip_grad_norm_
from lightning_rec.pipeline.shard_modules import dense_state, fused_optimizer, use_sparse_grads_where_possible
from lightning_rec.plans.planner import Planner, PlanReport


def batch_size(module: L.LightningModule) -> int | None:
    """The module's batch size for the planner, found as Lightning's batch-size finder finds it (None: unknown)."""
    try:
        if lightning_hasattr(module, "batch_size"):
            # None raises TypeError, caught below
            return int(lightning_getattr(module, "batch_size"))  # type: ignore[arg-type]
    except (AttributeError, TypeError, ValueError):
        pass
    return None


def refuse_model_copies(trainer: L.Trainer) -> None:
    """Refuse weight averaging: it copies the LightningModule in its setup hook, before sharding, so the copy holds
    whole tables and the live model this rank's shards; averaging them fails on mismatched shapes (or, where shapes
    happen to agree, averages unrelated rows)."""
    kinds = tuple(
        c for c in (getattr(callbacks, n, None) for n in ("StochasticWeightAveraging", "WeightAveraging")) if c
    )
    found = [type(c).__name__ for c in trainer.callbacks if isinstance(c, kinds)]  # type: ignore[attr-defined]
    if found:
        raise ValueError(
            f"rec_sharded: {found[0]} keeps a copy of the whole model, made before the tables are sharded, and "
            "averages it with this rank's shards, which cannot match. Average the dense part yourself (for "
            "example torch.optim.swa_utils.AveragedModel of the dense modules, updated in on_train_batch_end), "
            "or train without weight averaging"
        )


def check_fused_trainer(
    trainer: L.Trainer,
    module: nn.Module | None,
    precision_plugin: Precision,
    embedding_optimizer: EmbeddingOptimizer | None,
) -> None:
    """Make fused tables accumulate where Lightning accumulates; refuse what cannot reach them (clipping, loss
    scaling): they are updated inside backward and never hold a gradient."""
    if embedding_optimizer is None:
        return
    fused = fused_optimizer(module) if module is not None else None
    if fused is not None and (
        trainer.accumulate_grad_batches > 1
        # trainer.callbacks: set by Lightning's callback connector, not declared on the Trainer
        or any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks)  # type: ignore[attr-defined]
    ):
        # Lightning steps the optimizer once every k batches: the kernels keep each backward's gradient
        # and apply one update from their sum at that step (kernels/_accumulate.py)
        fused.accumulate = True
    if trainer.gradient_clip_val:
        raise ValueError(
            f"gradient_clip_val={trainer.gradient_clip_val} cannot clip fused embedding tables: they are updated "
            "inside backward and never hold a gradient. Clip the dense parameters yourself in "
            "configure_gradient_clipping (self.clip_gradients on them), or use embedding_optimizer=None"
        )
    scaler = getattr(precision_plugin, "scaler", None)
    if scaler is not None:
        raise ValueError(
            f"precision {getattr(precision_plugin, 'precision', '16-mixed')!r} scales the loss with a "
            "GradScaler, which cannot reach fused embedding tables: they are updated inside backward with the "
            "scaled gradient, before the scaler could unscale it or skip the step. Use precision='bf16-mixed' "
            "(no loss scaling) or '32-true', or embedding_optimizer=None"
        )


def check_equal_batch_counts(world_size: int, stage: str, counts: Any) -> None:
    """Raise on every rank when the ranks would run different numbers of ``stage`` batches; collective."""
    if world_size == 1:
        return
    gathered: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(gathered, counts)
    if any(c != gathered[0] for c in gathered):
        raise ValueError(
            f"rec_sharded: ranks would run different numbers of {stage} batches per epoch (by rank: {gathered}). "
            "Every rank must run the same number of training batches, since every sharded lookup and every "
            "gradient reduction is a collective across ranks: a rank with an extra batch would wait forever. "
            "Use Lightning's distributed sampler (use_distributed_sampler=True, the default), DataLoaders of "
            "equal length on every rank, or limit_train_batches"
        )


def with_fused_optimizer(
    module: nn.Module | None, optimizers: list[torch.optim.Optimizer]
) -> list[torch.optim.Optimizer]:
    """``optimizers``, the first combined with the fused tables' optimizer where ``configure_optimizers`` left it
    out (it is then stepped with theirs, at its spec's learning rate)."""
    fused = fused_optimizer(module) if module is not None else None
    if fused is None or any(o is fused or fused in getattr(o, "optimizers", ()) for o in optimizers):
        return optimizers
    return [CombinedOptimizer([*optimizers[:1], fused]), *optimizers[1:]]


def explain_plan(planner: Planner, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> PlanReport:
    """The automatic plan's report, printed on rank 0; collective."""
    report = automatic_plan_report(planner, module, optimizers)
    rank_zero_info(f"lightning_rec: no sharding plan given; the planner chose:\n{report}")
    return report


def clip_by_global_norm(precision_plugin: Precision, model: nn.Module) -> None:
    """Route Lightning's norm clipping to the norm over every table once. Lightning's calls torch's
    ``clip_grad_norm_``, which would see only this rank's shards: each rank would scale by its own factor."""

    def clip_grad_by_norm(optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        clip_grad_norm_(model, precision_plugin.main_params(optimizer), clip_val)

    precision_plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]


def choose_dp_gradients(
    trainer: L.Trainer,
    module: L.LightningModule,
    optimizers: Sequence[torch.optim.Optimizer],
    precision_plugin: Precision,
) -> None:
    """Data-parallel tables take sparse gradients where the optimizers make that exact (``dp_grad_mode``);
    clipping (Lightning's or the module's own hook), loss scaling and manual optimization keep them dense."""
    clipping = (
        bool(trainer.gradient_clip_val)
        or not module.automatic_optimization
        or is_overridden("configure_gradient_clipping", module, L.LightningModule)
    )
    use_sparse_grads_where_possible(
        module, optimizers, gradient_clipping=clipping, grad_scaler=getattr(precision_plugin, "scaler", None)
    )


def sync_grad_scaler(precision_plugin: Precision) -> None:
    """Make the precision plugin's GradScaler agree on "found inf" over the world. Each rank sees only its own
    shards' gradients: a rank whose shards overflowed would skip the step while the others take it, and replicas
    would silently diverge."""
    scaler = getattr(precision_plugin, "scaler", None)
    if scaler is not None:
        # the plugins with a scaler (mixed precision, FSDP's) share no base class that declares it
        cast(Any, precision_plugin).scaler = _compat.synced_grad_scaler(scaler, torch.distributed.group.WORLD)


def sync_dense_states(module: nn.Module) -> None:
    """Start the dense replicas equal without DDP (validate / test / predict); shards are per rank."""
    for t in dense_state(module):
        torch.distributed.broadcast(t.data, src=0)
