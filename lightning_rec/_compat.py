"""Version checks and the only imports of private or version-dependent symbols."""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from importlib import metadata
from typing import Any, cast

import torch
import torch.fx._pytree as _fx_pytree
import torch.fx.experimental._config as _fx_shape_config
import torch.utils._pytree as _pytree
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher as _FabricPopen
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.wrappers import _FabricModule
from lightning.pytorch.core.saving import _load_state
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher as _TrainerPopen
from lightning.pytorch.utilities.model_helpers import _restricted_classmethod
from torch.distributed import distributed_c10d
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.fx._symbolic_trace import ProxyableClassMeta, is_fx_symbolic_tracing
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode as _TorchDispatchMode

# Lightning 2.6 checks `isinstance(treespec, LeafSpec)`, which torch 2.13 deprecates, on every batch; not the
# user's business (Lightning's fix: TreeSpec.is_leaf()).
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")

# fbgemm-gpu wheels are built against one torch minor release; a mismatch fails later with undefined
# symbols deep inside torch.ops, so we check at import time. fbgemm minor -> the torch minor it is built for.
_FBGEMM_TORCH = {"1.6": "2.11", "1.7": "2.12", "1.8": "2.13", "1.9": "2.14"}
_DEFAULT_TORCH = "2.14"
_DEFAULT_RELEASE = "2.14.1"  # the default pair's torch release (the Makefile's TORCH)


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def _minor_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in _minor(version).split(".") if p.isdigit())


def fbgemm_for_torch(torch_version: str) -> str | None:
    """The fbgemm-gpu release (``"1.9.0"``) built for ``torch_version``'s minor release, None if unsupported."""
    for fbgemm, torch_minor in _FBGEMM_TORCH.items():
        if torch_minor == _minor(torch_version):
            return f"{fbgemm}.0"
    return None


def torch_ahead_of_fbgemm(torch_version: str) -> bool:
    """Whether ``torch_version`` is newer than every torch an fbgemm-gpu release is built for (yet)."""
    return _minor_key(torch_version) > max(_minor_key(t) for t in _FBGEMM_TORCH.values())


def fbgemm_install_hint(torch_version: str, device_type: str = "cpu") -> str:
    """``pip install ...`` naming the fbgemm-gpu build and release that match this torch (CUDA or CPU build)."""
    package = "fbgemm-gpu" if device_type == "cuda" else "fbgemm-gpu-cpu"
    fbgemm = fbgemm_for_torch(torch_version)
    if fbgemm is None:
        default = fbgemm_for_torch(_DEFAULT_TORCH)
        return f"pip install torch=={_DEFAULT_RELEASE} '{package}=={default}'"
    return f"pip install '{package}=={fbgemm}'"


def fbgemm_distribution() -> tuple[str, str] | None:
    for dist in ("fbgemm-gpu-cpu", "fbgemm-gpu", "fbgemm-gpu-nightly", "fbgemm-gpu-nightly-cpu"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def without_fbgemm_notice(torch_version: str) -> str:
    """What runs, and what does not, on a torch that no fbgemm-gpu release is built for yet."""
    return (
        f"lightning_rec: torch {torch_version} has no fbgemm-gpu release yet (the newest pair is torch "
        f"{_DEFAULT_TORCH} with fbgemm-gpu {fbgemm_for_torch(_DEFAULT_TORCH)}), and none is installed: lookups, "
        "input dists and sparse ops run on torch's own kernels (slower), and fused embedding optimizers "
        "(embedding_optimizer=..., apply_optimizer_in_backward, compute_kernel='fbgemm') are unavailable. For "
        f"those: {fbgemm_install_hint(torch_version)}"
    )


def check_versions(torch_version: str, fbgemm: tuple[str, str] | None) -> None:
    """Raise ImportError when fbgemm-gpu is missing or built for another torch. A torch newer than every fbgemm
    release, with none installed, imports (torch kernels only) with one warning saying what that costs."""
    pairs = ", ".join(f"torch {t}.x with fbgemm-gpu {f}.x" for f, t in _FBGEMM_TORCH.items())
    default = fbgemm_for_torch(_DEFAULT_TORCH)
    hint = f"pip install torch=={_DEFAULT_RELEASE} 'fbgemm-gpu-cpu=={default}'  (CPU) or 'fbgemm-gpu=={default}' (CUDA)"
    own = fbgemm_for_torch(torch_version)
    if own is not None:
        hint = (
            f"pip install 'fbgemm-gpu-cpu=={own}' (CPU) or 'fbgemm-gpu=={own}' (CUDA) for torch "
            f"{_minor(torch_version)}, or {hint}"
        )
    if fbgemm is None:
        if torch_ahead_of_fbgemm(torch_version):
            warnings.warn(without_fbgemm_notice(torch_version), stacklevel=3)
            return
        raise ImportError(f"lightning_rec needs the fbgemm-gpu kernels, which are not installed. Install: {hint}")
    dist, version = fbgemm
    want = _FBGEMM_TORCH.get(_minor(version))
    if want is None:
        raise ImportError(
            f"{dist}=={version} is not a supported fbgemm-gpu release (supported: "
            f"{', '.join(k + '.x' for k in _FBGEMM_TORCH)}: {pairs}). Install: {hint}"
        )
    if _minor(torch_version) != want:
        raise ImportError(
            f"{dist}=={version} is built for torch {want}.x but torch {torch_version} is installed; "
            f"mixing them crashes with undefined symbols. Supported pairs: {pairs}. Install matching versions: {hint}"
        )


# fbgemm-gpu 1.6 and 1.7 ship a compatibility table that stops at 1.5, so importing them logs "has no entry for
# 1.7.0 of FBGEMM; cannot determine compatibility" once per library: 14 root-logger warnings per process (28 in
# a 2-rank job) for a pair we support. fbgemm 1.8's table lists 1.6-1.8. Drop only that notice, and only when the
# pair it names is one check_versions accepts: an unknown release or another torch still shows it.
_FBGEMM_NO_ENTRY = re.compile(r"no entry for (\S+) of FBGEMM;\s*cannot determine compatibility with PyTorch (\S+)")


def fbgemm_notice_filter(record: logging.LogRecord) -> bool:
    """False for fbgemm-gpu's "no entry in its compatibility table" notice about a supported torch/fbgemm pair."""
    match = _FBGEMM_NO_ENTRY.search(record.getMessage())
    return match is None or _FBGEMM_TORCH.get(_minor(match.group(1))) != _minor(match.group(2))


# fbgemm logs on the root logger (logging.warning), where a logger filter sees it before any handler
logging.getLogger().addFilter(fbgemm_notice_filter)


def has_kernel_for(op: str, device_type: str) -> bool:
    """Whether the dispatcher has a kernel of ``op`` (``"fbgemm::name"``) for the device type.

    A CPU-only fbgemm build next to a CUDA torch registers its ops without CUDA kernels; calling one then
    fails with a long NotImplementedError, so callers ask first. Uses torch's private dispatcher query
    (the computed table, so catch-all registrations count).
    """
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    if key is None:
        return False
    try:
        return bool(torch._C._dispatch_has_computed_kernel_for_dispatch_key(op, key))
    except RuntimeError:  # the op is not registered at all
        return False


def indexed_device(device: Any) -> Any:
    """``device`` with an index: torch refuses ``device_id`` (and a CUDA mesh) without one."""
    device = torch.device(device)
    if device.index is None and device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass(frozen=True)
class ShardRecord:
    """What lightning_rec notes on the DTensors it makes: the table's dtype, every non-empty shard
    ``(offsets, sizes, global rank)`` and the global ranks of the group the table is sharded over (a table-wise
    DTensor's mesh is its owner alone). Plain values, so state_dicts still pickle and deep-copy."""

    dtype: torch.dtype
    shards: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]
    group_ranks: tuple[int, ...]


_RECORD = "_lightning_rec_shards"


class _Pieces(LocalShardsWrapper):
    """torch's LocalShardsWrapper reporting its pieces' dtype and device, also when it holds none (torch's reports
    the default dtype, and a DTensor over it takes its dtype from there: a float16 table would read as float32)."""

    @staticmethod
    def __new__(
        cls,
        local_shards: list[torch.Tensor],
        local_offsets: list[tuple[int, ...]],
        dtype: torch.dtype | None = None,
        device: Any = None,
    ) -> _Pieces:
        base = LocalShardsWrapper(local_shards, local_offsets)
        if local_shards:
            dtype, device = local_shards[0].dtype, local_shards[0].device
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            base.size(),
            dtype=dtype or torch.get_default_dtype(),
            device=device if device is not None else base.device,
        )
        r._local_shards, r._storage_meta = base._local_shards, base._storage_meta
        return r

    @classmethod  # torch's stubs type __torch_dispatch__ as a plain method of Tensor
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        if func.namespace == "_c10d_functional":
            # torch's wrapper would gather its pieces as if they were Shard(0)'s blocks: wrong sizes, a mismatched
            # collective that aborts the process. Every rank holds one of these, so every rank raises.
            raise RuntimeError(
                "this DTensor holds a table tiled in a way no DTensor placement describes (custom sizes, ranks out "
                "of order, blocks of one host, grids): DTensor collectives (full_tensor, redistribute) do not apply "
                "to it; gather tables with lightning_rec.full_state_dict. torch.distributed.checkpoint reads and "
                "writes it."
            )
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if isinstance(out, LocalShardsWrapper) and not isinstance(out, _Pieces):  # keep dtype and device (views)
            offsets = cast("list[tuple[int, ...]]", out.local_offsets())  # torch.Size tuples
            return _Pieces(out.local_shards(), offsets, args[0].dtype, args[0].device)
        return out

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._local_shards[0].device if self._local_shards else torch.Tensor.device.__get__(self)


def make_dtensor(
    local: list[tuple[Any, list[int]]],
    shards: list[tuple],
    global_size: list[int],
    dtype: Any,
    device: Any,
    process_group: Any,
    placement: tuple[str, int] | None = None,
    mesh: Any = None,
) -> Any:
    """A DTensor over ``local`` pieces ``(tensor, offsets)``; ``shards`` = ``(offsets, sizes, global rank, ...)``
    of every shard of the table.

    ``placement`` says how the layout maps onto DTensor placements: ``("shard", d)`` is ``Shard(d)`` over a 1-D
    mesh of ``process_group`` (the shards are ``torch.chunk``'s blocks along ``d``, in the group's rank order);
    ``("owner", global rank)`` is ``Replicate()`` on a one-rank mesh (a rank outside it holds an empty local
    tensor); ``None`` (any other tiling: uneven or custom offsets, blocks of a host, grids) wraps the local pieces
    with their offsets in torch's ``LocalShardsWrapper`` (the mechanism TorchRec uses; torch.distributed.checkpoint
    reads each piece's offsets from it), on the group's mesh (or ``mesh``). Local pieces share storage with the
    given tensors.
    Runs no collective (meshes are built over existing groups, or without a backend for one rank), so
    ``state_dict()`` may be called on one rank alone. Zero-size shards are left out of the record.
    """
    pieces = [(t, [int(o) for o in off]) for t, off in local if t is not None and t.numel() > 0]
    device = torch.device(device)
    device_type = pieces[0][0].device.type if pieces else device.type
    size = torch.Size(global_size)
    stride = _contiguous_stride(size)
    if placement is not None and placement[0] == "owner":
        # a one-rank mesh needs no process group; building one would be a collective over the world
        mesh = DeviceMesh(device_type, [placement[1]], _init_backend=False)
        value = pieces[0][0] if pieces else torch.empty(0, dtype=dtype, device=device)
        out = DTensor.from_local(value, mesh, [Replicate()], run_check=False, shape=size, stride=stride)
    elif placement is not None:
        mesh = DeviceMesh.from_group(process_group, device_type)
        # a rank without a piece holds torch.chunk's empty tail block
        empty = [0 if d == placement[1] else n for d, n in enumerate(size)]
        value = pieces[0][0] if pieces else torch.empty(empty, dtype=dtype, device=device)
        out = DTensor.from_local(value, mesh, [Shard(placement[1])], run_check=False, shape=size, stride=stride)
    else:
        mesh = mesh if mesh is not None else DeviceMesh.from_group(process_group, device_type)
        wrapper = _Pieces([t for t, _ in pieces], [tuple(off) for _, off in pieces], dtype, device)
        out = DTensor.from_local(wrapper, mesh, [Shard(0)], run_check=False, shape=size, stride=stride)
    record = tuple(
        (tuple(int(o) for o in e[0]), tuple(int(s) for s in e[1]), int(e[2]))
        for e in shards
        if all(s > 0 for s in e[1])
    )
    ranks = (
        torch.distributed.get_process_group_ranks(process_group)
        if process_group is not None
        else mesh.mesh.flatten().tolist()
    )
    setattr(out, _RECORD, ShardRecord(dtype, record, tuple(ranks)))
    return out


def _contiguous_stride(size: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(size):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def is_sharded(x: object) -> bool:
    """Whether ``x`` is a sharded value of a state_dict (a DTensor)."""
    return isinstance(x, DTensor)


def shard_record(x: Any) -> ShardRecord | None:
    """The :class:`ShardRecord` of a DTensor :func:`make_dtensor` made (None for other DTensors)."""
    return getattr(x, _RECORD, None)


def local_pieces(x: Any) -> list[tuple[list[int], torch.Tensor]]:
    """``(offsets, tensor)`` of every non-empty local piece of the DTensor ``x`` (views of its storage)."""
    if x.device_mesh.get_coordinate() is None:
        return []
    local = x._local_tensor  # to_local() is an autograd op; the pieces must stay the live storage
    record = shard_record(x)
    if isinstance(local, LocalShardsWrapper):
        pairs = [([int(o) for o in off], t) for off, t in zip(local.local_offsets(), local.local_shards())]
    elif record is not None:  # ours: the record names this rank's shard (torch's helper needs a real device)
        me = torch.distributed.get_rank()
        pairs = [
            (list(off), local) for off, size, rank in record.shards if rank == me and list(size) == list(local.shape)
        ]
    else:
        _, offsets = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
        pairs = [([int(o) for o in offsets], local)]
    return [(off, t) for off, t in pairs if t.numel() > 0]


def sharded_dtype(x: Any) -> torch.dtype:
    """The element type of a DTensor's values (torch's LocalShardsWrapper alone reports the default dtype)."""
    record = shard_record(x)
    if record is not None:
        return record.dtype
    pieces = local_pieces(x)
    return pieces[0][1].dtype if pieces else x.dtype


def precision_target_dtype(precision_plugin: object) -> torch.dtype | None:
    """The dtype a ``*-true`` Lightning precision plugin converts modules to (None for the others)."""
    # Lightning's HalfPrecision keeps it in a private attribute (lightning 2.4-2.6)
    return getattr(precision_plugin, "_desired_input_dtype", None)


def synced_grad_scaler(scaler: torch.amp.GradScaler, group: distributed_c10d.ProcessGroup | None) -> object:
    """``scaler``'s settings in a GradScaler whose inf/NaN check is all-reduced over ``group``."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # noqa: PLC0415 - only with AMP

    if isinstance(scaler, ShardedGradScaler):
        return scaler
    return ShardedGradScaler(
        device=scaler._device,
        init_scale=scaler._init_scale,
        backoff_factor=scaler._backoff_factor,
        growth_factor=scaler._growth_factor,
        growth_interval=scaler._growth_interval,
        enabled=scaler._enabled,
        process_group=group,
    )


#: Lightning's classmethod that refuses to be called on an instance (``load_from_checkpoint`` is one)
restricted_classmethod = _restricted_classmethod


def lightning_load_state(cls: type, checkpoint: dict[str, Any], strict: bool | None, **kwargs: Any) -> Any:
    """Lightning's step of ``load_from_checkpoint`` after reading the file: build ``cls`` from the saved
    hyper-parameters (``kwargs`` win), ``configure_model``, ``on_load_checkpoint``, ``load_state_dict``."""
    return _load_state(cls, checkpoint, strict=strict, **kwargs)


def optimizers_to_device(optimizers: Any, device: torch.device) -> None:
    """Move optimizer state to ``device`` (Lightning's private helper, the one DDPStrategy uses)."""
    _optimizers_to_device(optimizers, device)


class FxProxyableMeta(ProxyableClassMeta):
    """torch.fx's metaclass for types built from traced tensors, asking only about ``fx.symbolic_trace``.

    torch's own ``__call__`` asks ``is_fx_tracing()``, which logs a deprecation warning on first use in every
    process; outside symbolic tracing we construct directly.
    """

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if not is_fx_symbolic_tracing():
            return type.__call__(cls, *args, **kwargs)
        return super().__call__(*args, **kwargs)


def size_oblivious() -> Any:
    """Context: symbolic shapes reason as if no dynamic size were 0 or 1 (torch's private shape config), so
    a traced program has no special case for a batch of one (used by ``lightning_rec.export``)."""
    return _fx_shape_config.patch(backed_size_oblivious=True)  # type: ignore[attr-defined]  # added at import


#: torch.serialization's private layout decoder, which DCP's metadata pickles name
serialization_get_layout = torch.serialization._get_layout


#: DCP's private record of where a stored piece lives, which its metadata pickles name
DcpStorageInfo = _StorageInfo


def tensor_version(t: torch.Tensor) -> int:
    """How often ``t`` was modified in place (torch's private version counter)."""
    return t._version


# how a pytree node flattens against an exported program's input spec (TorchRec registers its sparse types)
register_pytree_flatten_spec = _fx_pytree.register_pytree_flatten_spec


def register_pytree_node(cls: type, flatten: Callable[..., Any], unflatten: Callable[..., Any]) -> None:
    """Make ``cls`` a node of torch's pytree registry, the one torch.export, torch.compile and torch.fx flatten
    inputs with, so they see the tensors inside (``lightning_rec.sparse`` registers its types).

    ``torch.utils._pytree.register_pytree_node``: run on torch 2.13; the same signature since torch 2.2, so
    2.11 and 2.12 have it too.
    """
    _pytree.register_pytree_node(cls, flatten, unflatten)


#: the spec torch's pytree flattening hands a flatten-spec function (``torch.utils._pytree.TreeSpec``, torch
#: 2.11-2.13)
TreeSpec = _pytree.TreeSpec


def default_group() -> Any:
    """The default (world) process group object; raises when torch.distributed is not initialized (where
    ``dist.group.WORLD`` would be None).

    ``torch.distributed.distributed_c10d._get_default_group``: run on torch 2.13, unchanged since torch 1.x, so
    2.11 and 2.12 have it too.
    """
    return distributed_c10d._get_default_group()


def sparse_rows(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row ids, rows)`` of a sparse COO tensor with one sparse dimension, as stored: duplicate ids are not
    summed, and nothing coalesces (the public ``indices()`` / ``values()`` refuse an uncoalesced tensor).

    ``Tensor._indices`` / ``Tensor._values``: run on torch 2.13, unchanged since torch 1.0, so 2.11 and 2.12
    have them too.
    """
    return grad._indices()[0], grad._values()


#: Lightning Fabric's base for a strategy's ``no_backward_sync`` (``_BackwardSyncControl``: run on lightning 2.6,
#: there since 2.0)
BackwardSyncControl = _BackwardSyncControl

# torch's dispatch-mode base (intercepts every op torch dispatches; public in spirit, private by path since 2.0)
TorchDispatchMode = _TorchDispatchMode

# Lightning's popen launchers (``python train.py`` with devices=N): the Trainer's and Fabric's, since Lightning 2.0
TrainerPopenLauncher = _TrainerPopen
FabricPopenLauncher = _FabricPopen


def group_timeout(group: Any = None) -> timedelta:
    """A process group's collective timeout (the world's when ``group`` is None), else torch's default."""
    pg: Any = group if group is not None else distributed_c10d.group.WORLD  # None: AttributeError below
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        try:  # a group without a CPU backend (NCCL only)
            return pg._get_backend(torch.device("cuda")).options._timeout
        except (AttributeError, RuntimeError):
            return distributed_c10d.default_pg_timeout


def set_group_timeout(group: Any, timeout: timedelta) -> None:
    """Give ``group`` the collective timeout ``timeout`` (torch creates groups with its default, 30 min on
    gloo, whatever the world's is)."""
    distributed_c10d._set_pg_timeout(timeout, group)


def unwrap_module(module: Any) -> Any:
    """The user's module inside Fabric's ``_FabricModule``, DDP and ``torch.compile`` wrappers."""
    while True:
        if isinstance(module, _FabricModule):
            module = module._original_module
        elif isinstance(module, DistributedDataParallel):
            module = module.module
        elif hasattr(module, "_orig_mod") and isinstance(module, torch.nn.Module):
            module = module._orig_mod
        else:
            return module


def ddp_ignore(model: Any, names: list[str]) -> None:
    """Make DDP (built on ``model`` later) leave these parameters and buffers alone (torch's private hook)."""
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)


def ddp_on_current_stream(strategy: Any, module: torch.nn.Module) -> DistributedDataParallel:
    """``module`` in DDP as Lightning's DDP strategies (Trainer and Fabric) build it, but on the current stream.

    Lightning 2.6 builds DDP under a fresh side CUDA stream. DDP keeps each parameter's AccumulateGrad node,
    which then belongs to that stream, and torch >= 2.10 warns at every backward on the default stream that
    the streams differ and may synchronise (Lightning issue 21567; later Lightning releases build it on the
    current stream too). On CPU the two are the same.
    """
    if hasattr(strategy, "determine_ddp_device_ids"):
        device_ids = strategy.determine_ddp_device_ids()
    else:
        device_ids = strategy._determine_ddp_device_ids()
    return DistributedDataParallel(module=module, device_ids=device_ids, **strategy._ddp_kwargs)


# -- private state of torch's and Lightning's instances (run on torch 2.11-2.15 and Lightning 2.6) ---------------
def child_modules(module: torch.nn.Module) -> dict[str, Any]:
    """``module``'s registry of child modules (``nn.Module._modules``), for names ``add_module`` refuses: a table's
    name is user data and may hold dots."""
    return cast("dict[str, Any]", module._modules)


def own_parameters(module: torch.nn.Module) -> dict[str, Any]:
    """``module``'s own parameters by name (``nn.Module._parameters``), to replace one in place."""
    return cast("dict[str, Any]", module._parameters)


def own_buffers(module: torch.nn.Module) -> dict[str, Any]:
    """``module``'s own buffers by name (``nn.Module._buffers``), to replace one in place."""
    return cast("dict[str, Any]", module._buffers)


def register_state_dict_hook(module: torch.nn.Module, hook: Callable[..., Any]) -> None:
    """A hook that may rewrite ``module``'s state_dict after it is built (torch's private one, the only one whose
    return value replaces the state_dict on every supported torch)."""
    module._register_state_dict_hook(hook)


def register_load_state_dict_pre_hook(module: torch.nn.Module, hook: Callable[..., Any]) -> None:
    """A hook called with the state_dict before ``module`` loads it (torch's private form, without the module)."""
    module._register_load_state_dict_pre_hook(hook)


def strategy_launcher(strategy: Any) -> Any:
    """The launcher a Lightning strategy configured (``Strategy._launcher``)."""
    return strategy._launcher


def set_strategy_launcher(strategy: Any, launcher: Any) -> None:
    strategy._launcher = launcher


def attached_trainer(module: Any) -> Any:
    """The Trainer a LightningModule is attached to, or None (``module.trainer`` raises when there is none)."""
    return module._trainer
