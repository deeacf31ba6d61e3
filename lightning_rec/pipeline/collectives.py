"""Differentiable collectives and the one embedding-gradient scale (docs/ARCHITECTURE.md C2).

Every forward collective defines its backward next to it. Embedding gradients are scaled in exactly one
place, :func:`embedding_grad`, used alike by data-parallel replicas and by shards of sharded tables.

Under ``torch.compile`` the public collectives run eagerly (``torch.compiler.disable``: one graph break
each). Their split sizes are read back from tensors (sizes before payloads), which dynamo could trace only
as unbacked symbols, recompiling or breaking the graph at every read; eager, they are exact and cheap.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from lightning_rec import _compat, transport

EMBEDDING_GRAD_MODES = ("sum", "mean")
_BUCKET_ELEMENTS = 4_000_000


def _wire_dtype(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.dtype:
    # gloo has no bfloat16 arithmetic; fp32 carries every bf16 value exactly.
    if t.dtype == torch.bfloat16 and dist.get_backend(group) == "gloo":
        return torch.float32
    return t.dtype


def _all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    wire = _wire_dtype(x, group)
    out = torch.empty(sum(out_splits), dtype=wire, device=x.device)
    transport.all_to_all_single(out, x.to(wire).contiguous(), out_splits, in_splits, group)
    return out.to(x.dtype)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        anchor: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.x_grad = (out_splits, in_splits), group, x.requires_grad
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, None, None]:
        out_splits, in_splits = ctx.splits
        back = _all_to_all(grad.contiguous(), in_splits, out_splits, ctx.group)
        return (back if ctx.x_grad else None), None, None, None, None


@torch.compiler.disable
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
    if dist.get_world_size(group) == 1:  # to and from itself: the input is the output, its gradient too
        return x
    if differentiable or x.requires_grad:
        anchor = torch.zeros(0, requires_grad=True, device=x.device)
        return _AllToAll.apply(x, anchor, list(out_splits), list(in_splits), group)
    return _all_to_all(x, list(out_splits), list(in_splits), group)


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a small bookkeeping tensor may travel through ``group``: CPU if its backend takes CPU tensors
    (gloo), else the current CUDA device (NCCL sees only CUDA tensors)."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


@torch.compiler.disable
def all_gather_ints(
    values: list[int], group: dist.ProcessGroup | None, device: torch.device | str | None = None
) -> list[list[int]]:
    """Every rank's list of ints (all lists have the same length), exchanged on ``device``.

    ``device`` is the caller's module device (default: :func:`collective_device`).
    Example: rank 0 passes ``[3]``, rank 1 ``[5]``; both get ``[[3], [5]]``.
    """
    n = dist.get_world_size(group)
    dev = collective_device(group) if device is None else device
    local = torch.tensor(values, dtype=torch.long, device=dev)
    out = torch.empty(n * len(values), dtype=torch.long, device=dev)
    transport.all_gather_single(out, local, group)
    return out.view(n, len(values)).tolist()


def all_gather_padded(x: torch.Tensor, counts: list[int], group: dist.ProcessGroup) -> tuple[torch.Tensor, int]:
    """Every rank's ``x`` (``counts[i]`` rows on rank i of ``group``), each padded to the most rows: the
    gathered ``[ranks * stride, ...]`` tensor and ``stride``, where rank i's rows start (in x's dtype)."""
    wire = _wire_dtype(x, group)
    width = max(counts)
    if x.shape[0] == width and x.dtype == wire:
        padded = x.contiguous()
    else:
        padded = torch.zeros(width, *x.shape[1:], dtype=wire, device=x.device)
        padded[: x.shape[0]] = x
    gathered = torch.empty(width * len(counts), *x.shape[1:], dtype=wire, device=x.device)
    transport.all_gather_single(gathered, padded, group)
    return gathered.to(x.dtype), width


def _all_gather_rows(x: torch.Tensor, counts: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``x`` (``counts[i]`` rows on rank i of ``group``) stacked in group-rank order."""
    gathered, width = all_gather_padded(x, counts, group)
    if all(c == width for c in counts):  # no padding to drop
        return gathered
    return torch.cat([gathered[i * width : i * width + n] for i, n in enumerate(counts)])


def _own_rows(counts: list[int], group: dist.ProcessGroup) -> slice:
    start = sum(counts[: dist.get_rank(group)])
    return slice(start, start + counts[dist.get_rank(group)])


class _GatherUnion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, counts: list[int], group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.rows = _own_rows(counts, group)
        return _all_gather_rows(x, counts, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return grad[ctx.rows], None, None


class _OwnRowsOfUnion(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, union: torch.Tensor, anchor: torch.Tensor, counts: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.counts, ctx.group, ctx.union_grad = counts, group, union.requires_grad
        return union[_own_rows(counts, group)].clone()

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, None]:
        union = _all_gather_rows(grad.contiguous(), ctx.counts, ctx.group)
        return (union if ctx.union_grad else None), None, None, None


class _Tie(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.other = (other.shape, other.dtype, other.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        shape, dtype, device = ctx.other
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def tie_backward(x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``x`` unchanged; its backward also sends ``other`` a zero gradient.

    For a collective's output this rank does not use (per-sample weights received for shards it does not
    hold): every rank must run the collective's backward, so its output must be in every rank's graph.
    """
    return _Tie.apply(x, other)


@torch.compiler.disable
def gather_union(x: torch.Tensor, counts: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """The rows of every rank of ``group`` stacked in group-rank order (rank i holds ``counts[i]`` rows).

    For a batch that every rank of ``group`` then processes identically (the union batch of a fused
    lookup). Its backward keeps this rank's rows of the union's gradient, which is the exact gradient
    only because every rank computes the same union gradient (see :func:`own_rows_of_union`).

    Example with 2 ranks::

        rank 0: x=[a0 a1], counts=[2, 1]  ->  [a0 a1 b0]
        rank 1: x=[b0],    counts=[2, 1]  ->  [a0 a1 b0]
    """
    if x.requires_grad and torch.is_grad_enabled():
        return _GatherUnion.apply(x, list(counts), group)
    return _all_gather_rows(x, list(counts), group)


@torch.compiler.disable
def own_rows_of_union(union: torch.Tensor, counts: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's rows of a union batch computed on every rank; backward all-gathers every rank's row gradients.

    So the union's gradient on every rank of ``group`` is the same: the rows of each rank's gradient, in
    group-rank order. Backward runs this collective on every rank, whatever this rank's loss used.

    Example with 2 ranks, ``counts=[2, 1]``, union ``[u0 u1 u2]`` on both: rank 0 gets ``[u0 u1]``, rank 1
    ``[u2]``; gradients ``[g0 g1]`` and ``[h2]`` come back as the union gradient ``[g0 g1 h2]`` on both.
    """
    anchor = torch.zeros(0, requires_grad=True, device=union.device)
    return _OwnRowsOfUnion.apply(union, anchor, list(counts), group)


def _union_of_touched_rows(ids: list[torch.Tensor], rows: list[int], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Per table, the sorted rows any rank of ``group`` touched; one exchange for all tables."""
    dev = ids[0].device
    offsets = [0]
    for r in rows:
        offsets.append(offsets[-1] + r)
    # one id space (table t's row r is offsets[t] + r), so every table shares the same two collectives
    local = torch.unique(torch.cat([i.long() + off for i, off in zip(ids, offsets)]))
    counts = [c[0] for c in all_gather_ints([local.numel()], group, device=dev)]
    width = max(counts)
    padded = torch.full((width,), -1, dtype=torch.long, device=dev)
    padded[: local.numel()] = local
    gathered = torch.empty(width * len(counts), dtype=torch.long, device=dev)
    transport.all_gather_single(gathered, padded, group)
    union = torch.unique(gathered[gathered >= 0])
    bounds = torch.searchsorted(union, torch.tensor(offsets, dtype=torch.long, device=dev)).tolist()
    return [union[bounds[t] : bounds[t + 1]] - offsets[t] for t in range(len(rows))]


def _sum_touched_rows(
    grads: list[torch.Tensor], ids: list[torch.Tensor], shapes: list[torch.Size], group: dist.ProcessGroup
) -> list[torch.Tensor]:
    """Sum table gradients over ``group``, moving only rows some rank looked up (exact: the rest are 0).

    All tables travel in one all-reduce of the touched rows, flattened side by side.
    """
    unions = _union_of_touched_rows(ids, [s[0] for s in shapes], group)
    if all(g.is_sparse for g in grads) and len({g.dtype for g in grads}) == 1:
        return _sum_touched_rows_sparse(grads, unions, shapes, group)
    rows = []
    for g, u, shape in zip(grads, unions, shapes):
        if g.is_sparse:
            g = g.coalesce()
            r = torch.zeros(u.numel(), *shape[1:], dtype=g.dtype, device=g.device)
            r[torch.searchsorted(u, g.indices()[0])] = g.values()
        else:
            r = g.index_select(0, u)
        rows.append(r)
    buf_device = rows[0].device
    dtypes = {r.dtype for r in rows}
    wire = rows[0].dtype if len(dtypes) == 1 else torch.float32
    wire = _wire_dtype(torch.empty(0, dtype=wire, device=buf_device), group)
    buf = torch.cat([r.to(wire).reshape(-1) for r in rows])
    # moderate buckets: gloo's all-reduce of one buffer of hundreds of MB is slower than of its pieces
    for piece in torch.split(buf, _BUCKET_ELEMENTS):
        transport.all_reduce_sum(piece, group)
    out = []
    for g, u, r, part in zip(grads, unions, rows, torch.split(buf, [r.numel() for r in rows])):
        summed = part.view(r.shape).to(r.dtype)
        out.append(
            torch.sparse_coo_tensor(u.unsqueeze(0), summed, g.shape, check_invariants=False)
            if g.is_sparse
            else g.index_copy(0, u, summed)
        )
    return out


def _sum_touched_rows_sparse(
    grads: list[torch.Tensor], unions: list[torch.Tensor], shapes: list[torch.Size], group: dist.ProcessGroup
) -> list[torch.Tensor]:
    """:func:`_sum_touched_rows` for sparse gradients of one dtype: each table's rows are added into its piece
    of the one all-reduce buffer (no coalesce, no concatenation) and come back as coalesced sparse gradients."""
    dtype, dev = grads[0].dtype, grads[0].device
    wire = _wire_dtype(torch.empty(0, dtype=dtype, device=dev), group)
    sizes = [u.numel() * math.prod(shape[1:]) for u, shape in zip(unions, shapes)]
    buf = torch.zeros(sum(sizes), dtype=dtype, device=dev)
    pieces = [part.view(u.numel(), *shape[1:]) for part, u, shape in zip(torch.split(buf, sizes), unions, shapes)]
    for g, u, part in zip(grads, unions, pieces):
        # every id this rank looked up is in the union; duplicates add up, as coalescing would sum them
        ids, values = _compat.sparse_rows(g)
        part.index_add_(0, torch.searchsorted(u, ids), values)
    wire_buf = buf.to(wire)
    for piece in torch.split(wire_buf, _BUCKET_ELEMENTS):
        transport.all_reduce_sum(piece, group)
    if wire_buf is not buf:
        buf.copy_(wire_buf)
    return [
        torch.sparse_coo_tensor(u.unsqueeze(0), part, g.shape, check_invariants=False, is_coalesced=True)
        for g, u, part in zip(grads, unions, pieces)
    ]


class _EmbeddingGrad(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, group: dist.ProcessGroup | None, scale: float, n: int, *weights_and_ids: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        weights, ids = weights_and_ids[:n], weights_and_ids[n:]
        ctx.save_for_backward(*ids)
        ctx.group, ctx.scale = group, scale
        ctx.meta = [(w.shape, w.dtype, w.device) for w in weights]
        return tuple(w.view_as(w) for w in weights)

    @staticmethod
    def backward(ctx: Any, *incoming: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        ids = list(ctx.saved_tensors)
        # a table whose output fed nothing still joins the exchange, with a zero gradient
        grads = [torch.zeros(s, dtype=d, device=dev) if g is None else g for g, (s, d, dev) in zip(incoming, ctx.meta)]
        if ctx.group is not None:
            grads = _sum_touched_rows(grads, ids, [s for s, _, _ in ctx.meta], ctx.group)
        if ctx.scale != 1.0:
            grads = [g * ctx.scale for g in grads]
        return (None, None, None, *grads, *([None] * len(ids)))


def grad_scale(embedding_grad: str, num_data_parallel_ranks: int) -> float:
    if embedding_grad not in EMBEDDING_GRAD_MODES:
        raise ValueError(f"embedding_grad must be one of {EMBEDDING_GRAD_MODES}, got {embedding_grad!r}")
    return 1.0 / num_data_parallel_ranks if embedding_grad == "mean" else 1.0


def embedding_grad(
    weights: list[torch.Tensor], ids: list[torch.Tensor], reduce_group: dist.ProcessGroup | None, scale: float
) -> list[torch.Tensor]:
    """The weights as the lookup sees them; in backward their gradients are summed over ``reduce_group`` and scaled.

    ``ids[t]`` are the rows this rank looks up in ``weights[t]``. ``reduce_group`` is the data-parallel
    group for replicated tables (the replica group for shards under 2D parallelism; None for shards in
    one group) and only rows some rank touched are communicated, for all tables in one exchange.
    ``scale`` is 1 for ``embedding_grad="sum"`` and ``1 / data-parallel ranks`` for ``"mean"``.

    Example, 2 ranks, replicated table, ``"sum"``: rank 0 touches row 3 with gradient g0, rank 1 touches
    rows 3 and 5 with g1, h1; both ranks end with row 3 = g0 + g1, row 5 = h1, all other rows 0.
    """
    if reduce_group is not None and dist.get_world_size(reduce_group) == 1:
        reduce_group = None
    if not weights or not any(w.requires_grad for w in weights) or (reduce_group is None and scale == 1.0):
        return list(weights)
    return _apply_embedding_grad(weights, ids, reduce_group, scale)


@torch.compiler.disable  # a graph break only where a reduction or a scale is applied
def _apply_embedding_grad(
    weights: list[torch.Tensor], ids: list[torch.Tensor], reduce_group: dist.ProcessGroup | None, scale: float
) -> list[torch.Tensor]:
    return list(_EmbeddingGrad.apply(reduce_group, scale, len(weights), *weights, *[i.detach().long() for i in ids]))
