"""The fused kernel: fbgemm's split table-batched lookup whose optimizer runs inside backward, pooled (one row
per bag) or not (one row per id: sequence lookups).

The tables are views of fbgemm's own storage, registered as ``<table>.weight`` so the state_dict matches an
unsharded collection's; fbgemm's module itself (its weights, and momentum, which it registers as a
parameter) stays out of ``parameters()`` and ``state_dict()``. What the kinds keep is in
:mod:`lightning_rec.fused_kinds`.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from lightning_rec import _compat
from lightning_rec.fused_kinds import FusedOptimizerSpec, as_spec
from lightning_rec.kernels._accumulate import MicroBatch, deferred_lookup, drop_kept_rows, union_of
from lightning_rec.kernels._guards import (
    _FusedBackwardGuard,
    _FusedStepCounter,
    _ScaleGrad,
    check_feature_table,
    check_ids,
    check_offsets,
    check_pooling,
    check_tables,
)
from lightning_rec.kernels._tables import FusedTable, build_split_tbe, check_split_tbe, unexpected_table_keys
from lightning_rec.memory import keep_freed_memory, zero_into_huge_pages


class FusedPooledKernel(torch.nn.Module):
    """SUM-pooled (or unpooled) lookup over several tables whose optimizer runs inside backward (fbgemm split TBE).

    One ``SplitTableBatchedEmbeddingBagsCodegen`` (CPU: ``ComputeDevice.CPU`` + ``EmbeddingLocation.HOST``;
    CUDA: ``EmbeddingLocation.DEVICE``) holds every table; on CPU, the Adam family (no fbgemm CPU kernel) runs
    its torch stand-in with fbgemm's CUDA update and state (``kernels/_torch_adam.py``). Backward through
    :meth:`forward`'s output applies the optimizer update to the tables directly; nothing gets a ``.grad``.
    MEAN pooling is the caller's job.

    Args:
        tables: ``(name, rows, dim, dtype)`` per table. ``dim`` must be a multiple of 4, ``dtype`` float32 or
            float16 (one dtype for all tables; float32 for the Adam family on CPU), ``rows >= 1``. Names must be
            unique.
        feature_table: the table of each feature, in input order. Must be non-decreasing (fbgemm's Adagrad
            kernels are wrong or crash otherwise: docs/ARCHITECTURE.md F2), and every table needs a feature.
        optimizer: a :class:`~lightning_rec.optim.FusedOptimizerSpec` (or a dict of its fields).
        device: ``cpu`` (default) or a CUDA device. The kernel cannot be moved or converted afterwards.
        weights: optional initial ``[rows, dim]`` weight per table (copied in), or a function filling the
            kernel's ``[rows, dim]`` storage in place (e.g. a table's init, on a model built on the meta
            device). Default: uniform in
            ``+-sqrt(1 / rows)``, TorchRec's default (fbgemm itself starts at zero).
        pooling: ``"sum"`` (default): :meth:`forward` returns one pooled row per bag. ``"none"``: one row per
            id, for sequence lookups (fbgemm's ``PoolingMode.NONE``; the Adam family's torch stand-in on CPU):
            every table must have the same dim (fbgemm's no-bag mode has one width), and lookups take no
            per-sample weights. :class:`FusedSequenceKernel` is this kernel with ``pooling="none"``.

    Tables: :meth:`tables` returns one leaf ``nn.Parameter`` per table, a view of the kernel's storage
    (``requires_grad=False``, so no torch optimizer or DDP touches them). They are registered as
    ``<table name>.weight`` in this module's ``state_dict``, whose values therefore share storage with what
    the kernel updates; ``load_state_dict`` copies into that storage. The fbgemm module's own parameters and
    buffers (weights, momentum: fbgemm registers momentum as a parameter, F9) are kept out of
    ``parameters()`` and ``state_dict()``; optimizer state goes through :meth:`optimizer_states`.

    Guards: ids outside ``[0, rows)`` (including -1, which passes fbgemm's bounds check, F14) raise a
    ValueError before the kernel. By default the update happens in backward, so a second backward through one
    output, or through the kernel before :meth:`finish_step` (which ``FusedOptimizer.step`` calls), raises a
    RuntimeError. With :attr:`accumulate` on, backward keeps each lookup's gradient and :meth:`finish_step`
    applies one update from their sum (gradient accumulation, several losses per step).
    """

    _tbe: Any  # fbgemm's split TBE (or TorchAdamTBE), set past nn.Module's registry (its tables are our parameters)

    def __init__(
        self,
        tables: Sequence[tuple[str, int, int, torch.dtype]],
        feature_table: Sequence[int],
        optimizer: FusedOptimizerSpec | Mapping[str, Any],
        device: torch.device | str | None = None,
        weights: Sequence[torch.Tensor | Callable[[torch.Tensor], object]] | None = None,
        pooling: str = "sum",
    ) -> None:
        super().__init__()
        spec = as_spec(optimizer)
        if spec is None:
            raise ValueError("FusedPooledKernel needs a fused optimizer spec, got None")
        dev = torch.device("cpu" if device is None else device)
        optim_type = check_split_tbe(spec, dev)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        names, rows, dims, dtype = check_tables(tables)
        pooling = check_pooling(pooling, names, dims)
        feature_table = check_feature_table(feature_table, names, pooled=pooling == "sum")
        on_cpu = dev.type == "cpu"
        if on_cpu:
            keep_freed_memory()  # memory.py: the step's large tensors reuse memory, not fresh pages
        tbe = build_split_tbe(spec, optim_type, names, rows, dims, dtype, feature_table, dev, pooling)
        # Not a registered submodule: its parameters and buffers stay out of parameters() and state_dict().
        object.__setattr__(self, "_tbe", tbe)
        self.spec = spec
        self.optim_type = optim_type
        self.table_names: list[str] = names
        self.rows: list[int] = rows
        self.dims: list[int] = dims
        self.dtype = dtype
        self.device = dev
        self.pooling = pooling
        self.feature_table: list[int] = feature_table
        self.feature_dims: list[int] = [dims[t] for t in feature_table]
        # the width of forward's output
        self.total_dim = sum(self.feature_dims) if pooling == "sum" else dims[0]
        self._rows_per_feature = torch.tensor([rows[t] for t in feature_table], dtype=torch.long, device=dev)
        self._counter = _FusedStepCounter()
        self._lr = float(spec.lr)  # the value last pushed into fbgemm (fbgemm keeps it as float32)
        self._owner: tuple | None = None  # (weakref to FusedOptimizer, group index)
        self._accumulate = False
        self._pending: list[MicroBatch] = []  # lookups whose gradient waits for finish_step
        # the deferred lookup's output needs an input that requires grad to join the graph; it gets no gradient
        self._anchor = torch.zeros(0, device=dev, requires_grad=True)

        host = getattr(tbe, "weights_host", None)
        if on_cpu and isinstance(host, torch.Tensor):  # the fill below faults in 2 MiB pages (memory.py)
            zero_into_huge_pages(host.data)
        views = tbe.split_embedding_weights()
        with torch.no_grad():
            if weights is None:
                for v, r in zip(views, rows):
                    bound = math.sqrt(1.0 / r)
                    v.uniform_(-bound, bound)
            else:
                weights = list(weights)
                if len(weights) != len(names):
                    raise ValueError(f"got {len(weights)} initial weights for {len(names)} tables {names}")
                for v, w, name in zip(views, weights, names):
                    if callable(w):  # fills the kernel's storage in place: no copy of the table on the way
                        w(v)
                        continue
                    if tuple(w.shape) != tuple(v.shape):
                        raise ValueError(
                            f"table {name!r}: initial weight has shape {tuple(w.shape)}, expected {tuple(v.shape)}"
                        )
                    v.copy_(w)
        for name, v in zip(names, views):
            _compat.child_modules(self)[name] = FusedTable(torch.nn.Parameter(v, requires_grad=False))
        self._ptrs = [v.data_ptr() for v in views]

    # -- tables -------------------------------------------------------------------------------------------

    def tables(self) -> list[torch.nn.Parameter]:
        """One leaf ``nn.Parameter`` per table (``[rows, dim]``, ``requires_grad=False``), views of the kernel's
        storage: the kernel's updates are visible in them, and writes to them reach the kernel."""
        return [_compat.child_modules(self)[name].weight for name in self.table_names]  # type: ignore[union-attr, misc]

    def _check_aliases(self) -> None:
        for name, p, ptr in zip(self.table_names, self.tables(), self._ptrs):
            if p.data_ptr() != ptr or p.dtype != self.dtype or p.device != self.device:
                raise RuntimeError(
                    f"the parameter of table {name!r} no longer shares storage with its FusedPooledKernel (it was "
                    "replaced, moved or converted, e.g. by .to(), .half() or param.data = ...). The fused kernel "
                    "updates its own storage; build the kernel on the target device and dtype instead"
                )

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> FusedPooledKernel:  # type: ignore[override]
        self._refuse_conversion(fn)
        return super()._apply(fn, recurse)

    def _refuse_conversion(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        # .to() / .cuda() / .half() would give the table parameters new storage the kernel never sees.
        for name, p in zip(self.table_names, self.tables()):
            q = fn(p)
            if q is not p and (q.data_ptr() != p.data_ptr() or q.dtype != p.dtype or q.device != p.device):
                raise RuntimeError(
                    f"a FusedPooledKernel cannot be moved or converted after construction (table {name!r} would go "
                    f"from {p.dtype} on {p.device} to {q.dtype} on {q.device}); build it on the target device "
                    "with the target dtype"
                )

    def _load_from_state_dict(  # type: ignore[override]
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # nn.Module splits keys at the first "." to find the child, so a table named "user.id" would make its
        # own key look unexpected; check against the tables' keys instead.
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, False, missing_keys, unexpected_keys, error_msgs
        )
        if strict:
            own = [f"{prefix}{name}.weight" for name in self.table_names]
            unexpected_keys.extend(unexpected_table_keys(state_dict, prefix, own))

    def __deepcopy__(self, memo: dict[int, Any]) -> FusedPooledKernel:
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        new._owner = None
        new._counter = _FusedStepCounter()
        new._pending = []
        # nn.Parameter's deepcopy clones its data: point the copies back into the copied kernel's storage
        views = new._tbe.split_embedding_weights()
        for p, v in zip(new.tables(), views):
            p.data = v
        new._ptrs = [v.data_ptr() for v in views]
        return new

    # -- forward ------------------------------------------------------------------------------------------

    def forward(
        self,
        values: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
        grad_scale: float = 1.0,
        ids_checked: bool = False,
    ) -> torch.Tensor:
        """SUM-pooled ``[B, sum of feature dims]`` (columns in feature order) from feature-major inputs; without
        pooling, ``[len(values), dim]``: each id's row, ids in input order.

        ``offsets`` has ``len(feature_table) * B + 1`` entries (bags of feature 0, then feature 1, ...); without
        pooling they say which feature (so which table) each id reads. Without pooling there are no
        ``per_sample_weights``.
        ``grad_scale`` multiplies the gradient that reaches the tables' update (e.g. ``1 / world_size``);
        the gradient of ``per_sample_weights`` is not scaled. ``ids_checked=True``: the caller built
        ``offsets`` itself and already checked every id against its table's rows (the sharded collections
        do, once per step); the kernel then skips its own pass over the ids.
        """
        if values.dim() != 1 or offsets.dim() != 1:
            raise ValueError(
                f"values and offsets must be 1-D, got shapes {tuple(values.shape)} and {tuple(offsets.shape)}"
            )
        n_features = len(self.feature_table)
        if offsets.numel() < 1 or (offsets.numel() - 1) % n_features:
            raise ValueError(
                f"offsets has {offsets.numel()} entries; expected features * batch + 1 with {n_features} features"
            )
        batch = (offsets.numel() - 1) // n_features
        grad_scale = float(grad_scale)
        if not math.isfinite(grad_scale):
            raise ValueError(f"grad_scale must be finite, got {grad_scale}")
        self._check_aliases()
        values = values.to(device=self.device, dtype=torch.long)
        offsets = offsets.to(device=self.device, dtype=torch.long)
        if not ids_checked:
            self._check_inputs(values, offsets, batch)
        psw = per_sample_weights
        if psw is not None and self.pooling == "none":
            raise ValueError(
                "a fused kernel without pooling (one row per id) takes no per_sample_weights: there is no bag to "
                "weigh the ids in (and fbgemm's no-bag mode drops them silently: F3)"
            )
        if psw is not None:
            if psw.dim() != 1 or psw.numel() != values.numel():
                raise ValueError(
                    f"per_sample_weights must be 1-D with one weight per id ({values.numel()}), "
                    f"got shape {tuple(psw.shape)}"
                )
            psw_in = psw.to(device=self.device, dtype=torch.float32)
            if self._accumulate and torch.is_grad_enabled():
                return deferred_lookup(self, values, offsets, psw_in, batch, grad_scale)
            if psw_in.requires_grad and grad_scale != 1.0 and torch.is_grad_enabled():
                if grad_scale == 0.0:
                    raise ValueError(
                        "grad_scale=0 with per_sample_weights that require grad: their gradient cannot be recovered"
                    )
                psw_in = _ScaleGrad.apply(psw_in, 1.0 / grad_scale)  # undo the scaling below for the weights' grad
        else:
            psw_in = None
            if self._accumulate and torch.is_grad_enabled():
                return deferred_lookup(self, values, offsets, None, batch, grad_scale)
        lr = self.get_learning_rate()
        if lr != self._lr:  # fbgemm captures the learning rate at forward
            self._push_lr(lr)
        out = self._tbe(values, offsets, per_sample_weights=psw_in)  # type: ignore[operator]  # fbgemm's TBE, set past nn.Module's registry
        if out.requires_grad and torch.is_grad_enabled():
            out = _FusedBackwardGuard.apply(out, self._counter, grad_scale)
        return out

    def _check_inputs(self, values: torch.Tensor, offsets: torch.Tensor, batch: int) -> None:
        bounds = check_offsets(values, offsets, batch)
        if batch and values.numel():
            names = [self.table_names[t] for t in self.feature_table]
            lengths = [hi - lo for lo, hi in itertools.pairwise(bounds)]
            check_ids(values, lengths, self._rows_per_feature, range(len(names)), names)

    def drop_kept_rows(self, table: str, rows: torch.Tensor) -> None:
        """Forget the kept gradient of ``rows`` of ``table``: managed collision gave them to new ids since."""
        drop_kept_rows(self, self.table_names.index(table), rows)

    # -- optimizer ----------------------------------------------------------------------------------------

    def finish_step(self) -> None:
        """End a training step (``FusedOptimizer.step`` calls it): apply the kept gradients, allow the next backward."""
        if self._pending:
            self._apply_pending()
        self._counter.count = 0

    @property
    def accumulate(self) -> bool:
        """Accumulation mode: backward keeps the gradient, :meth:`finish_step` applies one update from their sum
        (costs the kept inputs and gradients, one more forward at the step). Off: update inside backward."""
        return self._accumulate

    @accumulate.setter
    def accumulate(self, on: bool) -> None:
        if not on and self._pending:
            raise RuntimeError(
                f"{len(self._pending)} lookups' gradients wait for the step of the kernel with tables "
                f"{self.table_names}; call FusedOptimizer.step() before turning accumulation off"
            )
        self._accumulate = bool(on)

    def pending_bytes(self) -> int:
        """Bytes kept for the next step's update (accumulation mode): inputs and gradients of its lookups."""
        return sum(mb.nbytes() for mb in self._pending)

    @property
    def pending_lookups(self) -> int:
        """Lookups whose gradient waits for the next step (accumulation mode)."""
        return len(self._pending)

    def _apply_pending(self) -> None:
        pending, self._pending = self._pending, []
        union = union_of(pending, len(self.feature_table))
        for mb in pending:
            mb.grad = None  # a later backward through one of these lookups belongs to the next step
        if union is None:
            return
        values, offsets, weights, grad = union
        self._check_aliases()
        lr = self.get_learning_rate()
        if lr != self._lr:
            self._push_lr(lr)
        with torch.enable_grad():
            out = self._tbe(values, offsets, per_sample_weights=weights)  # type: ignore[operator]
            out.backward(grad.to(out.dtype))

    def _attach(self, optimizer_ref: Callable[[], torch.optim.Optimizer | None], index: int) -> None:
        self._owner = (optimizer_ref, index)

    def _owned_by(self, optimizer: torch.optim.Optimizer, index: int) -> bool:
        return self._owner is not None and self._owner[0]() is optimizer and self._owner[1] == index

    def _owner_group(self) -> dict | None:
        if self._owner is None:
            return None
        opt = self._owner[0]()
        if opt is None:
            self._owner = None
            return None
        return opt.param_groups[self._owner[1]]

    def get_learning_rate(self) -> float:
        """The learning rate the next forward will use (the driving FusedOptimizer's group ``lr``, if any)."""
        group = self._owner_group()
        return float(group["lr"]) if group is not None else self._lr

    def set_learning_rate(self, lr: float) -> None:
        """Set the learning rate (and the driving FusedOptimizer's group ``lr``, which owns it)."""
        lr = float(lr)
        if not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"learning rate must be a finite number >= 0, got {lr}")
        group = self._owner_group()
        if group is not None:
            group["lr"] = lr
        self._push_lr(lr)

    def _push_lr(self, lr: float) -> None:
        self._tbe.set_learning_rate(lr)  # type: ignore[union-attr, operator]
        self._lr = lr

    @property
    def optimizer_iter(self) -> int | None:
        """Adam-family step counter (for bias correction); None for other kinds."""
        if not self.spec.info.adam_family:
            return None
        return int(self._tbe.iter.item())  # type: ignore[union-attr, operator]

    @optimizer_iter.setter
    def optimizer_iter(self, step: int) -> None:
        if self.optimizer_iter is None:
            raise ValueError(f"fused optimizer {self.spec.kind!r} has no step counter")
        self._tbe.iter.fill_(int(step))  # type: ignore[union-attr, operator]
        self._tbe.iter_cpu.fill_(int(step))  # type: ignore[union-attr, operator]

    def optimizer_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{table name: {state name: tensor}}``; the tensors are views of the live state.

        ``"sum"``: ``[rows, dim]`` (adagrad) or ``[rows]`` (rowwise_adagrad); ``"exp_avg"`` / ``"exp_avg_sq"``
        (Adam family); nothing for sgd.
        """
        state_names = self.spec.info.state_names
        if not state_names:
            return {name: {} for name in self.table_names}
        split = self._tbe.split_optimizer_states()  # type: ignore[union-attr, operator]
        return {name: dict(zip(state_names, states)) for name, states in zip(self.table_names, split)}

    def _check_optimizer_states(self, states: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        missing = [n for n in self.table_names if n not in states]
        unexpected = [n for n in states if n not in self.table_names]
        if missing or unexpected:
            raise ValueError(
                f"fused optimizer state does not match the kernel's tables: missing {missing}, unexpected {unexpected}"
            )
        for name, own in self.optimizer_states().items():
            given = states[name]
            if set(given) != set(own):
                raise ValueError(
                    f"table {name!r}: optimizer state has entries {sorted(given)} but fused optimizer "
                    f"{self.spec.kind!r} keeps {sorted(own)}"
                )
            for key, t in own.items():
                src = given[key]
                if not isinstance(src, torch.Tensor) or tuple(src.shape) != tuple(t.shape):
                    shape = tuple(src.shape) if isinstance(src, torch.Tensor) else type(src).__name__
                    raise ValueError(
                        f"table {name!r}: optimizer state {key!r} has shape {shape} in the checkpoint but "
                        f"{tuple(t.shape)} here"
                    )

    def load_optimizer_states(self, states: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Copy ``{table name: {state name: tensor}}`` into the kernel (all checked before any copy)."""
        self._check_optimizer_states(states)
        with torch.no_grad():
            for name, own in self.optimizer_states().items():
                for key, t in own.items():
                    t.copy_(states[name][key])
