"""Guards of the fused kernel: its tables, pooling and feature -> table map, checked at construction (fbgemm's
kernels are silently wrong or crash on others); and in autograd, since a fused optimizer updates inside backward,
what it cannot honour (a repeated backward, gradient accumulation) is refused there, and the gradient is scaled on
its way in."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch


class _FusedStepCounter:
    """Backward passes through one kernel since its optimizer's last step."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


_DOUBLE_BACKWARD = (
    "backward ran a second time through the same FusedPooledKernel output (retain_graph=True, or a double "
    "backward). A fused optimizer updates the tables inside backward, so the first backward has already applied "
    "the update and a second one cannot be honoured. Build a new forward for every backward, or turn "
    "accumulation mode on (fused_optimizer.accumulate = True) to sum several losses' gradients into one update."
)
_ACCUMULATION = (
    "a second backward reached FusedPooledKernel before the optimizer step. A fused optimizer updates the tables "
    "inside backward, so gradient accumulation, several backward passes per step, or several lookups through the "
    "same kernel per step would each be applied as a separate update. Turn accumulation mode on "
    "(fused_optimizer.accumulate = True, or kernel.accumulate = True; RecShardedStrategy does it for "
    "accumulate_grad_batches > 1): backward then keeps the gradients and FusedOptimizer.step() applies one update "
    "from their sum. Otherwise use one forward and one backward per step, then call FusedOptimizer.step() (or "
    "kernel.finish_step() when driving the kernel without a FusedOptimizer)."
)


class _FusedBackwardGuard(torch.autograd.Function):
    """Identity on the kernel's output; in backward: refuse a repeated backward, count it, scale the gradient."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, counter: _FusedStepCounter, grad_scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.counter = counter
        ctx.grad_scale = grad_scale
        ctx.used = False
        # detach(): an alias that is not an autograd view, so callers may still modify the output in place
        return out.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        if ctx.used:
            raise RuntimeError(_DOUBLE_BACKWARD)
        if ctx.counter.count >= 1:
            raise RuntimeError(_ACCUMULATION)
        ctx.used = True
        ctx.counter.count += 1
        if ctx.grad_scale != 1.0:
            grad = grad * ctx.grad_scale
        return grad, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None


def _as_int(x: Any) -> Any:
    """``x`` as a Python int when it is an integer of any kind (numpy, 0-d tensor), else unchanged."""
    try:
        return operator.index(x)
    except TypeError:
        return x


#: ``"sum"``: one pooled row per bag; ``"none"``: one row per id (sequence lookups)
POOLINGS = ("sum", "none")


def check_tables(
    tables: Sequence[tuple[str, int, int, torch.dtype]],
) -> tuple[list[str], list[int], list[int], torch.dtype]:
    """The fused kernel's ``(name, rows, dim, dtype)`` tables, checked: ``(names, rows, dims, dtype)``."""
    tables = list(tables)
    if not tables:
        raise ValueError("FusedPooledKernel needs at least one table")
    names, rows, dims, dtypes = [], [], [], []
    for entry in tables:
        if len(entry) != 4:
            raise ValueError(f"a table must be (name, rows, dim, dtype), got {entry!r}")
        name, r, d, dtype = entry
        r, d = _as_int(r), _as_int(d)
        if not isinstance(name, str) or not name:
            raise ValueError(f"table names must be non-empty strings, got {name!r}")
        if name in names:
            raise ValueError(f"table name {name!r} is used twice; table names must be unique")
        if not isinstance(r, int) or r < 1:
            raise ValueError(
                f"table {name!r}: the fused kernel needs at least one row, got rows={r!r} "
                "(a table with no rows on this rank must not be given to the kernel)"
            )
        if not isinstance(d, int) or d < 1 or d % 4:
            raise ValueError(
                f"table {name!r}: embedding dim {d!r} is not supported by the fused fbgemm kernel, which needs "
                "a positive multiple of 4 (use plain parameters with a torch optimizer for other dims)"
            )
        if dtype == torch.bfloat16:
            raise ValueError(
                f"table {name!r}: bfloat16 tables are not supported by the fused kernel (fbgemm has no "
                "bfloat16 CPU kernel for it); use torch.float32 or torch.float16"
            )
        if dtype not in (torch.float32, torch.float16):
            raise ValueError(f"table {name!r}: dtype {dtype} is not supported; use torch.float32 or torch.float16")
        names.append(name)
        rows.append(r)
        dims.append(d)
        dtypes.append(dtype)
    if len(set(dtypes)) > 1:
        detail = ", ".join(f"{n!r}: {d}" for n, d in zip(names, dtypes))
        raise ValueError(f"one fused kernel needs one dtype for all its tables, got {detail}")
    return names, rows, dims, dtypes[0]


def check_pooling(pooling: str, names: list[str], dims: list[int]) -> str:
    """``pooling`` checked against the tables: without pooling (one row per id) every table has one width,
    which fbgemm's no-bag mode needs (it asserts ``Mixed dimension tables only supported for pooling tables``)."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {list(POOLINGS)}, got {pooling!r}")
    if pooling == "none" and len(set(dims)) > 1:
        detail = ", ".join(f"{n!r}: {d}" for n, d in zip(names, dims))
        raise ValueError(
            f"a fused kernel without pooling (one row per id) needs one embedding dim for all its tables, got "
            f"{detail}; build one kernel per dim"
        )
    return pooling


def check_feature_table(feature_table: Sequence[int], names: list[str], pooled: bool = True) -> list[int]:
    """The fused kernel's feature -> table map, checked: every table read, features grouped by table (F2)."""
    ft = [int(t) for t in feature_table]
    if not ft:
        raise ValueError("FusedPooledKernel needs at least one feature")
    for f, t in enumerate(ft):
        if not 0 <= t < len(names):
            raise ValueError(f"feature {f} maps to table index {t}, outside [0, {len(names) - 1}]")
    for f in range(1, len(ft)):
        if ft[f] < ft[f - 1]:
            raise ValueError(
                f"feature_table must be non-decreasing (features grouped by table, in table order), got {ft}: "
                f"feature {f} (table {names[ft[f]]!r}) comes after feature {f - 1} (table {names[ft[f - 1]]!r}). "
                "fbgemm's kernels are silently wrong or crash otherwise (F2); sort the features by table "
                f"and permute the output {'columns' if pooled else 'rows'} afterwards"
            )
    unused = [names[t] for t in range(len(names)) if t not in set(ft)]
    if unused:
        raise ValueError(f"tables {unused} have no feature; fbgemm needs at least one feature per table")
    return ft
