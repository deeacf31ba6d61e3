"""Version checks and the only imports of private or version-dependent symbols."""

from __future__ import annotations

import warnings
from importlib import metadata
from typing import Any

import torch
import torch.fx._pytree as _fx_pytree
import torch.fx.experimental._config as _fx_shape_config
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.fx._symbolic_trace import ProxyableClassMeta, is_fx_symbolic_tracing

# Lightning 2.6 checks `isinstance(treespec, LeafSpec)`, which torch 2.13 deprecates, on every batch; not the
# user's business (Lightning's fix: TreeSpec.is_leaf()).
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")

# Sharded tables are described as ShardedTensors (see make_sharded_tensor); torch warns on every use.
warnings.filterwarnings("ignore", message=r".*Please use DTensor instead and we are deprecating ShardedTensor.*")

# fbgemm-gpu wheels are built against one torch minor release; a mismatch fails later with undefined
# symbols deep inside torch.ops, so we check at import time. fbgemm minor -> the torch minor it is built for.
_FBGEMM_TORCH = {"1.6": "2.11", "1.7": "2.12", "1.8": "2.13"}
_DEFAULT_TORCH = "2.13"


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def fbgemm_for_torch(torch_version: str) -> str | None:
    """The fbgemm-gpu release (``"1.8.0"``) built for ``torch_version``'s minor release, None if unsupported."""
    for fbgemm, torch_minor in _FBGEMM_TORCH.items():
        if torch_minor == _minor(torch_version):
            return f"{fbgemm}.0"
    return None


def fbgemm_install_hint(torch_version: str, device_type: str = "cpu") -> str:
    """``pip install ...`` naming the fbgemm-gpu build and release that match this torch (CUDA or CPU build)."""
    package = "fbgemm-gpu" if device_type == "cuda" else "fbgemm-gpu-cpu"
    fbgemm = fbgemm_for_torch(torch_version)
    if fbgemm is None:
        default = fbgemm_for_torch(_DEFAULT_TORCH)
        return f"pip install torch=={_DEFAULT_TORCH}.0 '{package}=={default}'"
    return f"pip install '{package}=={fbgemm}'"


def fbgemm_distribution() -> tuple[str, str] | None:
    for dist in ("fbgemm-gpu-cpu", "fbgemm-gpu", "fbgemm-gpu-nightly", "fbgemm-gpu-nightly-cpu"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_versions(torch_version: str, fbgemm: tuple[str, str] | None) -> None:
    """Raise ImportError when fbgemm-gpu is missing or built for another torch."""
    pairs = ", ".join(f"torch {t}.x with fbgemm-gpu {f}.x" for f, t in _FBGEMM_TORCH.items())
    hint = "pip install torch==2.13.0 'fbgemm-gpu-cpu==1.8.0'  (CPU) or 'fbgemm-gpu==1.8.0' (CUDA)"
    own = fbgemm_for_torch(torch_version)
    if own is not None:
        hint = (f"pip install 'fbgemm-gpu-cpu=={own}' (CPU) or 'fbgemm-gpu=={own}' (CUDA) for torch "
                f"{_minor(torch_version)}, or {hint}")
    if fbgemm is None:
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
    """``device`` with an index: torch refuses ShardedTensor placements (and ``device_id``) without one."""
    device = torch.device(device)
    if device.index is None and device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def make_sharded_tensor(
    local: list[tuple[Any, list[int]]],
    shards: list[tuple],
    global_size: list[int],
    dtype: Any,
    device: Any,
    process_group: Any,
) -> Any:
    """A ShardedTensor over ``local`` pieces ``(tensor, offsets)``; ``shards`` = ``(offsets, sizes, global rank[,
    device])`` of every shard.

    A local piece's placement is the device it lives on; another rank's is its ``device`` entry, else
    ``device`` (a type alone gets the current index). Uses the constructor that trusts the metadata and
    runs no collective, so ``state_dict()`` may be called on one rank alone. Zero-size shards are left
    out of the metadata (they hold nothing).
    """
    me = torch.distributed.get_rank()
    local_devices = {tuple(off): t.device for t, off in local if t is not None}
    metas = []
    for entry in shards:
        off, size, rank = entry[:3]
        if not all(s > 0 for s in size):
            continue
        where = local_devices.get(tuple(off)) if rank == me else None
        if where is None:
            where = entry[3] if len(entry) > 3 and entry[3] is not None else device
        metas.append(ShardMetadata(shard_offsets=list(off), shard_sizes=list(size),
                                   placement=f"rank:{rank}/{indexed_device(where)}"))
    by_offsets = {tuple(m.shard_offsets): m for m in metas}
    local_shards = [Shard(tensor=t, metadata=by_offsets[tuple(off)]) for t, off in local if t.numel() > 0]
    meta = ShardedTensorMetadata(
        shards_metadata=metas, size=torch.Size(global_size), tensor_properties=TensorProperties(dtype=dtype)
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, meta, process_group=process_group)


def is_sharded_tensor(x: object) -> bool:
    return isinstance(x, ShardedTensor)


def precision_target_dtype(precision_plugin: object) -> object:
    """The dtype a ``*-true`` Lightning precision plugin converts modules to (None for the others)."""
    # Lightning's HalfPrecision keeps it in a private attribute (lightning 2.4-2.6)
    return getattr(precision_plugin, "_desired_input_dtype", None)


def synced_grad_scaler(scaler: object, group: object) -> object:
    """``scaler``'s settings in a GradScaler whose inf/NaN check is all-reduced over ``group``."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # noqa: PLC0415 - only with AMP

    if isinstance(scaler, ShardedGradScaler):
        return scaler
    return ShardedGradScaler(
        device=scaler._device, init_scale=scaler._init_scale, backoff_factor=scaler._backoff_factor,
        growth_factor=scaler._growth_factor, growth_interval=scaler._growth_interval, enabled=scaler._enabled,
        process_group=group,
    )


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
    return _fx_shape_config.patch(backed_size_oblivious=True)


def sharded_tensor_group(value: ShardedTensor) -> Any:
    """The process group a ShardedTensor spans (torch keeps it private)."""
    return value._process_group


#: torch.serialization's private layout decoder, which DCP's metadata pickles name
serialization_get_layout = torch.serialization._get_layout


#: DCP's private record of where a stored piece lives, which its metadata pickles name
DcpStorageInfo = _StorageInfo

# how a pytree node flattens against an exported program's input spec (TorchRec registers its sparse types)
register_pytree_flatten_spec = _fx_pytree.register_pytree_flatten_spec
