"""Stage 3's last step: pooled blocks into the columns of the ``[batch, sum of dims]`` output.

Every block (the data-parallel tables' pooled rows, and each rank's pooled rows for this rank's samples)
lands as the groups of column runs the routing table keeps (``RoutingTable.colmap_runs``): each group is
one strided copy, or add where an earlier block wrote those columns (``colmap_add``: row blocks of a table
add up). Backward gathers each block's gradient back from the same groups.

Across ranks the placing happens inside the exchange (docs/ARCHITECTURE.md, "How the bytes move"): every
rank's rows are copied or added into their columns straight out of the shared-memory buffer that brought
them (:func:`exchange_and_place`; :func:`exchange_into_place` where each rank's block is one group that
only copies), and the gradient leaves from the output's columns the same way, with no flat buffer on
either side.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_rec import transport
from lightning_rec.pipeline.routing import RoutingTable

Part = tuple  # (source, first element in it, width, column groups, adds): one [b, width] block of the output


def place_columns(parts: list[Part], kind: str, b: int, width: int, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """The ``[b, width]`` output from blocks that land as their column groups (routing's ``colmap_runs``) say.

    A part is ``(source, offset, w, groups, adds)``: the block is ``source`` itself (2-D) or ``source[offset :
    offset + b * w]`` viewed ``[b, w]`` (1-D); ``adds[i]``: group ``i`` adds onto the output rather than
    copying into it (routing's ``colmap_add``). One block in order is returned as is; otherwise every group
    of runs is one strided copy or add, onto zeros for ``kind`` "sum".
    """
    kept = [p for p in parts if p[3]]
    if not kept:
        return torch.zeros(b, width, dtype=dtype, device=device)
    if kind == "identity" and len(kept) == 1:
        return _block(kept[0][0], kept[0][1], kept[0][2], b)
    sources: list[torch.Tensor] = []
    layout = []
    for source, offset, w, groups, adds in kept:
        i = next((k for k, t in enumerate(sources) if t is source), None)
        if i is None:
            i = len(sources)
            sources.append(source)
        layout.append((i, offset, w, groups, adds))
    return _PlaceColumns.apply(tuple(layout), kind == "sum", b, width, *sources)


def _block(source: torch.Tensor, offset: int, w: int, b: int) -> torch.Tensor:
    if source.dim() == 2:
        return source
    if offset == 0 and b * w == source.numel():  # the whole buffer: a view, whose backward is free (a slice's
        return source.view(b, w)  # allocates and zero-fills the whole buffer, then copies the gradient in)
    return source[offset : offset + b * w].view(b, w)


def _group_view(t: torch.Tensor, first: int, n: int, count: int, step: int) -> torch.Tensor:
    """``[rows, count, n]`` view of ``count`` runs of ``n`` columns of the 2-D ``t``, ``step`` columns apart."""
    s0, s1 = t.stride()
    return t.as_strided((t.shape[0], count, n), (s0, step * s1, s1), t.storage_offset() + first * s1)


def _put(out: torch.Tensor, blocks: list[tuple[torch.Tensor, tuple, tuple]]) -> None:
    """Each ``(block, groups, adds)``'s column groups copied (or added) into ``out``, in order. A copy that the
    next group adds onto (the same columns: row blocks of a table) is one ``add`` of the two, one pass fewer
    over those columns, with the same bits."""
    ops = [(geom, _group_view(block, geom[0], geom[2], geom[3], geom[2]), add)
           for block, groups, adds in blocks for geom, add in zip(groups, adds)]
    i = 0
    while i < len(ops):
        (_, dst, n, count, step), piece, add = ops[i]
        place = _group_view(out, dst, n, count, step)
        if not add and i + 1 < len(ops) and ops[i + 1][2] and ops[i + 1][0][1:] == ops[i][0][1:]:
            torch.add(piece, ops[i + 1][1], out=place)
            i += 2
            continue
        if add:
            place += piece
        else:
            place.copy_(piece)
        i += 1


def _take(block: torch.Tensor, grad: torch.Tensor, groups: tuple) -> None:
    """The gradient of ``block``'s column groups, gathered from the output's gradient."""
    for src, dst, n, count, step in groups:
        _group_view(block, src, n, count, n).copy_(_group_view(grad, dst, n, count, step))


class _PlaceColumns(torch.autograd.Function):
    """Groups of column runs copied (or added) into one output; backward gathers them back into each source.

    In place of ``index_copy_`` / ``index_add_`` over single columns: a group is one strided copy, and the
    gradient of a flat source is written into one flat buffer.
    """

    @staticmethod
    def forward(ctx, layout, zero: bool, b: int, width: int, *sources: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        first = sources[0]
        out = (torch.zeros if zero else torch.empty)(b, width, dtype=first.dtype, device=first.device)
        _put(out, [(_block(sources[i], offset, w, b), groups, adds) for i, offset, w, groups, adds in layout])
        ctx.layout, ctx.b = layout, b
        ctx.shapes = [(t.shape, t.numel()) for t in sources]
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        covered = [0] * len(ctx.shapes)
        for i, _, _, groups, _ in ctx.layout:
            covered[i] += ctx.b * sum(n * count for _, _, n, count, _ in groups)
        grads = [(torch.empty if c == numel else torch.zeros)(shape, dtype=grad.dtype, device=grad.device)
                 for (shape, numel), c in zip(ctx.shapes, covered)]
        for i, offset, w, groups, _ in ctx.layout:
            _take(_block(grads[i], offset, w, ctx.b), grad, groups)
        return None, None, None, None, *grads


@torch.compiler.disable
def exchange_into_place(pooled: torch.Tensor, groups: tuple, batches: list[int], b: int, width: int,
                        group: dist.ProcessGroup) -> torch.Tensor:
    """Stage 3 and the placing in one exchange where every rank's block is one group that copies
    (``RoutingTable.direct_groups``): the ``[b, width]`` output. Backward runs on every rank (the anchor needs
    a gradient even where ``pooled`` does not), as :func:`comm.all_to_all`'s does."""
    anchor = torch.zeros(0, device=pooled.device, requires_grad=torch.is_grad_enabled())
    return _ExchangeIntoPlace.apply(pooled, anchor, groups, tuple(batches), b, width, group)


class _ExchangeIntoPlace(torch.autograd.Function):
    """Each rank's pooled rows for this rank's samples land in their columns of the output, one strided copy
    out of the exchange (no flat buffer, no second copy); the gradient leaves from those columns the same way."""

    @staticmethod
    def forward(ctx, pooled, anchor, groups, batches, b: int, width: int, group):  # type: ignore[override]
        out = torch.empty(b, width, dtype=pooled.dtype, device=pooled.device)
        mine = pooled.shape[1]
        sends = [[x] for x in torch.split(pooled.reshape(-1), [n * mine for n in batches])]
        recvs = [[] if g is None else [_group_view(out, g[1], g[2], g[3], g[4])] for g in groups]
        transport.all_to_all_views(sends, recvs, group)
        ctx.groups, ctx.batches, ctx.group, ctx.shape = groups, batches, group, pooled.shape
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad_pooled = torch.empty(ctx.shape, dtype=grad.dtype, device=grad.device)
        sends = [[] if g is None else [_group_view(grad, g[1], g[2], g[3], g[4])] for g in ctx.groups]
        recvs = [[x] for x in torch.split(grad_pooled.view(-1), [n * ctx.shape[1] for n in ctx.batches])]
        transport.all_to_all_views(sends, recvs, ctx.group)
        return (grad_pooled if ctx.needs_input_grad[0] else None), None, None, None, None, None, None


@torch.compiler.disable
def exchange_and_place(pooled: torch.Tensor, dp_pooled: torch.Tensor | None, routing: RoutingTable,
                       batches: list[int], b: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Stage 3 and the placing in one exchange for any layout (blocks that add up, blocks of several groups,
    data-parallel columns): the ``[b, width]`` output. ``dp_pooled``: the data-parallel tables' pooled rows
    (routing's first part), or None. Backward runs on every rank, as :func:`exchange_into_place`'s does."""
    anchor = torch.zeros(0, device=pooled.device, requires_grad=torch.is_grad_enabled())
    dp = () if dp_pooled is None else (dp_pooled,)
    return _ExchangeAndPlace.apply(pooled, anchor, routing, tuple(batches), b, group, *dp)


class _ExchangeAndPlace(torch.autograd.Function):
    """Every rank's pooled rows for this rank's samples are copied or added into their columns straight out of
    the exchange (the blocks in routing order, so the sums are the ones :class:`_PlaceColumns` makes, bitwise);
    backward sends each rank its block's gradient, gathered from the output's columns (no copy where the block
    is one group), into the rows of the pooled gradient."""

    @staticmethod
    def forward(ctx, pooled, anchor, routing: RoutingTable, batches, b: int, group, *dp):  # type: ignore[override]
        runs, adds, cols_from = routing.colmap_runs, routing.colmap_add, routing.cols_from
        zero = routing.colmap_kind == "sum"
        out = (torch.zeros if zero else torch.empty)(b, routing.feat_off[-1], dtype=pooled.dtype,
                                                      device=pooled.device)
        mine = pooled.shape[1]
        sends = [[x] for x in torch.split(pooled.reshape(-1), [n * mine for n in batches])]

        def place(got: list[list[torch.Tensor]]) -> torch.Tensor:
            blocks = [(dp[0], runs[0], adds[0])] if dp else []
            blocks += [(pieces[0].view(b, cols_from[s]), runs[s + 1], adds[s + 1]) for s, pieces in enumerate(got)]
            _put(out, blocks)
            return out

        transport.all_to_all_pieces(sends, [[b * w] for w in cols_from], place, group, pooled.device).wait()
        ctx.routing, ctx.batches, ctx.b, ctx.group, ctx.shape = routing, batches, b, group, pooled.shape
        ctx.dp_shape = dp[0].shape if dp else None
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        routing, b = ctx.routing, ctx.b
        sends: list[list[torch.Tensor]] = []
        for groups, w in zip(routing.colmap_runs[1:], routing.cols_from):
            if not groups:
                sends.append([])
            elif len(groups) == 1 and groups[0][0] == 0 and groups[0][2] * groups[0][3] == w:
                _, dst, n, count, step = groups[0]  # the block's row-major order is this view's
                sends.append([_group_view(grad, dst, n, count, step)])
            else:
                block = torch.empty(b, w, dtype=grad.dtype, device=grad.device)
                _take(block, grad, groups)
                sends.append([block])
        grad_pooled = torch.empty(ctx.shape, dtype=grad.dtype, device=grad.device)
        recvs = [[x] for x in torch.split(grad_pooled.view(-1), [n * ctx.shape[1] for n in ctx.batches])]
        transport.all_to_all_views(sends, recvs, ctx.group)
        grad_dp = None
        if ctx.dp_shape is not None:
            dp_runs = routing.colmap_runs[0]
            whole = b * sum(n * count for _, _, n, count, _ in dp_runs) == ctx.dp_shape.numel()
            grad_dp = (torch.empty if whole else torch.zeros)(ctx.dp_shape, dtype=grad.dtype, device=grad.device)
            _take(grad_dp, grad, dp_runs)
        return (grad_pooled if ctx.needs_input_grad[0] else None), None, None, None, None, None, grad_dp
