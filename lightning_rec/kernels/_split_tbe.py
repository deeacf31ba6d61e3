"""The object behind a fused kernel: fbgemm's split table-batched module, or its torch stand-in on CPU.

fbgemm's CPU build has kernels for SGD and the Adagrads only (docs/ARCHITECTURE.md F1). On CPU the other kinds
(``fused_kinds.TORCH_CPU_KINDS``) run :class:`~lightning_rec.kernels._torch_adam.TorchAdamTBE`, which has the
same interface and applies fbgemm's CUDA rule; it needs no fbgemm at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_rec.fused_kinds import TORCH_CPU_KINDS, FusedOptimizerSpec
from lightning_rec.kernels._capability import check_fused_available, fbgemm_training
from lightning_rec.kernels._torch_adam import TorchAdamTBE


def runs_in_torch(spec: FusedOptimizerSpec, device: torch.device) -> bool:
    """Whether ``spec`` on ``device`` is applied by the torch stand-in (no fbgemm kernel there)."""
    return device.type == "cpu" and spec.kind in TORCH_CPU_KINDS


def check_split_tbe(spec: FusedOptimizerSpec, device: torch.device) -> Any:
    """Check ``spec`` can run on ``device`` (and, where fbgemm runs, that the installed build has the kernel);
    return fbgemm's ``OptimType`` for it, or None where the torch stand-in runs."""
    if runs_in_torch(spec, device):
        spec.check_device(device)
        return None
    optim_type = spec.validate(device)
    # once, here, before touching the device: a CPU-only fbgemm build next to a CUDA torch must give one
    # sentence naming the package to install, not a NotImplementedError from deep inside forward
    check_fused_available(spec, device)
    return optim_type


def build_split_tbe(
    spec: FusedOptimizerSpec,
    optim_type: Any,
    names: Sequence[str],
    rows: Sequence[int],
    dims: Sequence[int],
    dtype: torch.dtype,
    feature_table: Sequence[int],
    device: torch.device,
    pooling: str = "sum",
) -> Any:
    """The module holding the tables and updating them in backward, for a checked ``spec``: SUM-pooled, or
    (``pooling="none"``, one dim for all tables) one row per id."""
    if runs_in_torch(spec, device):
        if dtype != torch.float32:
            raise ValueError(
                f"fused optimizer {spec.kind!r} on CPU supports float32 tables only, got {dtype} (fbgemm has no "
                f"CPU kernel for {spec.kind!r}; its torch update keeps fp32 tables): use torch.float32"
            )
        return TorchAdamTBE(rows, dims, feature_table, spec, pooling=pooling)
    tbe_ops = fbgemm_training()
    on_cpu = device.type == "cpu"
    location = tbe_ops.EmbeddingLocation.HOST if on_cpu else tbe_ops.EmbeddingLocation.DEVICE
    compute = tbe_ops.ComputeDevice.CPU if on_cpu else tbe_ops.ComputeDevice.CUDA
    precision = tbe_ops.SparseType.FP32 if dtype == torch.float32 else tbe_ops.SparseType.FP16
    extra: dict[str, Any] = {}
    if spec.betas is not None:
        extra.update(beta1=spec.betas[0], beta2=spec.betas[1])
    if spec.weight_decay:  # never on CPU here: check_device refuses it for fbgemm's CPU kernels
        extra["weight_decay"] = spec.weight_decay
        if spec.kind == "rowwise_adagrad":
            extra["weight_decay_mode"] = tbe_ops.WeightDecayMode.L2
    return tbe_ops.SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(r, d, location, compute) for r, d in zip(rows, dims)],
        feature_table_map=list(feature_table),
        optimizer=optim_type,
        learning_rate=spec.lr,
        eps=spec.eps,
        stochastic_rounding=spec.stochastic_rounding,
        pooling_mode=tbe_ops.PoolingMode.SUM if pooling == "sum" else tbe_ops.PoolingMode.NONE,
        weights_precision=precision,
        output_dtype=precision,
        device=device,
        # every id is checked once before the kernel (ours refuses -1 too, fbgemm's does not: F14), by
        # forward or by a caller that says so; a second pass inside fbgemm would only cost time
        bounds_check_mode=tbe_ops.BoundsCheckMode.NONE,
        table_names=list(names),
        **extra,
    )
