"""How ``DistributedModelParallel`` wraps the dense part of a model: TorchRec's ``DefaultDataParallelWrapper``."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}


class DefaultDataParallelWrapper:
    """DDP over the dense parameters, with TorchRec's settings: gradients as bucket views, buffers not broadcast
    each step (a dense buffer such as DLRM's ``triu_indices`` would cost one collective per forward), a static
    graph, ``bucket_cap_mb`` buckets.

    Args:
        bucket_cap_mb: DDP's bucket size.
        static_graph: DDP's ``static_graph`` (the same parameters take part in every step).
        find_unused_parameters: DDP's ``find_unused_parameters``.
        allreduce_comm_precision: ``"fp16"`` / ``"bf16"`` (NCCL only): dense gradients travel in that precision
            (torch's compression hooks); None: as they are.
        params_to_ignore: more parameter or buffer names (of the wrapped module) DDP leaves alone.
        ddp_kwargs: any other ``DistributedDataParallel`` argument; these win over the ones above.
    """

    def __init__(
        self,
        bucket_cap_mb: int = 25,
        static_graph: bool = True,
        find_unused_parameters: bool = False,
        allreduce_comm_precision: str | None = None,
        params_to_ignore: list[str] | None = None,
        ddp_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if allreduce_comm_precision is not None and allreduce_comm_precision not in _HOOKS:
            raise ValueError(
                f"allreduce_comm_precision={allreduce_comm_precision!r}: expected one of {sorted(_HOOKS)} or None"
            )
        self.kwargs: dict[str, Any] = {
            "gradient_as_bucket_view": True,
            "broadcast_buffers": False,
            "static_graph": static_graph,
            "find_unused_parameters": find_unused_parameters,
            "bucket_cap_mb": bucket_cap_mb,
            **(ddp_kwargs or {}),
        }
        self.allreduce_comm_precision = allreduce_comm_precision
        self.params_to_ignore = list(params_to_ignore or [])

    def wrap(
        self, module: nn.Module, device: torch.device, process_group: dist.ProcessGroup
    ) -> DistributedDataParallel:
        """``module`` in DDP on ``device`` over ``process_group`` (the names to leave alone already marked)."""
        backend = str(dist.get_backend(process_group))
        if self.allreduce_comm_precision == "bf16" and "nccl" not in backend:
            # torch's bf16 hook needs NCCL, and gloo cannot sum bf16
            raise ValueError(
                f"allreduce_comm_precision='bf16' needs the NCCL backend (this process group is {backend}); "
                "use 'fp16' or None"
            )
        with warnings.catch_warnings():
            # torch 2.13 deprecates broadcast_buffers for forward_sync_buffers, whose False still syncs buffers
            # at init; its own advice for TorchRec's setting (no sync at all) is to keep broadcast_buffers=False
            warnings.filterwarnings("ignore", message=r".*`broadcast_buffers` is deprecated", category=FutureWarning)
            ddp = DistributedDataParallel(
                module,
                device_ids=None if device.type == "cpu" else [device],
                process_group=process_group,
                **self.kwargs,
            )
        if self.allreduce_comm_precision is not None:
            ddp.register_comm_hook(process_group, _HOOKS[self.allreduce_comm_precision])
        return ddp
