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
from lightning.pytorch import callbacks
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_rec import _compat
from lightning_rec import checkpoint as ckpt
from lightning_rec._compat import precision_target_dtype
from lightning_rec.checkpoint.safe import refusing_unsafe
from lightning_rec.data.loader import AgreedLoader, ClickLoader
from lightning_rec.distributed.train_pipeline import InputPrefetcher, PipelinedLoader
from lightning_rec.optim import CombinedOptimizer
from lightning_rec.pipeline.clip_grad_norm import clip_grad_norm_
from lightning_rec.pipeline.dp_sparse_grad import use_sparse_grads_where_possible
from lightning_rec.pipeline.qcomm import QCommsConfig
from lightning_rec.pipeline.shard_modules import ShardedCollection, dense_state, fused_optimizer
from lightning_rec.plans.mesh import MeshInfo
from lightning_rec.plans.plan import ShardingPlan
from lightning_rec.plans.planner import Planner, PlanReport
from lightning_rec.preemption import AgreedStopHooks
from lightning_rec.shard_setup import ShardedFrontEnd, ShardSetup, ignore_in_ddp, require_popen
from lightning_rec.table_optimizers import automatic_plan_report, warn_unoptimized_tables
from lightning_rec.uneven import UnevenEvaluationHooks


class RecShardedStrategy(AgreedStopHooks, UnevenEvaluationHooks, ShardedFrontEnd, DDPStrategy):
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
    """

    strategy_name = "rec_sharded"

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

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.lightning_module is not None:
            assert self.mesh_info is not None  # the front end's setup_environment builds it
            self.lightning_module._device_mesh = self.mesh_info.mesh

    def _shard(self) -> None:
        module = self.lightning_module
        assert module is not None and self.mesh_info is not None
        batch_size = None  # the planner's, found as Lightning's batch-size finder does
        try:
            if lightning_hasattr(module, "batch_size"):
                # None raises TypeError, caught below
                batch_size = int(lightning_getattr(module, "batch_size"))  # type: ignore[arg-type]
        except (AttributeError, TypeError, ValueError):
            pass
        self.embedding_optimizer, self.planner = self.core.shard(
            module, self.mesh_info, self.root_device, self.world_size, batch_size
        )

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
        assert self.accelerator is not None and self.model is not None
        if trainer.state.fn == TrainerFn.FITTING:
            self._refuse_model_copies(trainer)  # before any collective: every rank refuses alike
        self.accelerator.setup(trainer)
        self._shard()  # before DDP and before the optimizers see the parameters
        if self.compile_options is not None:
            self.lightning_module.compile(**self.compile_options)  # traced lazily, on the sharded modules
        # "*-true" precision converts the dense model; tables keep the dtype their config fixed
        target = precision_target_dtype(self.precision_plugin)
        for m in self.lightning_module.modules():
            if isinstance(m, ShardedCollection) and target is not None:
                m.keep_table_dtypes(target)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self._check_fused_trainer(trainer)
            if self.pipeline:  # after sharding: it finds the sharded collections
                self._prefetcher = InputPrefetcher(self.lightning_module, "RecShardedStrategy(pipeline=True)")
            self.configure_ddp()
            self.setup_optimizers(trainer)
            self._add_fused_optimizer()
            warn_unoptimized_tables(self.lightning_module, self.optimizers)
            self._explain_plan()
            self._choose_dp_gradients(trainer)
        else:
            self._sync_dense_states()
            self._explain_plan()
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            self._clip_by_global_norm()
            _compat.optimizers_to_device(self.optimizers, self.root_device)
            self._sync_grad_scaler()

    def _explain_plan(self) -> None:
        if self.planner is not None:
            self.plan_report = report = automatic_plan_report(self.planner, self.lightning_module, self.optimizers)
            rank_zero_info(f"lightning_rec: no sharding plan given; the planner chose:\n{report}")

    def _clip_by_global_norm(self) -> None:
        # Lightning's norm clipping calls torch's clip_grad_norm_, which would see only this rank's shards:
        # each rank would scale by its own factor. The norm over every table once keeps the one-process answer.
        plugin, model = self.precision_plugin, self.lightning_module

        def clip_grad_by_norm(optimizer: torch.optim.Optimizer, clip_val: float) -> None:
            clip_grad_norm_(model, plugin.main_params(optimizer), clip_val)

        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]

    def _choose_dp_gradients(self, trainer: L.Trainer) -> None:
        # data-parallel tables take sparse gradients where the optimizers make that exact (grad_mode.py);
        # clipping (Lightning's or the module's own hook), loss scaling and manual optimization keep them dense
        module = self.lightning_module
        clipping = (
            bool(trainer.gradient_clip_val)
            or not module.automatic_optimization
            or is_overridden("configure_gradient_clipping", module, L.LightningModule)
        )
        use_sparse_grads_where_possible(
            module,
            self.optimizers,
            gradient_clipping=clipping,
            grad_scaler=getattr(self.precision_plugin, "scaler", None),
        )

    def _sync_grad_scaler(self) -> None:
        # Each rank sees only its own shards' gradients: a rank whose shards overflowed would skip the step
        # while the others take it, and replicas would silently diverge. Agree on "found inf" over the world.
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:
            # the plugins with a scaler (mixed precision, FSDP's) share no base class that declares it
            cast(Any, self.precision_plugin).scaler = _compat.synced_grad_scaler(scaler, torch.distributed.group.WORLD)

    @staticmethod
    def _refuse_model_copies(trainer: L.Trainer) -> None:
        # weight averaging copies the LightningModule in its setup hook, before sharding: the copy holds whole
        # tables, the live model this rank's shards, and averaging them fails on mismatched shapes (or, where
        # shapes happen to agree, averages unrelated rows)
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

    def _check_fused_trainer(self, trainer: L.Trainer) -> None:
        if self.embedding_optimizer is None:
            return
        fused = fused_optimizer(self.lightning_module) if self.lightning_module is not None else None
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
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:
            raise ValueError(
                f"precision {getattr(self.precision_plugin, 'precision', '16-mixed')!r} scales the loss with a "
                "GradScaler, which cannot reach fused embedding tables: they are updated inside backward with the "
                "scaled gradient, before the scaler could unscale it or skip the step. Use precision='bf16-mixed' "
                "(no loss scaling) or '32-true', or embedding_optimizer=None"
            )

    # -- every rank must run the same number of batches: each sharded lookup is a collective ---------------

    def _check_equal_batch_counts(self, stage: str, counts: Any) -> None:
        if self.world_size == 1:
            return
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, counts)
        if any(c != gathered[0] for c in gathered):
            raise ValueError(
                f"rec_sharded: ranks would run different numbers of {stage} batches per epoch (by rank: {gathered}). "
                "Every rank must run the same number of training batches, since every sharded lookup and every "
                "gradient reduction is a collective across ranks: a rank with an extra batch would wait forever. "
                "Use Lightning's distributed sampler (use_distributed_sampler=True, the default), DataLoaders of "
                "equal length on every rank, or limit_train_batches"
            )

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Loaders without a length (iterable datasets) agree on every batch across ranks: a rank that runs out
        while others have more raises on every rank at that step, instead of a hang (sized loaders are checked
        once per stage; ClickLoader agrees by itself)."""
        dataloader = super().process_dataloader(dataloader)
        agrees = isinstance(dataloader, (ClickLoader, AgreedLoader))
        if self.world_size > 1 and not agrees and sized_len(dataloader) is None:
            dataloader = AgreedLoader(cast(Iterable[Any], dataloader), what="rec_sharded dataloader")
        if self._prefetcher is not None and self.lightning_module.trainer.training:
            device = self.root_device
            dataloader = PipelinedLoader(
                cast(Iterable[Any], dataloader), self._prefetcher, lambda b: move_data_to_device(b, device)
            )
        return dataloader

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._check_equal_batch_counts("training", self.lightning_module.trainer.num_training_batches)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self._prefetcher is not None:
            self._prefetcher.clear()  # a batch read ahead past the last step trained

    def _add_fused_optimizer(self) -> None:
        fused = fused_optimizer(self.lightning_module) if self.lightning_module is not None else None
        if fused is None:
            return
        inside = any(o is fused or fused in getattr(o, "optimizers", ()) for o in self.optimizers)
        if not inside:
            # the user's configure_optimizers did not include it: step it with theirs, at the spec's lr
            self.optimizers = [CombinedOptimizer([*self.optimizers[:1], fused]), *self.optimizers[1:]]

    def _sync_dense_states(self) -> None:
        # without DDP (validate / test / predict) dense replicas still start equal; shards are per rank
        for t in dense_state(self.lightning_module):
            torch.distributed.broadcast(t.data, src=0)

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
        return ckpt.optimizer_state(self.lightning_module, optimizer)

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
