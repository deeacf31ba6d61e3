"""Which lookup kernel runs: the requested ``compute_kernel``, what fbgemm can serve, and what is installed.

``"torch"`` always works. ``"fbgemm"`` needs tables fbgemm's dense kernel accepts (one dtype, fp32 or fp16,
one device, dense gradients) *and* an installed fbgemm build with a kernel for the device: the CPU build of
fbgemm-gpu next to a CUDA torch registers its ops without CUDA kernels, and calling one dies with a long
NotImplementedError. So the dispatcher is asked once per (op, device type) and, where the op is missing,
the torch kernel runs instead after one warning. Fused optimizers have no torch fallback: they raise one
error naming the package to install.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from types import ModuleType

import torch

from lightning_rec import _compat
from lightning_rec.fused_kinds import FusedOptimizerSpec

KERNELS = ("auto", "fbgemm", "torch")

#: the op behind ``compute_kernel="fbgemm"`` (fbgemm's dense table-batched lookup)
DENSE_LOOKUP_OP = "fbgemm::dense_embedding_codegen_lookup_function"
#: ops fbgemm's split table-batched module calls before any optimizer-specific kernel, per device type
#: (``get_infos_metadata`` is the first op a CPU-only build lacks on CUDA)
FUSED_OPS: dict[str, tuple[str, ...]] = {
    "cpu": ("fbgemm::split_embedding_codegen_forward_cpu",),
    "cuda": ("fbgemm::get_infos_metadata",),
}

# (op, device type) pairs already warned about: a fallback warns once per process, not once per lookup
_warned: set[tuple[str, str]] = set()


def validate_kernel(kernel: str) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return kernel


@functools.cache
def fbgemm_training() -> ModuleType:
    """fbgemm's split-TBE training module (importing it registers ``torch.ops.fbgemm``)."""
    # fbgemm takes seconds to import and only its kernels need it: load it on first use, not with the library
    import fbgemm_gpu.split_table_batched_embeddings_ops_training as tbe_ops  # noqa: PLC0415

    return tbe_ops


def load_fbgemm() -> None:
    """Register fbgemm's ops (``torch.ops.fbgemm``)."""
    fbgemm_training()


@functools.cache
def has_fbgemm_op(op: str, device_type: str) -> bool:
    """Whether the installed fbgemm build has a kernel of ``op`` for ``device_type`` (asked once, then cached).
    False without fbgemm-gpu (a torch newer than every fbgemm release: the import check allowed it)."""
    if _compat.fbgemm_distribution() is None:
        return False
    load_fbgemm()
    return _compat.has_kernel_for(op, device_type)


def missing_ops_reason(ops: Sequence[str], device: torch.device) -> str | None:
    """A sentence naming what is installed, the missing op and the package to install; None if all ops exist."""
    missing = [op for op in ops if not has_fbgemm_op(op, device.type)]
    if not missing:
        return None
    dist = _compat.fbgemm_distribution()
    hint = _compat.fbgemm_install_hint(torch.__version__, device.type)
    if dist is None:
        return f"fbgemm-gpu is not installed (torch {torch.__version__} has no fbgemm-gpu release yet): {hint}"
    return (
        f"the installed {dist[0]}=={dist[1]} has no {device.type} kernel for {missing[0]}; install the "
        f"{'CUDA' if device.type == 'cuda' else 'CPU'} build that matches torch {torch.__version__}: {hint}"
    )


def _fbgemm_unsupported_reason(tables: Sequence[torch.Tensor], sparse_grad: bool) -> str | None:
    """Why the fbgemm dense kernel cannot serve these tables (None if it can)."""
    if not tables:
        return "there are no tables"
    if sparse_grad:
        return "sparse_grad=True needs the torch kernel (fbgemm's autograd kernel returns a dense gradient)"
    dtypes = {t.dtype for t in tables}
    if len(dtypes) > 1:
        return f"tables mix dtypes {sorted(str(d) for d in dtypes)}; one batched kernel needs one dtype"
    dtype = next(iter(dtypes))
    if dtype not in (torch.float32, torch.float16):
        return f"fbgemm has no {dtype} kernel on this build"
    if len({t.device for t in tables}) > 1:
        return "tables live on different devices"
    return None


def resolve_kernel(requested: str, tables: Sequence[torch.Tensor], sparse_grad: bool) -> str:
    """Pick the kernel (``"fbgemm"`` or ``"torch"``) for plain-parameter training.

    ``auto`` picks fbgemm on CUDA and torch on CPU: measured on the 26-table benchmark
    (benchmarks/bench_kernels.py), torch's embedding_bag is faster on CPU for autograd training
    (fbgemm's CPU forward is slower and its dense backward is no faster), so the default follows the
    measurement. ``fbgemm`` on tables the kernel cannot serve raises; where only the installed fbgemm build
    lacks the op for the device, ``fbgemm`` and ``auto`` fall back to torch with one warning.
    """
    validate_kernel(requested)
    reason = _fbgemm_unsupported_reason(tables, sparse_grad)
    if requested == "fbgemm" and reason is not None:
        raise ValueError(f"kernel='fbgemm' cannot be used: {reason}. Use kernel='auto' or 'torch'.")
    if requested == "torch" or reason is not None:
        return "torch"
    device = tables[0].device
    if requested == "auto" and device.type != "cuda":
        return "torch"
    missing = missing_ops_reason([DENSE_LOOKUP_OP], device)
    if missing is not None:
        if (DENSE_LOOKUP_OP, device.type) not in _warned:
            _warned.add((DENSE_LOOKUP_OP, device.type))
            warnings.warn(
                f"kernel={requested!r}: using the torch kernel on {device.type} because {missing}",
                RuntimeWarning,
                stacklevel=3,
            )
        return "torch"
    return "fbgemm"


def check_fused_available(spec: FusedOptimizerSpec, device: torch.device | str | None) -> None:
    """Raise one clear RuntimeError when the installed fbgemm build cannot run fused ``spec`` on ``device``.

    Fused optimizers have no torch fallback; the error names the package and release to install.
    """
    dev = spec.check_device(device)
    missing = missing_ops_reason(FUSED_OPS.get(dev.type, ()), dev)
    if missing is not None:
        raise RuntimeError(
            f"fused optimizer {spec.kind!r} cannot run on {dev}: {missing} (or use plain parameters with a "
            "torch optimizer, which needs no fbgemm kernel)"
        )


def resolve_table_kernel(
    requested: str, table: str, dtype: torch.dtype, device: torch.device, sparse_grad: bool, pooled: bool = True
) -> str:
    """:func:`resolve_kernel` for one table (or shard) that is not allocated yet; errors name ``table``.

    ``pooled=False`` (sequence lookups): fbgemm's dense kernel silently SUM-pools ``PoolingMode.NONE``
    (docs/ARCHITECTURE.md F10), so ``"fbgemm"`` raises and ``"auto"`` is the torch kernel.
    """
    validate_kernel(requested)
    if not pooled:
        if requested == "fbgemm":
            raise ValueError(
                f"table {table!r}: compute_kernel='fbgemm' cannot be used: sequence (unpooled) lookups have no "
                "fbgemm kernel (fbgemm's dense kernel would sum-pool them); use compute_kernel='auto' or 'torch'"
            )
        return "torch"
    try:
        return resolve_kernel(requested, [torch.empty(0, dtype=dtype, device=device)], sparse_grad)
    except ValueError as e:
        raise ValueError(
            f"table {table!r}: compute_kernel='fbgemm' cannot be used: "
            f"{str(e).split(': ', 1)[-1].replace('Use kernel=', 'Use compute_kernel=')}"
        ) from None


def fused_width_problem(name: str, dim: int, widths: Sequence[int]) -> str | None:
    """Why fbgemm's fused kernel cannot hold table ``name`` (``dim`` columns) as pieces ``widths`` wide; None if
    it can (F6: every piece a multiple of 4 wide). The planner asks the same before it proposes a plan."""
    bad = [w for w in widths if w % 4]
    if not bad:
        return None
    lower, upper = dim // 4 * 4, dim // 4 * 4 + 4
    sizes = f"{lower} or {upper}" if lower else f"{upper}"
    no_fused = "or use embedding_optimizer=None (plain parameters stepped by a torch optimizer)"
    if all(w == dim for w in widths):  # not column-split: only the table's own width can be wrong
        return (
            f"table {name!r}: embedding_dim={dim} is not a multiple of 4, which the fused fbgemm kernel needs; "
            f"give the table a width that is a multiple of 4 (e.g. {sizes}), {no_fused}"
        )
    if dim % 4:  # no split of these columns can help: the shard widths would not add up to dim
        return (
            f"table {name!r}: embedding_dim={dim} is not a multiple of 4 and its column shards are {widths} "
            "wide; the fused fbgemm kernel needs every column shard to be a multiple of 4 wide, which no "
            f"split of {dim} columns gives: give the table a width that is a multiple of 4 (e.g. {sizes}) "
            f"and column shards that are multiples of 4, {no_fused}"
        )
    return (
        f"table {name!r}: a column shard of it is {bad[0]} wide (column shards {widths} of embedding_dim="
        f"{dim}); the fused fbgemm kernel needs every column shard to be a multiple of 4 wide: choose column "
        f"shards that are (or do not split the columns), {no_fused}"
    )
