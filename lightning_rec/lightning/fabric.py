"""``Fabric(strategy="rec_sharded")``: the Trainer strategy's sharding for users who write their own loop.

The idiom of Lightning's model-parallel Fabric strategies: ``model = fabric.setup_module(model)`` shards the
collections (the strategy's plan, the module's ``configure_sharding()``, or the planner) and wraps the dense
rest in DDP; then ``optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters()))`` sees this
rank's shards. Everything that decides the math is :mod:`lightning_rec.lightning.shard_setup` (and the
``front_end`` it calls), shared with the Trainer strategy, and ``fabric.save`` / ``fabric.load`` read and write
the same checkpoint directories.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.strategies import DDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_rec import _compat
from lightning_rec import checkpoint as ckpt
from lightning_rec.checkpoint.safe import refusing_unsafe
from lightning_rec.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from lightning_rec.front_end import ignore_in_ddp, warn_unoptimized_tables
from lightning_rec.lightning import shard_setup
from lightning_rec.lightning.shard_setup import ShardSetup, require_popen
from lightning_rec.optim import CombinedOptimizer
from lightning_rec.pipeline.clip_grad_norm import clip_grad_norm_
from lightning_rec.pipeline.output_dist import QCommsConfig
from lightning_rec.pipeline.shard_modules import fused_optimizer, sharded_collections
from lightning_rec.plans.mesh import MeshInfo
from lightning_rec.plans.plan import ShardingPlan
from lightning_rec.plans.planner import Planner
from lightning_rec.transport import inflight


class _BackwardSync(_compat.BackwardSyncControl):
    """``fabric.no_backward_sync``: DDP's ``no_sync`` for the dense part; without dense parameters there is no
    DDP and nothing to hold back (the tables' own reductions run in every backward, as under the Trainer).

    It also says the user accumulates: fused tables then keep each backward's gradient and apply one update
    from their sum at the optimizer's step (``FusedOptimizer.accumulate``), as the Trainer strategy does for
    ``accumulate_grad_batches``.
    """

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if enabled:
            fused = fused_optimizer(_compat.unwrap_module(module))
            if fused is not None:
                fused.accumulate = True
        if enabled and isinstance(module, DistributedDataParallel):
            return module.no_sync()
        return nullcontext()


class RecShardedFabricStrategy(DDPStrategy):
    """Shards every EmbeddingBagCollection / EmbeddingCollection of a module set up with Fabric; DDP for the rest.

    Takes the arguments of :class:`~lightning_rec.RecShardedStrategy` (``plan``, ``model_parallel_size``,
    ``data_parallel_size``, ``embedding_grad``, ``embedding_optimizer``, ``process_group_backend``, ``timeout``,
    ``trusted_checkpoints``, ``qcomms_config``, ``planner_speeds``, ``replicas_within_host``,
    ``planner_host_link``) with the same meaning. Set up the module first (``fabric.setup_module``), then build the
    optimizers from its parameters; ``fabric.setup(model, optimizer)`` with an optimizer built before sharding is
    refused, since it holds tables that sharding replaced. With ``embedding_optimizer`` the fused optimizer is
    stepped with the first optimizer set up (as the Trainer strategy does); accumulating under
    ``fabric.no_backward_sync`` gives it one update per step from the summed gradient.
    """

    strategy_name = shard_setup.STRATEGY_NAME

    def __init__(
        self,
        plan: ShardingPlan | None = None,
        model_parallel_size: int | None = None,
        data_parallel_size: int | None = None,
        embedding_grad: str = "sum",
        embedding_optimizer: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(seconds=1800),
        trusted_checkpoints: bool = False,
        qcomms_config: QCommsConfig | None = None,
        planner_speeds: Any = None,
        replicas_within_host: bool | str = False,
        planner_host_link: int | float | str | None = None,
        **kwargs: Any,
    ) -> None:
        require_popen(kwargs, "RecShardedFabricStrategy")
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, start_method="popen", **kwargs)
        self.core = ShardSetup(
            plan,
            model_parallel_size,
            data_parallel_size,
            embedding_grad,
            embedding_optimizer,
            trusted_checkpoints,
            qcomms_config,
            planner_speeds,
            replicas_within_host,
            planner_host_link,
        )
        self.embedding_optimizer = self.core.given_embedding_optimizer
        self.mesh_info: MeshInfo | None = None
        self.planner: Planner | None = None
        self._module: nn.Module | None = None  # the sharded module, unwrapped
        self._fused_attached = False
        self._backward_sync_control = _BackwardSync()

    @property
    @override
    def root_device(self) -> torch.device:
        return shard_setup.indexed_device(super().root_device, self.local_rank)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        shard_setup.register(strategy_registry, cls)

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        shard_setup.report_child_exits(self)  # ranks failing after rank 0 finished fail the job too

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.mesh_info = self.core.setup_environment(
            self.world_size, self.num_processes, self.num_nodes, self.root_device
        )

    @override
    def teardown(self) -> None:
        # collectives still in flight (a loader's status exchange for a batch never asked for) finish here, not
        # while the interpreter shuts down
        inflight.drain()
        super().teardown()

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], Any]:
        in_optimizers = {id(p) for o in optimizers for g in o.param_groups for p in g["params"]}
        tables = sorted(
            f"{path}.{n}" if path else n
            for path, m in module.named_modules()
            if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))
            for n, p in m.named_parameters()
            if id(p) in in_optimizers
        )
        meta = sorted(n for n, p in module.named_parameters() if p.device.type == "meta" and id(p) in in_optimizers)
        for held, what in (
            (tables, "the unsharded tables {}, which sharding replaces by this rank's shards"),
            (meta, "parameters on the meta device {}, which set-up replaces by initialised ones"),
        ):
            if held:
                raise ValueError(
                    "rec_sharded: the optimizer was built before sharding and holds "
                    + what.format(f"{held[:5]}{' ...' if len(held) > 5 else ''}")
                    + ". Set up the module first, then build the optimizer from its parameters: "
                    "model = fabric.setup_module(model); "
                    "optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), ...))"
                )
        module = self.setup_module(module)
        return module, [self.setup_optimizer(o) for o in optimizers], scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:  # type: ignore[override]  # returns module unwrapped too
        """Shard the collections (collective), then wrap the dense rest in DDP (the module itself when nothing
        dense trains)."""
        assert self.mesh_info is not None
        self.embedding_optimizer, self.planner, self.mesh_info = self.core.shard(
            module, self.mesh_info, self.root_device, self.world_size
        )
        module.to(self.root_device)
        self._module = module
        if not ignore_in_ddp(module):
            return module
        return _compat.ddp_on_current_stream(self, module)

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``empty_init=True`` (``fabric.init_module(empty_init=True)``) builds on the meta device: set-up then
        allocates only each rank's shards and gives the dense part storage and its ``reset_parameters()``."""
        if not empty_init:
            return super().module_init_context(empty_init)
        stack = ExitStack()
        stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def module_to_device(self, module: nn.Module) -> None:
        if any(t.device.type == "meta" for t in [*module.parameters(), *module.buffers()]):
            return  # setup_module gives meta tensors storage, then moves the module (as ModelParallelStrategy)
        module.to(self.root_device)

    @override
    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer, joined by the fused optimizer of the tables (the first optimizer set up takes it)."""
        assert self._module is not None, "set up the module (fabric.setup_module) before its optimizers"
        fused = fused_optimizer(self._module)
        if fused is not None and not self._fused_attached:
            self._fused_attached = True
            if optimizer is not fused and fused not in getattr(optimizer, "optimizers", ()):
                optimizer = CombinedOptimizer([optimizer, fused])
        warn_unoptimized_tables(self._module, [optimizer])
        return optimizer

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip by the norm over every table once (this rank's shards reduced over their group), as the Trainer
        strategy does: torch's ``clip_grad_norm_`` would see only this rank's shards."""
        self.precision.unscale_gradients(optimizer)
        model = self._module if self._module is not None else module
        norm = clip_grad_norm_(model, self.precision.main_params(optimizer), float(max_norm), float(norm_type))
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"the total norm of the gradients is {float(norm)}: clipping cannot be applied")
        return norm

    # -- checkpoints: the Trainer strategy's directories -----------------------------------------------------

    def _split(self, state: dict[str, Any]) -> tuple[str, nn.Module, list[tuple[str, torch.optim.Optimizer]]]:
        modules = [(k, v) for k, v in state.items() if isinstance(v, nn.Module)]
        if len(modules) != 1 or not any(True for _ in sharded_collections(modules[0][1])):
            raise ValueError(
                "rec_sharded checkpoints hold one sharded model: give fabric.save / fabric.load a state with exactly "
                f"one module set up by this strategy (got modules {[k for k, _ in modules]})"
            )
        opts = [(k, v) for k, v in state.items() if isinstance(v, torch.optim.Optimizer)]
        name, module = modules[0]
        return name, module.module if isinstance(module, DistributedDataParallel) else module, opts

    @override
    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any = None, filter: dict[str, Any] | None = None
    ) -> None:
        """Write a checkpoint directory at ``path``, as the Trainer strategy does; collective."""
        if storage_options is not None or filter:
            raise TypeError("rec_sharded writes torch.distributed.checkpoint directories: no storage_options or filter")
        name, module, opts = self._split(state)
        checkpoint = {k: v for k, v in state.items() if k != name and all(k != o for o, _ in opts)}
        checkpoint["state_dict"] = module.state_dict()
        checkpoint["optimizer_states"] = [ckpt.optimizer_state(module, o) for _, o in opts]
        checkpoint["fabric_names"] = {"module": name, "optimizers": [k for k, _ in opts]}
        assert self.mesh_info is not None
        self.core.write_checkpoint(path, module, self.mesh_info, self.world_size, checkpoint)

    @override
    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Restore ``state`` in place from a checkpoint directory (written by either strategy, at any world size
        or plan) and return what the checkpoint holds beyond it. Collective."""
        if not isinstance(state, dict) or not state or not ckpt.is_checkpoint_dir(path):
            if ckpt.is_checkpoint_dir(path):
                raise ValueError(
                    "fabric.load of a rec_sharded checkpoint directory needs the state to restore: "
                    "{'model': model, 'optimizer': optimizer, ...}"
                )
            if self.core.trusted_checkpoints or weights_only is False:
                return super().load_checkpoint(path, state, strict, weights_only=False)
            with refusing_unsafe(path):  # never run code from a file we were not told to trust
                return super().load_checkpoint(path, state, strict, weights_only=True)
        name, module, opts = self._split(state)
        meta = self.core.read_checkpoint(path, module, [o for _, o in opts], strict, weights_only)
        for key in ("optimizer_layouts", "rec_sharding", "fabric_names", "optimizer_states"):
            meta.pop(key, None)
        for key in list(state):
            if key != name and all(key != o for o, _ in opts) and key in meta:
                state[key] = meta.pop(key)
        return meta
