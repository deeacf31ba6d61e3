"""torch's private or version-dependent symbols: the dispatcher's kernel query, torch.fx and pytree hooks, process
group internals, DDP's ignore list and an ``nn.Module``'s own registries and hooks. Each documents the torch
releases it was run on."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, cast

import torch
import torch.fx._pytree as _fx_pytree
import torch.fx.experimental._config as _fx_shape_config
import torch.utils._pytree as _pytree
from torch.distributed import distributed_c10d
from torch.fx._symbolic_trace import ProxyableClassMeta, is_fx_symbolic_tracing
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode as _TorchDispatchMode


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
