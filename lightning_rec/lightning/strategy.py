"""RecShardedStrategy: DDP for dense parameters, sharded embedding collections for the tables."""

from __future__ import annotations

import shutil
from collections.abc import Generator, Iterable
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.data import sized_len
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from typing_extensions import override

from lightning_rec import _compat
from lightning_rec import checkpoint as ckpt
from lightning_rec._compat import precision_target_dtype
from lightning_rec.checkpoint.safe import refusing_unsafe
from lightning_rec.data.loader import AgreedLoader, ClickLoader
from lightning_rec.distributed.train_pipeline import InputPrefetcher, PipelinedLoader
from lightning_rec.front_end import ignore_in_ddp, warn_unoptimized_tables
from lightning_rec.lightning import shard_setup
from lightning_rec.lightning import trainer_setup as checks
from lightning_rec.lightning.preemption import AgreedStop
from lightning_rec.lightning.shard_setup import ShardSetup, require_popen
from lightning_rec.lightning.uneven import EvaluationSteps
from lightning_rec.pipeline.output_dist import QCommsConfig
from lightning_rec.pipeline.shard_modules import ShardedCollection
from lightning_rec.plans.mesh import MeshInfo
from lightning_rec.plans.plan import ShardingPlan
from lightning_rec.plans.planner import Planner, PlanReport
from lightning_rec.transport import inflight


class RecShardedStrategy(DDPStrategy):
    """Shards every EmbeddingBagCollection / EmbeddingCollection of the LightningModule; DDP for the rest.

    The world is ``data_parallel_size x model_parallel_size`` ranks (default: one model-parallel group per
    node, one replica per node). Each replica group holds one full sharded copy of the tables; plans speak
    in ranks of the model-parallel group. Embedding gradients follow ``embedding_grad`` ("sum": each
    rank's loss contributes its full gradient; "mean": divided by the data-parallel ranks) for every
    sharding type alike; dense parameters are averaged, as DDP does.

    Args:
        plan: a ``ShardingPlan``; else the module's ``configure_sharding()``; else an automatic plan.
        model_parallel_size: ranks per model-parallel group (default: processes per node).
        data_parallel_size: number of replica groups (default: number of nodes).
        embedding_grad: ``"sum"`` (default) or ``"mean"``.
        embedding_optimizer: None (tables are ordinary parameters for ``configure_optimizers``; data-parallel
            tables of collections left at ``sparse_grad=None`` then take sparse gradients where those optimizers
            make that exact, see ``use_sparse_grads_where_possible``), or a fused
            optimizer spec such as ``{"kind": "rowwise_adagrad", "lr": 0.05}``: sharded tables then update
            inside backward (fbgemm). Its optimizer joins the module's: combine ``self.fused_optimizer()``
            into ``configure_optimizers`` (``CombinedOptimizer``) so LR schedulers drive it, or the strategy
            adds it (stepped every step, at its spec's learning rate). Per table:
            ``PerTableOptimizers(default=..., tables={"big_ids": {...}})`` (YAML: ``{default: ..., tables:
            {...}}``); tables sharing a spec share a kernel (and a param group of the fused optimizer). TorchRec's
            ``apply_optimizer_in_backward`` marks on the tables choose their specs too, as under DMP.
        process_group_backend: default nccl on CUDA, gloo on CPU.
        timeout: collective timeout.
        trusted_checkpoints: load checkpoints with full unpickling, which runs any code the files name. Only
            for checkpoints you wrote whose hyper-parameters or callback states hold arbitrary objects; by
            default loading refuses such files (``UnsafeCheckpointError``) and never runs code from them.
        pipeline: input pipelining in training: each training batch is moved to the device and its input dist
            (ids to the shard owners) started while the previous batch trains; the weights are bitwise those
            without. The batch's KeyedJaggedTensor must reach the sharded collection as the loader produced it
            (a new or modified one is looked up unpipelined, with a warning). Batches reach the device before
            ``on_before_batch_transfer`` runs. Managed-collision collections pipeline where they remap on the
            owners (``return_remapped_features=False``); remapping before the input dist is refused. Off by default:
            no speed-up could be shown on the shared 2-core CPU machine (``benchmarks/results/pipeline.md``).
        compile: ``torch.compile`` the LightningModule's forward after sharding (in place, as
            ``nn.Module.compile``; state_dict keys unchanged): True, or a dict of ``torch.compile`` options
            (default ``{"dynamic": True}``: batch sizes and bag lengths change every step). The dense part and
            the local lookups compile; each sharded collection's collectives run eagerly, one graph break each
            (docs/ARCHITECTURE.md, "torch.compile"). ``Trainer.fit(torch.compile(model))`` works too.
        planner_speeds: speeds measured on the job's own data for the automatic plan: the path of a file that
            ``lightning-rec profile`` (or ``ProfiledSpeeds.save``) wrote, or a ``ProfiledSpeeds``; a file from
            another device type is refused. None: the planner's default speeds.
        replicas_within_host: the 2D arrangement over several nodes. False (default): each model-parallel group
            within a node, the replicas across nodes (their sync of the sharded tables crosses the network). True:
            each node holds whole replica groups (``data_parallel_size`` must divide the processes per node) and
            each model-parallel group spreads over the nodes (the embedding exchanges cross). ``"auto"``: the
            automatic plan is made for both and the arrangement it estimates faster is used (the default one with
            a given plan). The math is the same in both (``plans/mesh.py``).
        planner_host_link: the speed of each node's link to the others, for the automatic plan and
            ``replicas_within_host="auto"`` (``"10gbit"``, ``"100Gb/s"``, ``"12.5GB/s"`` or bytes per second); None:
            the link a ``planner_speeds`` profile measured across nodes, else the device's default speeds, which do
            not tell a node's link from its memory on CPU.
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
        pipeline: bool = False,
        compile: bool | dict[str, Any] = False,
        planner_speeds: Any = None,
        replicas_within_host: bool | str = False,
        planner_host_link: int | float | str | None = None,
        **kwargs: Any,
    ) -> None:
        require_popen(kwargs, "RecShardedStrategy")
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, start_method="popen", **kwargs)
        # shared with the Fabric strategy (shard_setup.py)
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
        self._plan = plan
        # the planner of an automatic plan (when none was given), its report
        self.planner: Planner | None = None
        self.plan_report: PlanReport | None = None
        self.embedding_optimizer = self.core.given_embedding_optimizer  # the marks may choose one at setup
        self.mesh_info: MeshInfo | None = None
        self.pipeline = pipeline
        self._prefetcher: InputPrefetcher | None = None
        if not isinstance(compile, (bool, dict)):
            raise TypeError(f"compile must be a bool or a dict of torch.compile options, got {type(compile).__name__}")
        self.compile_options: dict[str, Any] | None = (
            {"dynamic": True, **compile} if isinstance(compile, dict) else {"dynamic": True} if compile else None
        )
        self._stop: AgreedStop | None = None  # SIGTERM agreed over the ranks, while training on several
        self._evaluation = EvaluationSteps()

    @property
    def embedding_grad(self) -> str:
        return self.core.embedding_grad

    @property
    def trusted_checkpoints(self) -> bool:
        """Whether checkpoints load with full unpickling (settable after construction, as examples/dlrm.py does)."""
        return self.core.trusted_checkpoints

    @trusted_checkpoints.setter
    def trusted_checkpoints(self, trusted: bool) -> None:
        self.core.trusted_checkpoints = trusted

    @property
    def _module(self) -> L.LightningModule:
        """The LightningModule, in the hooks that run once the Trainer connected it."""
        module = self.lightning_module
        assert module is not None, "rec_sharded: no LightningModule connected yet"
        return module

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
        if self.lightning_module is not None:
            self.lightning_module._device_mesh = self.mesh_info.mesh

    @override
    def teardown(self) -> None:
        self._end_stop()
        self._evaluation.end()  # an evaluation that raised leaves no hooks on the module
        # collectives still in flight (a loader's status exchange for a batch never asked for) finish here, not
        # while the interpreter shuts down
        inflight.drain()
        super().teardown()

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``empty_init=True`` (``trainer.init_module(empty_init=True)``) builds on the meta device, as
        ModelParallelStrategy does: sharding allocates only each rank's shards, filled from the tables' configs,
        and the dense part gets storage and its ``reset_parameters()`` (not uninitialised memory)."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    @override
    def setup(self, trainer: L.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None and self.mesh_info is not None
        module = self._module
        if trainer.state.fn == TrainerFn.FITTING:
            checks.refuse_model_copies(trainer)  # before any collective: every rank refuses alike
        self.accelerator.setup(trainer)
        # sharded before DDP and before the optimizers see the parameters
        self.embedding_optimizer, self.planner, self.mesh_info = self.core.shard(
            module, self.mesh_info, self.root_device, self.world_size, checks.batch_size(module)
        )
        module._device_mesh = self.mesh_info.mesh  # the arrangement the planner chose, where it chose one
        if self.compile_options is not None:
            module.compile(**self.compile_options)  # traced lazily, on the sharded modules
        # "*-true" precision converts the dense model; tables keep the dtype their config fixed
        target = precision_target_dtype(self.precision_plugin)
        for m in module.modules():
            if isinstance(m, ShardedCollection) and target is not None:
                m.keep_table_dtypes(target)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self._check_fused_trainer(trainer)
            if self.pipeline:  # after sharding: it finds the sharded collections
                self._prefetcher = InputPrefetcher(module, "RecShardedStrategy(pipeline=True)")
            self.configure_ddp()
            self.setup_optimizers(trainer)
            self.optimizers = checks.with_fused_optimizer(module, self.optimizers)
            warn_unoptimized_tables(module, self.optimizers)
            self._explain_plan()
            checks.choose_dp_gradients(trainer, module, self.optimizers, self.precision_plugin)
        else:
            checks.sync_dense_states(module)
            self._explain_plan()
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            checks.clip_by_global_norm(self.precision_plugin, module)
            _compat.optimizers_to_device(self.optimizers, self.root_device)
            checks.sync_grad_scaler(self.precision_plugin)

    def _explain_plan(self) -> None:
        if self.planner is not None:
            self.plan_report = checks.explain_plan(self.planner, self._module, self.optimizers)

    def _check_fused_trainer(self, trainer: L.Trainer) -> None:
        checks.check_fused_trainer(trainer, self.lightning_module, self.precision_plugin, self.embedding_optimizer)

    # -- every rank must run the same number of batches: each sharded lookup is a collective ---------------

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Loaders without a length (iterable datasets) agree on every batch across ranks: a rank that runs out
        while others have more raises on every rank at that step, instead of a hang (sized loaders are checked
        once per stage; ClickLoader agrees by itself)."""
        dataloader = super().process_dataloader(dataloader)
        agrees = isinstance(dataloader, (ClickLoader, AgreedLoader))
        if self.world_size > 1 and not agrees and sized_len(dataloader) is None:
            dataloader = AgreedLoader(cast(Iterable[Any], dataloader), what="rec_sharded dataloader")
        if self._prefetcher is not None and self._module.trainer.training:
            device = self.root_device
            dataloader = PipelinedLoader(
                cast(Iterable[Any], dataloader), self._prefetcher, lambda b: move_data_to_device(b, device)
            )
        return dataloader

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.world_size > 1:  # Lightning registered its SIGTERM handler before this hook
            self._stop = AgreedStop(self.launcher)
        checks.check_equal_batch_counts(self.world_size, "training", self._module.trainer.num_training_batches)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._stop is not None:
            self._stop.check()  # collective: every rank stops before the same batch

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._prefetcher is None:
            return super().training_step(*args, **kwargs)
        # the step's forward takes the input dists PipelinedLoader started for its batch
        with self._prefetcher.feeding_step(args[0] if args else None):
            return super().training_step(*args, **kwargs)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self._end_stop()
        if self._prefetcher is not None:
            self._prefetcher.clear()  # a batch read ahead past the last step trained

    def _end_stop(self) -> None:
        if self._stop is not None:
            self._stop.close()
            self._stop = None

    # -- evaluation: ranks may run different numbers of batches (uneven.py) ----------------------------------

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation.run(super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation.run(super().test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation.run(super().predict_step, *args, **kwargs)

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        trainer = self._module.trainer
        counts = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
        self._evaluation.start(self._module, "validation", counts, self.world_size)

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        self._evaluation.end()

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._evaluation.start(self._module, "test", self._module.trainer.num_test_batches, self.world_size)

    @override
    def on_test_end(self) -> None:
        super().on_test_end()
        self._evaluation.end()

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        counts = self._module.trainer.num_predict_batches
        self._evaluation.start(self._module, "prediction", counts, self.world_size)

    @override
    def on_predict_end(self) -> None:
        super().on_predict_end()
        self._evaluation.end()

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:  # type: ignore[override]  # returns model unwrapped too
        if not ignore_in_ddp(model, self.lightning_module):
            return model  # nothing dense to keep in sync
        return _compat.ddp_on_current_stream(self, model)

    # -- checkpoints: torch.distributed.checkpoint directories (see lightning_rec.checkpoint) --------------

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # checkpoints load into the sharded model, whatever plan wrote them

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores optimizers by parameter name

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state_dict under the unsharded keys: DTensors for sharded tables, plain tensors else.

        Collective only in the sense that every rank contributes its shards when the checkpoint is saved.
        """
        assert self.lightning_module is not None
        return self.lightning_module.state_dict()

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Optimizer state keyed by parameter name, sharded like the tables. Collective."""
        return ckpt.optimizer_state(self._module, optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write a checkpoint directory at ``filepath`` (DCP shards + ``meta.pt``); collective.

        The directory appears only when complete, so a save killed part-way leaves the previous one intact.
        """
        if storage_options is not None:
            raise TypeError(
                "RecShardedStrategy.save_checkpoint writes torch.distributed.checkpoint directories and "
                "takes no storage_options"
            )
        assert self.mesh_info is not None and self.lightning_module is not None
        self.core.write_checkpoint(filepath, self.lightning_module, self.mesh_info, self.world_size, checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint directory into the sharded model and optimizers (any plan/world size wrote it).

        A single-file checkpoint (e.g. from a one-process run) loads its weights; its optimizer state, keyed
        by position in another model's parameter list, cannot be remapped and is refused.
        """
        module = self.lightning_module
        assert module is not None
        path = checkpoint_path
        fitting = _compat.attached_trainer(module) is not None and module.trainer.state.fn == TrainerFn.FITTING
        optimizers = self.optimizers if fitting else []
        if ckpt.is_checkpoint_dir(path):
            meta = self.core.read_checkpoint(path, module, optimizers, module.strict_loading, weights_only)
            if "pytorch-lightning_version" not in meta:
                # written without the Trainer (Fabric, checkpoint.save): the model and optimizers are restored;
                # no Lightning state to migrate, loops and LR schedulers start anew
                meta.update({"pytorch-lightning_version": L.__version__, "lr_schedulers": []})
            if fitting:
                meta["optimizer_states"] = []  # restored above; Lightning only checks the key exists
            return meta
        if self.trusted_checkpoints or weights_only is False:
            loaded = super().load_checkpoint(path, weights_only=False)
        else:
            with refusing_unsafe(path):  # never run code from a file we were not told to trust
                loaded = super().load_checkpoint(path, weights_only=True)
        module.load_state_dict(loaded["state_dict"], strict=module.strict_loading)
        if fitting and any(s.get("state") for s in loaded.get("optimizer_states", [])):
            raise ValueError(
                f"{path} is a single-file checkpoint whose optimizer state is keyed by position in the unsharded "
                "model's parameters and cannot be remapped onto shards. Load its weights instead "
                "(model.load_state_dict(torch.load(path)['state_dict']) before fit), or resume from a "
                "checkpoint directory written by rec_sharded"
            )
        return loaded

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # load_checkpoint already did

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # load_checkpoint already did

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            p = Path(filepath)
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
