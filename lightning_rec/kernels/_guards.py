"""What a lookup is given, checked: where a kernel would crash, read out of bounds or be silently wrong, one clear
error names the feature, table or call instead.

- Ids and offsets, on every lookup path: an id outside its table, or broken offsets. fbgemm's bounds check lets -1
  through and its CPU kernels read out of bounds for larger ids (F14), and ``F.embedding_bag`` raises an index
  error that names no feature.
- The fused kernel's tables, pooling and feature -> table map, at construction: fbgemm's kernels are silently
  wrong or crash on others (F2, F6, F18).
- The fused kernel's backward: a fused optimizer updates inside backward, so what it cannot honour (a repeated
  backward, gradient accumulation) is refused there, and the gradient is scaled on its way in.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch


def check_ids(
    values: torch.Tensor,
    lengths: Sequence[int],
    rows: torch.Tensor,
    feature_names: Sequence[object],  # names, or feature indices where the caller has no names
    table_of_feature: Sequence[str],
) -> None:
    """Raise a ValueError naming feature, table, value and range for the first id outside ``[0, rows)``.

    ``lengths[f]`` ids of feature ``f`` (sizes the host holds) follow each other in ``values``; ``rows[f]`` is
    its table's size.
    """
    if values.numel() == 0:
        return
    # each feature's extremes against its table's size: one pass over the ids, and reading the verdict is the one
    # host sync (a per-id comparison with each id's own bound cost 10x more on CPU)
    pieces = values.split(list(lengths))
    keep = [f for f, k in enumerate(lengths) if k]
    extremes = [pieces[f].aminmax() for f in keep]
    mins = torch.stack([m.min for m in extremes])
    maxs = torch.stack([m.max for m in extremes])
    bad = (mins < 0) | (maxs >= rows[keep])
    if not bool(bad.any()):
        return
    # an id is out of range: find it and say where (syncs are fine on the way to raise)
    f = keep[int(torch.nonzero(bad)[0])]
    r, piece = int(rows[f]), pieces[f]
    value = int(piece[int(torch.nonzero((piece < 0) | (piece >= r))[0])])
    hint = " (-1 is usually padding: filter it out before the lookup)" if value == -1 else ""
    raise ValueError(
        f"feature {feature_names[f]!r} (table {table_of_feature[f]!r}) has id {value}, "
        f"outside the valid range [0, {r - 1}] (num_embeddings={r}){hint}"
    )


def validate_ids(
    values: torch.Tensor,
    length_per_feature: Sequence[int],
    rows_per_feature: Sequence[int],
    feature_names: Sequence[str],
    table_of_feature: Sequence[str],
) -> None:
    """Raise a ValueError naming feature, table, value and range for the first out-of-range id."""
    if values.numel() == 0:
        return
    rows = torch.as_tensor(list(rows_per_feature), dtype=torch.long, device=values.device)
    check_ids(values, length_per_feature, rows, feature_names, table_of_feature)


def check_offsets(values: torch.Tensor, offsets: torch.Tensor, batch: int) -> list[int]:
    """Feature-major ``offsets`` (``features * batch + 1``) must start at 0, never decrease, end at ``len(values)``.
    Returns where each feature's ids start, and the end (``offsets[::batch]``), read in the same host sync (none
    for a batch of 0)."""
    n = values.numel()
    if batch == 0:
        if n or int(offsets[0]) != 0:
            raise ValueError(f"batch size 0 but {n} ids (offsets {offsets.tolist()})")
        return []
    *bounds, decreasing = torch.cat([offsets[::batch], (offsets.diff() < 0).any().view(1)]).tolist()  # one sync
    first, last = bounds[0], bounds[-1]
    if first != 0 or last != n or decreasing:
        raise ValueError(
            f"offsets must start at 0, never decrease and end at the number of ids ({n}); "
            f"got first {first}, last {last}"
        )
    return bounds


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
