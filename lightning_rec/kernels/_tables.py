"""A kernel's tables as objects, and how they are built.

- The module behind a fused kernel, which holds the tables' storage and updates it in backward: fbgemm's split
  table-batched module, or its torch stand-in on CPU. fbgemm's CPU build has kernels for SGD and the Adagrads only
  (docs/ARCHITECTURE.md F1); on CPU the other kinds (``fused_kinds.TORCH_CPU_KINDS``) run
  :class:`~lightning_rec.kernels._torch_adam.TorchAdamTBE`, which has the same interface and applies fbgemm's CUDA
  rule; it needs no fbgemm at all.
- The modules that register each table under its own name, so state_dict keys read
  ``<collection>.<table>.weight``. Table names are user data (``"user.id"``, spaces), so these are ``ModuleDict``s
  without its key rules, and they check unexpected ``load_state_dict`` keys against the tables' own keys:
  ``nn.Module`` splits keys at the first ``.`` to find a child, which would misreport the key of a table named
  ``"user.id"``.
- The one dtype several tables' pooled outputs share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, cast

import torch

from lightning_rec import _compat
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


class TableKernel(Protocol):
    """What :class:`FusedTables` needs of each kernel it holds (an nn.Module whose children are its table modules,
    by name): the names, and its refusal of conversions. :class:`~lightning_rec.kernels._fused_tbe.FusedPooledKernel`
    is one; it imports this module, so naming it here would make the two modules need each other."""

    @property
    def table_names(self) -> list[str]: ...

    def _refuse_conversion(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None: ...


def unexpected_table_keys(state_dict: Mapping[str, object], prefix: str, own: Iterable[str]) -> list[str]:
    """Keys under ``prefix`` that are none of ``own`` (full keys)."""
    own = set(own)
    return [k for k in state_dict if k.startswith(prefix) and k not in own]


class TableContainer(torch.nn.Module):
    """``ModuleDict`` without its key rules: table names are user data, so ``.`` or spaces are allowed."""

    def add(self, name: str, module: torch.nn.Module) -> None:
        _compat.child_modules(self)[name] = module

    def __getitem__(self, name: str) -> torch.nn.Module:
        return _compat.child_modules(self)[name]

    def __iter__(self) -> Iterator[str]:
        return iter(_compat.child_modules(self))

    def __len__(self) -> int:
        return len(_compat.child_modules(self))

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
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, False, missing_keys, unexpected_keys, error_msgs
        )
        if strict:
            own = [f"{prefix}{name}.{k}" for name, m in self.named_children() for k in m.state_dict(keep_vars=True)]
            unexpected_keys.extend(unexpected_table_keys(state_dict, prefix, own))


class FusedTable(torch.nn.Module):
    """Holds one table's ``weight`` (a view of the fused kernel's storage): state_dict keys read ``<table>.weight``."""

    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

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
        # Always copy into the kernel's storage: load_state_dict(assign=True) would swap in a tensor the kernel
        # never sees. Unexpected keys are checked by the container (a key of table "a.b" starts with "a.").
        local_metadata = {**local_metadata, "assign_to_params_buffers": False}
        n = len(unexpected_keys)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        del unexpected_keys[n:]


class FusedTables(TableContainer):
    """The tables of several fused kernels under one module: ``<table name>.weight`` each, in ``order``.

    A sharded collection holds up to two kernels (its shards; its data-parallel tables) but one
    ``embedding_bags`` attribute, so state_dict keys stay those of the unsharded module. The kernels are not
    submodules (their tables would be registered twice); conversions are refused as each kernel refuses them.
    """

    _kernels: list[Any]  # set past nn.Module's registry

    def __init__(self, fused: Sequence[TableKernel], order: Sequence[str]) -> None:
        super().__init__()
        object.__setattr__(self, "_kernels", list(fused))
        # a kernel is an nn.Module whose child modules are its tables, by name
        held = {name: _compat.child_modules(cast(torch.nn.Module, k))[name] for k in fused for name in k.table_names}
        for name in [n for n in order if n in held] + [n for n in held if n not in set(order)]:
            self.add(name, held[name])

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> FusedTables:  # type: ignore[override]
        for k in self._kernels:
            k._refuse_conversion(fn)
        return super()._apply(fn, recurse)


def promoted_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """Pooled outputs of several tables are concatenated, so they share the promoted dtype."""
    dtype = dtypes[0] if dtypes else torch.float32
    for d in dtypes[1:]:
        dtype = torch.promote_types(dtype, d)
    return dtype
