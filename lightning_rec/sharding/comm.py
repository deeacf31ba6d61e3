"""Differentiable collectives and the one embedding-gradient scale (DESIGN.md rule 2).

Every forward collective defines its backward next to it. Embedding gradients are scaled in exactly one
place, :func:`embedding_grad`, used alike by data-parallel replicas and by shards of sharded tables.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

EMBEDDING_GRAD_MODES = ("sum", "mean")

# torch 2.13 renamed all_gather_into_tensor (the old name warns); both exist there.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _wire_dtype(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.dtype:
    # gloo has no bfloat16 arithmetic; fp32 carries every bf16 value exactly.
    if t.dtype == torch.bfloat16 and dist.get_backend(group) == "gloo":
        return torch.float32
    return t.dtype


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    wire = _wire_dtype(x, group)
    out = torch.empty(sum(out_splits), dtype=wire, device=x.device)
    dist.all_to_all_single(out, x.to(wire).contiguous(), out_splits, in_splits, group=group)
    return out.to(x.dtype)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, anchor, out_splits, in_splits, group):  # type: ignore[override]
        ctx.splits, ctx.group, ctx.x_grad = (out_splits, in_splits), group, x.requires_grad
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        back = _all_to_all(grad.contiguous(), in_splits, out_splits, ctx.group)
        return (back if ctx.x_grad else None), None, None, None, None


def all_to_all(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup | None,
    differentiable: bool = False,
) -> torch.Tensor:
    """Variable-size all-to-all of a 1-D tensor; its backward is the reverse all-to-all.

    With ``differentiable=True`` the backward runs on every rank whenever the output is
    back-propagated, even on a rank whose own input needs no gradient (it holds no shard): a rank that
    skipped its half of the backward exchange would leave the others waiting.

    Example with 2 ranks, ``in_splits`` = what this rank sends to each rank::

        rank 0: x=[a0 a1 a2], in_splits=[1, 2]   ->  out=[a0 b0],     out_splits=[1, 1]
        rank 1: x=[b0 b1],    in_splits=[1, 1]   ->  out=[a1 a2 b1],  out_splits=[2, 1]
    """
    if differentiable or x.requires_grad:
        anchor = torch.zeros(0, requires_grad=True)
        return _AllToAll.apply(x, anchor, list(out_splits), list(in_splits), group)
    return _all_to_all(x, list(out_splits), list(in_splits), group)


def all_gather_ints(values: list[int], group: dist.ProcessGroup | None) -> list[list[int]]:
    """Every rank's list of ints (all lists have the same length).

    Example: rank 0 passes ``[3]``, rank 1 ``[5]``; both get ``[[3], [5]]``.
    """
    n = dist.get_world_size(group)
    local = torch.tensor(values, dtype=torch.long)
    out = torch.empty(n * len(values), dtype=torch.long)
    _all_gather_single(out, local, group=group)
    return out.view(n, len(values)).tolist()


def _union_of_touched_rows(ids: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    local = torch.unique(ids)
    counts = [c[0] for c in all_gather_ints([local.numel()], group)]
    width = max(counts)
    padded = torch.full((width,), -1, dtype=torch.long, device=ids.device)
    padded[: local.numel()] = local
    gathered = torch.empty(width * len(counts), dtype=torch.long, device=ids.device)
    _all_gather_single(gathered, padded, group=group)
    return torch.unique(gathered[gathered >= 0])


def _all_reduce(rows: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    wire = _wire_dtype(rows, group)
    buf = rows.to(wire).contiguous()
    dist.all_reduce(buf, group=group)
    return buf.to(rows.dtype)


def _sum_touched_rows(grad: torch.Tensor, ids: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum a table gradient over ``group``, moving only the rows some rank looked up (exact: the rest are 0)."""
    union = _union_of_touched_rows(ids, group)
    if grad.is_sparse:
        grad = grad.coalesce()
        rows = torch.zeros(union.numel(), *grad.shape[1:], dtype=grad.dtype, device=grad.device)
        rows[torch.searchsorted(union, grad.indices()[0])] = grad.values()
        rows = _all_reduce(rows, group)
        return torch.sparse_coo_tensor(union.unsqueeze(0), rows, grad.shape)
    rows = _all_reduce(grad.index_select(0, union), group)
    return grad.index_copy(0, union, rows)


class _EmbeddingGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, ids, group, scale):  # type: ignore[override]
        ctx.save_for_backward(ids)
        ctx.group, ctx.scale = group, scale
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (ids,) = ctx.saved_tensors
        if ctx.group is not None:
            grad = _sum_touched_rows(grad, ids, ctx.group)
        if ctx.scale != 1.0:
            grad = grad * ctx.scale
        return grad, None, None, None


def grad_scale(embedding_grad: str, num_data_parallel_ranks: int) -> float:
    if embedding_grad not in EMBEDDING_GRAD_MODES:
        raise ValueError(f"embedding_grad must be one of {EMBEDDING_GRAD_MODES}, got {embedding_grad!r}")
    return 1.0 / num_data_parallel_ranks if embedding_grad == "mean" else 1.0


def embedding_grad(
    weight: torch.Tensor, ids: torch.Tensor, reduce_group: dist.ProcessGroup | None, scale: float
) -> torch.Tensor:
    """The weight as the lookup sees it; in backward its gradient is summed over ``reduce_group`` and scaled.

    ``ids`` are the rows this rank looks up. ``reduce_group`` is the data-parallel group for replicated
    tables (the replica group for shards under 2D parallelism; None for shards in one group) and only
    rows some rank touched are communicated. ``scale`` is 1 for ``embedding_grad="sum"`` and
    ``1 / data-parallel ranks`` for ``"mean"``.

    Example, 2 ranks, replicated table, ``"sum"``: rank 0 touches row 3 with gradient g0, rank 1 touches
    rows 3 and 5 with g1, h1; both ranks end with row 3 = g0 + g1, row 5 = h1, all other rows 0.
    """
    if reduce_group is not None and dist.get_world_size(reduce_group) == 1:
        reduce_group = None
    if not weight.requires_grad or (reduce_group is None and scale == 1.0):
        return weight
    return _EmbeddingGrad.apply(weight, ids.detach().long(), reduce_group, scale)
