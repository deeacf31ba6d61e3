"""``DistributedModelParallel`` for a training loop without Lightning (TorchRec's names and argument order).

A thin wrapper over the core the Lightning strategies call too (``lightning_rec.front_end``): every embedding
collection sharded by the plan (or an automatic plan), DDP keeps the dense rest in sync (with TorchRec's settings:
:class:`DefaultDataParallelWrapper`), and the state_dict keeps the unsharded model's keys.
Embedding gradients follow TorchRec's rule by default (``embedding_grad="mean"``: divided by the number of
ranks), so a DMP job on N ranks with batch B per rank trains like one process on batch N * B.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from lightning_rec import front_end
from lightning_rec.distributed.optimizers import spec_from_fused_params
from lightning_rec.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from lightning_rec.fused_kinds import FusedOptimizerSpec, TableSpecs
from lightning_rec.optim import FusedOptimizer
from lightning_rec.sharding import ParameterSharding, ShardedCollection, ShardingPlan


@dataclass
class ShardingEnv:
    """The process group a model is sharded over (TorchRec's ``ShardingEnv``)."""

    world_size: int
    rank: int
    pg: dist.ProcessGroup | None = None

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        return self.pg

    @classmethod
    def from_process_group(cls, pg: dist.ProcessGroup) -> ShardingEnv:
        return cls(dist.get_world_size(pg), dist.get_rank(pg), pg)

    @classmethod
    def from_local(cls, world_size: int, rank: int) -> ShardingEnv:
        return cls(world_size, rank, None)


class ModuleSharder:
    """Which module type a sharder shards, and the options its tables get (``fused_params``)."""

    module_type: type[nn.Module] = nn.Module

    def __init__(
        self, fused_params: Mapping[str, Any] | None = None, qcomm_codecs_registry: Any = None, **kwargs: Any
    ) -> None:
        # checked now (a bad registry fails at construction); used by the collections this sharder shards
        self.qcomm_codecs_registry = front_end.check_qcomm_registry(qcomm_codecs_registry)
        unknown = sorted(k for k, v in kwargs.items() if v not in (None, False))
        if unknown:
            raise ValueError(f"{type(self).__name__}: options {unknown} are not supported")
        self.fused_params = dict(fused_params or {})
        # checked now, so a bad optimizer fails at construction
        self.embedding_optimizer: FusedOptimizerSpec | None = spec_from_fused_params(self.fused_params)

    def shardable_parameters(self, module: nn.Module) -> dict[str, nn.Parameter]:
        """``{table name: weight}`` of ``module``."""
        tables = getattr(module, "embedding_bags", None) or getattr(module, "embeddings", None)
        return {} if tables is None else {name: m.weight for name, m in tables.named_children()}

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [
            "data_parallel",
            "table_wise",
            "row_wise",
            "column_wise",
            "table_row_wise",
            "grid_shard",
            "table_column_wise",
        ]


class EmbeddingBagCollectionSharder(ModuleSharder):
    """Shards ``EmbeddingBagCollection``; ``fused_params={"optimizer": ..., "learning_rate": ...}`` makes its
    tables update in backward with the fused kernel (as an in-backward optimizer on the tables does)."""

    module_type = EmbeddingBagCollection


class EmbeddingCollectionSharder(ModuleSharder):
    """Shards ``EmbeddingCollection`` (its tables are ordinary parameters: no fused optimizer)."""

    module_type = EmbeddingCollection


def get_default_sharders() -> list[ModuleSharder]:
    return [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()]


def get_module_to_default_sharders() -> dict[type[nn.Module], ModuleSharder]:
    """TorchRec's ``{module type: default sharder}``. Only the collections sharded through a sharder here
    (``EmbeddingBagCollection``, ``EmbeddingCollection``); managed-collision collections are sharded by
    ``shard_modules`` through the collection they wrap, and there are no quantized or fused-collection types."""
    return {s.module_type: s for s in get_default_sharders()}


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


def _table_optimizers(module: nn.Module, sharders: list[ModuleSharder]) -> dict[str, TableSpecs]:
    """Every table's fused spec, from its in-backward mark or its sharder's fused_params (the strategies' rule)."""
    by_type = {s.module_type: s for s in sharders}
    for path, m in module.named_modules():
        if type(m) in (EmbeddingBagCollection, EmbeddingCollection) and type(m) not in by_type:
            raise ValueError(
                f"no sharder for {type(m).__name__} at {path or '<root>'!r}; sharders given: "
                f"{[type(s).__name__ for s in sharders]}"
            )
    return front_end.resolve_table_optimizers(module, None, {t: s.embedding_optimizer for t, s in by_type.items()})


def _unwrap(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, DistributedDataParallel) else module


class DistributedModelParallel(nn.Module):
    """Shards a model's embedding collections over the process group and wraps the dense rest in DDP.

    Args (TorchRec's order):
        module: the model (its collections may be on the meta device; dense parts on ``device``).
        env: a :class:`ShardingEnv` (default: the initialised world).
        device: where shards and dense parameters live (default cpu).
        plan: a ``ShardingPlan`` (or ``{module path: {table: ParameterSharding}}``); default: automatic.
        sharders: default :func:`get_default_sharders`; an ``EmbeddingBagCollectionSharder(fused_params=)``
            or an in-backward optimizer on the tables (``apply_optimizer_in_backward``) selects the fused kernel.
        init_data_parallel: wrap the dense part in DDP now (else call :meth:`init_data_parallel`).
        init_parameters: materialise dense parameters left on the meta device (``reset_parameters``).
        data_parallel_wrapper: a :class:`DefaultDataParallelWrapper` (default: its defaults, TorchRec's): the
            DDP settings of the dense part.
        embedding_grad: ``"mean"`` (TorchRec's, default) or ``"sum"`` (see ``shard_modules``).

    ``state_dict()`` has the unsharded model's keys (sharded tables as DTensors). ``fused_optimizer`` is
    the :class:`~lightning_rec.optim.FusedOptimizer` of the fused tables (None without): step it once per step
    after backward (``TrainPipelineSparseDist`` does), the update itself happens in backward.
    """

    def __init__(
        self,
        module: nn.Module,
        env: ShardingEnv | None = None,
        device: torch.device | None = None,
        plan: ShardingPlan | Mapping[str, Mapping[str, ParameterSharding]] | None = None,
        sharders: list[ModuleSharder] | None = None,
        init_data_parallel: bool = True,
        init_parameters: bool = True,
        data_parallel_wrapper: Any = None,
        *,
        embedding_grad: str = "mean",
    ) -> None:
        super().__init__()
        if data_parallel_wrapper is None:
            data_parallel_wrapper = DefaultDataParallelWrapper()
        if not isinstance(data_parallel_wrapper, DefaultDataParallelWrapper):
            raise ValueError(
                f"data_parallel_wrapper: expected a DefaultDataParallelWrapper (its arguments choose the DDP "
                f"settings), got {type(data_parallel_wrapper).__name__}"
            )
        self._data_parallel_wrapper = data_parallel_wrapper
        if env is None:
            if not dist.is_available() or not dist.is_initialized():
                raise RuntimeError(
                    "DistributedModelParallel needs torch.distributed: call "
                    "torch.distributed.init_process_group first (world_size=1 is fine)"
                )
            env = ShardingEnv.from_process_group(dist.group.WORLD)  # type: ignore[arg-type]  # set once initialized
        if env.process_group is None:
            raise ValueError("DistributedModelParallel needs a ShardingEnv with a process group")
        self._env = env
        self.device = torch.device("cpu" if device is None else device)
        self.init_parameters = init_parameters
        self.sharders = get_default_sharders() if sharders is None else list(sharders)
        if plan is not None and not isinstance(plan, ShardingPlan):
            plan = ShardingPlan({k: dict(v) for k, v in plan.items()})
        specs = _table_optimizers(module, self.sharders)
        by_type = {s.module_type: s.qcomm_codecs_registry for s in self.sharders}
        registry = front_end.sharders_qcomm_registry(
            by_type.get(EmbeddingBagCollection), by_type.get(EmbeddingCollection)
        )
        sharded, self._fused, self._plan = front_end.shard(
            module,
            plan,
            specs,
            process_group=env.process_group,
            device=self.device,
            embedding_grad=embedding_grad,
            qcomm_codecs_registry=registry,
            # dense parameters built on the meta device get real storage here and their own initialisation
            materialize_as="DistributedModelParallel" if init_parameters else None,
        )
        self._dmp_wrapped_module: nn.Module = sharded
        self._ddp_wrapped = False
        if init_data_parallel:
            self.init_data_parallel()

    def _init_parameters(self, module: nn.Module) -> None:
        # dense parameters built on the meta device get real storage here and their own initialisation
        front_end.init_dense(module, self.device, "DistributedModelParallel")

    def init_data_parallel(self) -> None:
        """Wrap the dense (non-sharded) parameters in DDP. Safe to call again."""
        if self._ddp_wrapped:
            return
        if self.init_parameters:
            self._init_parameters(self._dmp_wrapped_module)
        model = self._dmp_wrapped_module
        # a sharded collection alone has nothing dense: it reduces its own gradients
        if not isinstance(model, ShardedCollection):
            front_end.move_dense(model, self.device)
            # the strategies' list (managed-collision remap state is per rank too), and the wrapper's names
            if front_end.ignore_in_ddp(model, also=self._data_parallel_wrapper.params_to_ignore):
                assert self._env.process_group is not None
                self._dmp_wrapped_module = self._data_parallel_wrapper.wrap(model, self.device, self._env.process_group)
        self._ddp_wrapped = True

    @property
    def module(self) -> nn.Module:
        """The sharded model, without the DDP wrapper."""
        return _unwrap(self._dmp_wrapped_module)

    @property
    def plan(self) -> ShardingPlan:
        """The plan the model is sharded by, every placement with its ranks filled in."""
        return self._plan

    @property
    def fused_optimizer(self) -> FusedOptimizer | None:
        return self._fused

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._dmp_wrapped_module(*args, **kwargs)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        if args:
            raise TypeError("DistributedModelParallel.state_dict takes keyword arguments only")
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(prefix, recurse, remove_duplicate)
