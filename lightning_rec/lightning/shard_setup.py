"""What both Lightning front ends (the Trainer's ``RecShardedStrategy`` and Fabric's ``RecShardedFabricStrategy``) do
to a model and a job: the 2D mesh, the plan, sharding, checkpoint directories (:class:`ShardSetup`, which each
strategy owns), and the plain functions each strategy's own hooks call (the indexed CUDA device, the registry
name, the environment, the launcher, ``start_method``).

One copy, so a checkpoint written under one front end resumes under the other, and a model trains the same
under both (same plan resolution, gradient convention, fused kernels, agreement checks, timeouts). The sharding
itself and DDP's ignore list are ``front_end``'s, which ``DistributedModelParallel`` calls too. As Lightning's
Trainer strategies import the functions of its Fabric strategies, the strategies here call these functions from
hook methods they write out; neither inherits anything but Lightning's ``DDPStrategy``.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch
from torch import nn

from lightning_rec import _compat, front_end
from lightning_rec import checkpoint as ckpt
from lightning_rec.front_end import resolve_table_optimizers
from lightning_rec.fused_kinds import EmbeddingOptimizer, as_table_optimizers, summary
from lightning_rec.lightning import child_exits
from lightning_rec.pipeline.collectives import grad_scale
from lightning_rec.pipeline.output_dist import QCommsConfig, get_qcomm_codecs_registry
from lightning_rec.plans.mesh import MeshInfo, check_layout, group_local_size, init_2d_mesh
from lightning_rec.plans.plan import ShardingPlan
from lightning_rec.plans.planner import Planner, automatic_plan, choose_arrangement
from lightning_rec.plans.planner.topology import parse_rate
from lightning_rec.transport import inflight

STRATEGY_NAME = "rec_sharded"


def require_popen(kwargs: dict[str, Any], who: str) -> None:
    """Refuse a ``start_method`` other than ``"popen"`` (taking it out of ``kwargs``): the spawn launchers copy
    rank 0's state back into the main process, which holds only rank 0's shards of each table."""
    start_method = kwargs.pop("start_method", "popen")
    if start_method != "popen":
        raise ValueError(
            f"{who} launches processes like strategy='ddp' (start_method='popen'), got {start_method!r}: the spawn "
            "launchers copy rank 0's state_dict back into the main process, which holds only rank 0's shards of "
            "each table"
        )


def indexed_device(device: torch.device, local_rank: int) -> torch.device:
    """``device``, a CUDA device given its index (this process's local rank) where it has none:
    ``init_process_group(device_id=...)`` and DTensor placements refuse a CUDA device without one."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", local_rank)
    return device


def register(strategy_registry: Any, strategy: type) -> None:
    """Register ``strategy`` as ``"rec_sharded"`` in a Lightning or Fabric strategy registry, unless the name is
    taken (Lightning scans only its own modules for strategies: a plugin registers at import)."""
    if STRATEGY_NAME not in strategy_registry:
        strategy_registry.register(STRATEGY_NAME, strategy, description="Sharded embedding tables + DDP")


def report_child_exits(strategy: Any) -> None:
    """Make the launcher a Lightning strategy configured report ranks that fail after rank 0 finished
    (``child_exits``), so the job fails too."""
    _compat.set_strategy_launcher(strategy, child_exits.reporting(_compat.strategy_launcher(strategy)))


class _ChoosesPlan(Protocol):
    """A module that places its own tables (``RecModule.configure_sharding``)."""

    def configure_sharding(self) -> ShardingPlan | None: ...


class ShardSetup:
    """The sharding settings both strategies take, and what they do with them.

    Args: as :class:`~lightning_rec.lightning.strategy.RecShardedStrategy`'s ``plan``, ``model_parallel_size``,
    ``data_parallel_size``, ``embedding_grad``, ``embedding_optimizer``, ``trusted_checkpoints``, ``qcomms_config``
    and ``planner_speeds`` (the automatic plan's measured speeds, a ``ProfiledSpeeds`` or the path of its file from
    ``lightning-rec profile``; None: the default speeds), ``replicas_within_host`` (the 2D arrangement: False, True
    or ``"auto"``, see ``plans/mesh.py``) and ``planner_host_link`` (the hosts' link speed for the automatic plan,
    ``Topology.host_link``).
    """

    def __init__(
        self,
        plan: ShardingPlan | None,
        model_parallel_size: int | None,
        data_parallel_size: int | None,
        embedding_grad: str,
        embedding_optimizer: Any,
        trusted_checkpoints: bool,
        qcomms_config: QCommsConfig | None = None,
        planner_speeds: Any = None,
        replicas_within_host: bool | str = False,
        planner_host_link: int | float | str | None = None,
    ) -> None:
        grad_scale(embedding_grad, 1)  # validates the mode now, not at fit time
        if replicas_within_host not in (False, True, "auto"):
            raise ValueError(f"replicas_within_host must be False, True or 'auto', got {replicas_within_host!r}")
        self.replicas_within_host = replicas_within_host
        if planner_host_link is not None:
            parse_rate(planner_host_link, "planner_host_link")  # a bad rate is refused now, not at fit time
        self.planner_host_link = planner_host_link
        self.ranks_per_host = 0  # set by setup_environment
        if qcomms_config is not None and not isinstance(qcomms_config, QCommsConfig):
            raise TypeError(f"qcomms_config must be a QCommsConfig, got {type(qcomms_config).__name__}")
        self.qcomms_config = qcomms_config
        if plan is not None and not isinstance(plan, ShardingPlan):
            raise TypeError(f"plan must be a ShardingPlan, got {type(plan).__name__}")
        self.plan = plan
        self.model_parallel_size = model_parallel_size
        self.data_parallel_size = data_parallel_size
        self.embedding_grad = embedding_grad
        self.given_embedding_optimizer = as_table_optimizers(embedding_optimizer)
        self.trusted_checkpoints = trusted_checkpoints
        self.planner_speeds = planner_speeds

    def setup_environment(self, world_size: int, num_processes: int, num_nodes: int, device: torch.device) -> MeshInfo:
        """A strategy's ``setup_environment`` once the process group exists: the exit handler that waits for
        collectives still in flight, then the ``replicas x model_parallel_size`` mesh (default: one model-parallel
        group per node). Collective."""
        inflight.install_exit_hook()  # after Lightning's exit handler: runs before it
        mp, dp = self.model_parallel_size, self.data_parallel_size
        if mp is None and dp is None:
            mp, dp = num_processes, num_nodes
        replicas, mp = check_layout(world_size, mp, dp)
        self.ranks_per_host = num_processes  # one host holds this node's processes
        within = self.replicas_within_host is True
        local = group_local_size(num_processes, replicas, mp, within)
        return init_2d_mesh(mp, replicas, "cuda" if device.type == "cuda" else "cpu", local, within)

    def shard(
        self, module: nn.Module, mesh: MeshInfo, device: torch.device, world_size: int, batch_size: int | None = None
    ) -> tuple[EmbeddingOptimizer | None, Planner | None, MeshInfo]:
        """Shard every collection of ``module`` in place; collective.

        The plan is the one given, else ``module.configure_sharding()``, else the planner's (whose planner is
        returned, to be explained once the optimizers exist). TorchRec's ``apply_optimizer_in_backward`` marks
        choose the tables' fused optimizers, as under DMP (``front_end.resolve_table_optimizers``); returns
        what the tables train with (``fused_kinds.summary``), the planner and the mesh the tables are sharded on:
        with ``replicas_within_host="auto"`` and the planner's plan, the arrangement whose plan the planner
        estimates faster (a new mesh where that is not ``mesh``'s).
        """
        plan = self.plan
        if plan is None and hasattr(module, "configure_sharding"):
            plan = cast(_ChoosesPlan, module).configure_sharding()
        specs = resolve_table_optimizers(module, self.given_embedding_optimizer)
        planner = None
        if plan is None:
            kw: dict[str, Any] = {"device": "cuda" if device.type == "cuda" else "cpu"}
            if batch_size is not None:
                kw["batch_size"] = batch_size
            if device.type == "cuda":
                kw["device_memory"] = torch.cuda.get_device_properties(device).total_memory
            if self.planner_speeds is not None:
                kw["speeds"] = self.planner_speeds
            if self.planner_host_link is not None:
                kw["host_link"] = self.planner_host_link
            mp = mesh.model_parallel_size
            if self.replicas_within_host == "auto":
                # arithmetic on the configs alone: every rank picks the same arrangement
                pick = choose_arrangement(module, mp, world_size, self.ranks_per_host, table_optimizers=specs, **kw)
                if pick.replicas_within_host != mesh.replicas_within_host:
                    device_type = "cuda" if device.type == "cuda" else "cpu"
                    mesh = init_2d_mesh(mp, mesh.data_parallel_size, device_type, pick.local_size, True)
                planner = pick.planner  # its plan is made
            else:
                kw["replicas_within_host"] = mesh.replicas_within_host
                planner = automatic_plan(module, mp, mesh.local_size, world_size, table_optimizers=specs, **kw)
                planner.plan(module)
            plan = planner.explain().plan
            planner = planner if plan.plan else None
        front_end.shard(
            module,
            plan,
            specs,
            process_group=mesh.shard_group,
            replica_group=mesh.replica_group,
            device=device,
            embedding_grad=self.embedding_grad,
            local_size=mesh.local_size,
            qcomm_codecs_registry=get_qcomm_codecs_registry(self.qcomms_config),
            # a dense part built on the meta device (configure_model under torch.device("meta"), as for
            # ModelParallelStrategy) gets storage and its modules' own initialisation, as DMP gives it
            materialize_as="rec_sharded",
        )
        return summary(specs), planner, mesh

    @staticmethod
    def sharding_record(module: nn.Module, mesh: MeshInfo, world_size: int) -> dict[str, Any]:
        """What a checkpoint records of the layout that wrote it."""
        return {
            "world_size": world_size,
            "model_parallel_size": mesh.model_parallel_size,
            "data_parallel_size": world_size // mesh.model_parallel_size,
            "tables": ckpt.sharding_layout(module),
        }

    def write_checkpoint(
        self, path: Any, module: nn.Module, mesh: MeshInfo, world_size: int, checkpoint: dict[str, Any]
    ) -> None:
        """Write Lightning's checkpoint dict (``state_dict``, ``optimizer_states`` as ``ckpt.optimizer_state``
        gives them, anything else) as a checkpoint directory; collective and all-or-nothing."""
        checkpoint = dict(checkpoint)
        tensors: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
        layouts = []
        for i, state in enumerate(checkpoint.pop("optimizer_states", None) or []):
            tensors[f"optimizer_{i}"] = state["tensors"]
            layouts.append(state["meta"])
        checkpoint["optimizer_layouts"] = layouts
        checkpoint["rec_sharding"] = self.sharding_record(module, mesh, world_size)
        ckpt.write(path, tensors, checkpoint)

    def read_checkpoint(
        self,
        path: Any,
        module: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        strict: bool,
        weights_only: bool | None,
    ) -> dict[str, Any]:
        """Load a checkpoint directory into ``module`` and ``optimizers`` (any plan or world size wrote it);
        returns the rest of what it holds. Collective."""
        meta = ckpt.load(
            path, module, optimizers, strict=strict, trusted=self.trusted_checkpoints or weights_only is False
        )
        meta.pop("format", None)
        return meta
