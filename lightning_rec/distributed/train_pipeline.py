"""``TrainPipelineSparseDist``: TorchRec's training-loop helper, here one step after the other (not pipelined).

Correctness first: each ``progress`` call fetches a batch, moves it to the device, runs forward and backward
and steps the optimizers, in that order; TorchRec overlaps the next batch's copy and input all-to-all with
the current step. The results are the same; only the overlap (speed) is missing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lightning_rec.distributed.model_parallel import DistributedModelParallel


class TrainPipelineSparseDist:
    """Train ``model`` (whose forward returns ``(losses, output)``, as ``DLRMTrain``'s does) one batch per call.

    Args (TorchRec's order): ``model``, ``optimizer`` (the dense / non-fused one), ``device``. The fused
    optimizer of a :class:`DistributedModelParallel` is stepped too. ``execute_all_batches`` is accepted;
    ``apply_jit=True`` (TorchScript) is not supported.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        **kwargs: Any,
    ) -> None:
        if apply_jit:
            raise ValueError("TrainPipelineSparseDist(apply_jit=True): TorchScript is not supported")
        unknown = sorted(k for k, v in kwargs.items() if v not in (None, False))
        if unknown:
            raise ValueError(f"TrainPipelineSparseDist: options {unknown} are not supported")
        self._model = model
        self._optimizer = optimizer
        self._device = torch.device(device)
        fused = model.fused_optimizer if isinstance(model, DistributedModelParallel) else None
        inside = fused is not None and (fused is optimizer or fused in getattr(optimizer, "optimizers", ()))
        self._fused = None if inside else fused

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Train on the next batch of ``dataloader_iter``; return the model's output. Raises StopIteration at
        the end of the data."""
        batch = next(dataloader_iter)
        batch = batch.to(self._device)
        self._model.train()
        self._optimizer.zero_grad()
        losses, output = self._model(batch)
        torch.sum(losses).backward()
        self._optimizer.step()
        if self._fused is not None:
            self._fused.step()
        return output
