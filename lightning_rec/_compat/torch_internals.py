"""torch's versions and private symbols: which torch each fbgemm-gpu release is built for (the pair checked when
lightning_rec is imported, and fbgemm's import notice dropped for pairs that check accepts), and torch's private or
version-dependent symbols: the dispatcher's kernel query, torch.fx and pytree hooks, process group internals,
DDP's ignore list and an ``nn.Module``'s own registries and hooks. Each symbol documents the torch releases it was
run on."""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable
from datetime import timedelta
from importlib import metadata
from typing import Any, cast

import torch
import torch.fx._pytree as _fx_pytree
import torch.fx.experimental._config as _fx_shape_config
import torch.utils._pytree as _pytree
from torch.distributed import distributed_c10d
from torch.fx._symbolic_trace import ProxyableClassMeta, is_fx_symbolic_tracing
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode as _TorchDispatchMode

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


# torch's dispatch-mode base (intercepts every op torch dispatches; public in spirit, private by path since 2.0)
TorchDispatchMode = _TorchDispatchMode


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
    public = getattr(torch.distributed, "set_timeout", None)
    if public is not None:  # torch 2.14: public, and the private one warns that it is deprecated
        public(timeout, group)
    else:
        distributed_c10d._set_pg_timeout(timeout, group)


def ddp_ignore(model: Any, names: list[str]) -> None:
    """Make DDP (built on ``model`` later) leave these parameters and buffers alone (torch's private hook)."""
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)


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
