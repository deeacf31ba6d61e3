"""Lightning's private or version-dependent symbols: precision and checkpoint loading helpers, the popen
launchers and backward-sync base the strategies extend, DDP built as Lightning builds it, and the private state
of strategies and LightningModules. Each documents the Lightning releases it was run on."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher as _FabricPopen
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.wrappers import _FabricModule
from lightning.pytorch.core.saving import _load_state
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher as _TrainerPopen
from lightning.pytorch.utilities.model_helpers import _restricted_classmethod
from torch.nn.parallel import DistributedDataParallel

# Lightning 2.6 checks `isinstance(treespec, LeafSpec)`, which torch 2.13 deprecates, on every batch; not the
# user's business (Lightning's fix: TreeSpec.is_leaf()).
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")


def precision_target_dtype(precision_plugin: object) -> torch.dtype | None:
    """The dtype a ``*-true`` Lightning precision plugin converts modules to (None for the others)."""
    # Lightning's HalfPrecision keeps it in a private attribute (lightning 2.4-2.6)
    return getattr(precision_plugin, "_desired_input_dtype", None)


#: Lightning's classmethod that refuses to be called on an instance (``load_from_checkpoint`` is one)
restricted_classmethod = _restricted_classmethod


def lightning_load_state(cls: type, checkpoint: dict[str, Any], strict: bool | None, **kwargs: Any) -> Any:
    """Lightning's step of ``load_from_checkpoint`` after reading the file: build ``cls`` from the saved
    hyper-parameters (``kwargs`` win), ``configure_model``, ``on_load_checkpoint``, ``load_state_dict``."""
    return _load_state(cls, checkpoint, strict=strict, **kwargs)


def optimizers_to_device(optimizers: Any, device: torch.device) -> None:
    """Move optimizer state to ``device`` (Lightning's private helper, the one DDPStrategy uses)."""
    _optimizers_to_device(optimizers, device)


#: Lightning Fabric's base for a strategy's ``no_backward_sync`` (``_BackwardSyncControl``: run on lightning 2.6,
#: there since 2.0)
BackwardSyncControl = _BackwardSyncControl


# Lightning's popen launchers (``python train.py`` with devices=N): the Trainer's and Fabric's, since Lightning 2.0
TrainerPopenLauncher = _TrainerPopen
FabricPopenLauncher = _FabricPopen


def unwrap_module(module: Any) -> Any:
    """The user's module inside Fabric's ``_FabricModule``, DDP and ``torch.compile`` wrappers."""
    while True:
        if isinstance(module, _FabricModule):
            module = module._original_module
        elif isinstance(module, DistributedDataParallel):
            module = module.module
        elif hasattr(module, "_orig_mod") and isinstance(module, torch.nn.Module):
            module = module._orig_mod
        else:
            return module


def ddp_on_current_stream(strategy: Any, module: torch.nn.Module) -> DistributedDataParallel:
    """``module`` in DDP as Lightning's DDP strategies (Trainer and Fabric) build it, but on the current stream.

    Lightning 2.6 builds DDP under a fresh side CUDA stream. DDP keeps each parameter's AccumulateGrad node,
    which then belongs to that stream, and torch >= 2.10 warns at every backward on the default stream that
    the streams differ and may synchronise (Lightning issue 21567; later Lightning releases build it on the
    current stream too). On CPU the two are the same.
    """
    if hasattr(strategy, "determine_ddp_device_ids"):
        device_ids = strategy.determine_ddp_device_ids()
    else:
        device_ids = strategy._determine_ddp_device_ids()
    return DistributedDataParallel(module=module, device_ids=device_ids, **strategy._ddp_kwargs)


def strategy_launcher(strategy: Any) -> Any:
    """The launcher a Lightning strategy configured (``Strategy._launcher``)."""
    return strategy._launcher


def set_strategy_launcher(strategy: Any, launcher: Any) -> None:
    strategy._launcher = launcher


def attached_trainer(module: Any) -> Any:
    """The Trainer a LightningModule is attached to, or None (``module.trainer`` raises when there is none)."""
    return module._trainer
