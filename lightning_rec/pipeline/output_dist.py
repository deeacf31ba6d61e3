"""Stage 3, the output dist: pooled rows back to each sample's rank, placed into the ``[batch, sum of dims]``
output as they come out of the exchange; and the sequence collections' output dist.

Every block (the data-parallel tables' pooled rows, and each rank's pooled rows for this rank's samples)
lands as the column groups the routing table keeps (``RoutingTable.colmap_runs``): each group is one
strided copy, or add where an earlier block wrote those columns (``colmap_add``: row blocks of a table add
up). The placing happens inside the exchange (docs/ARCHITECTURE.md, "How the bytes move"): every rank's
rows are copied or added into their columns straight out of the buffer that brought them, and backward
gathers each block's gradient from the same groups straight into the reverse exchange, with no flat buffer
on either side. One path serves every layout and group size; where the shard group spans hosts and a host holds
columns twice (row blocks), the hierarchical exchange of ``host_output_dist.py`` runs instead (unquantized).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_rec import transport
from lightning_rec.pipeline import collectives as comm
from lightning_rec.pipeline.host_output_dist import hierarchical_output_dist, host_plan
from lightning_rec.pipeline.input_dist import Received, regroup
from lightning_rec.pipeline.placement import _group_view, _put, _take
from lightning_rec.pipeline.qcomm import QuantizedCommCodecs
from lightning_rec.pipeline.routing import ColumnMap, RoutingTable
from lightning_rec.plans.shard_geometry import offsets_of


@torch.compiler.disable
def pooled_output_dist(
    pooled: torch.Tensor,
    dp_pooled: torch.Tensor | None,
    routing: RoutingTable,
    batches: list[int],
    b: int,
    group: dist.ProcessGroup,
    codecs: QuantizedCommCodecs | None = None,
) -> torch.Tensor:
    """The ``[b, width]`` output of this rank's samples: every rank's pooled rows for them (``pooled`` is this
    rank's lookup, ``[sum(batches), its route columns]``) and ``dp_pooled``, the data-parallel tables' pooled
    rows (or None), each in its columns. Backward runs on every rank (an anchor needs a gradient even where
    ``pooled`` does not), as :func:`collectives.all_to_all`'s does. ``codecs``: the wire precision of the rows
    and of their gradients (``qcomm.py``; None: as they are)."""
    if codecs is None or (codecs.forward.is_identity and codecs.backward.is_identity):
        # rows of one host's row blocks added there before they cross (host_output_dist.py), where that saves bytes
        plan = host_plan(routing, group) if dist.get_world_size(group) > 1 else None
        if plan is not None:
            return hierarchical_output_dist(pooled, dp_pooled, routing, plan, batches, b, group)
    anchor = torch.zeros(0, device=pooled.device, requires_grad=torch.is_grad_enabled())
    dp = () if dp_pooled is None else (dp_pooled,)
    return _PooledOutputDist.apply(pooled, anchor, routing, tuple(batches), b, group, codecs, *dp)


class _PooledOutputDist(torch.autograd.Function):
    """Every rank's pooled rows for this rank's samples are copied or added into their columns straight out of
    the exchange, the blocks in routing order (data-parallel block first), so the sums are the same bits on
    every layout; backward sends each rank its block's gradient, gathered from the output's columns (no copy
    where the block is one group), into the rows of the pooled gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        pooled: torch.Tensor,
        anchor: torch.Tensor,
        routing: RoutingTable,
        batches: tuple[int, ...],
        b: int,
        group: dist.ProcessGroup,
        codecs: QuantizedCommCodecs | None,
        *dp: torch.Tensor,
    ) -> torch.Tensor:
        runs, adds, cols_from = routing.colmap_runs, routing.colmap_add, routing.cols_from
        zero = routing.colmap_kind is ColumnMap.SUM
        out = (torch.zeros if zero else torch.empty)(b, routing.feat_off[-1], dtype=pooled.dtype, device=pooled.device)
        mine = pooled.shape[1]
        fwd = None if codecs is None or codecs.forward.is_identity else codecs.forward
        wire = pooled if fwd is None else fwd.encode(pooled)
        sends = [[x] for x in torch.split(wire.reshape(-1), [n * mine for n in batches])]

        def block(piece: torch.Tensor, width: int) -> torch.Tensor:
            piece = piece.view(b, width)
            # a scaled block is unscaled on its way in (one more pass); an unscaled one is widened by _put's copy
            return fwd.decode(piece, out.dtype) if fwd is not None and fwd.scale is not None else piece

        def place(got: list[list[torch.Tensor]]) -> torch.Tensor:
            blocks = [(dp[0], runs[0], adds[0])] if dp else []
            blocks += [(block(pieces[0], cols_from[s]), runs[s + 1], adds[s + 1]) for s, pieces in enumerate(got)]
            _put(out, blocks)
            return out

        transport.all_to_all_pieces(sends, [[b * w] for w in cols_from], place, group, pooled.device).wait()
        ctx.routing, ctx.batches, ctx.b, ctx.group, ctx.shape = routing, batches, b, group, pooled.shape
        ctx.dp_shape = dp[0].shape if dp else None
        ctx.codecs = codecs
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        routing, b = ctx.routing, ctx.b
        bwd = None if ctx.codecs is None or ctx.codecs.backward.is_identity else ctx.codecs.backward
        wire = grad if bwd is None else bwd.encode(grad)
        sends: list[list[torch.Tensor]] = []
        for groups, w in zip(routing.colmap_runs[1:], routing.cols_from):
            if not groups:
                sends.append([])
            elif len(groups) == 1 and groups[0][0] == 0 and groups[0][2] * groups[0][3] == w:
                _, dst, n, count, step = groups[0]  # the block's row-major order is this view's
                sends.append([_group_view(wire, dst, n, count, step)])
            else:
                block = torch.empty(b, w, dtype=wire.dtype, device=grad.device)
                _take(block, wire, groups)
                sends.append([block])
        grad_pooled = torch.empty(ctx.shape, dtype=wire.dtype, device=grad.device)
        recvs = [[x] for x in torch.split(grad_pooled.view(-1), [n * ctx.shape[1] for n in ctx.batches])]
        transport.all_to_all_views(sends, recvs, ctx.group)
        if bwd is not None:
            grad_pooled = bwd.decode(grad_pooled, grad.dtype)
        grad_dp = None
        if ctx.dp_shape is not None:
            dp_runs = routing.colmap_runs[0]
            whole = b * sum(n * count for _, _, n, count, _ in dp_runs) == ctx.dp_shape.numel()
            grad_dp = (torch.empty if whole else torch.zeros)(ctx.dp_shape, dtype=grad.dtype, device=grad.device)
            _take(grad_dp, grad, dp_runs)
        return (grad_pooled if ctx.needs_input_grad[0] else None), None, None, None, None, None, None, grad_dp


@torch.compiler.disable
def sequence_output_dist(
    embs: list[torch.Tensor],
    recv: Received,
    routing: RoutingTable,
    dims: list[int],
    wire: torch.dtype,
    group: dist.ProcessGroup,
    device: torch.device,
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Send every id's embedding (columns of its shard) back to the id's rank.

    ``embs[k]`` holds route ``k``'s per-id rows (source-major). Returns, per feature, ``(flat index into the
    feature's [ids, dim] output, values)`` pieces to be summed into place.
    """
    mine = routing.my_routes
    n_mine, n_ranks = len(mine), routing.group_size
    cols = [r.shard.cols for r in mine]
    flat = torch.cat([e.to(wire).reshape(-1) for e in embs]) if embs else torch.zeros(0, dtype=wire, device=device)
    # route-major [route][source] -> source-major [source][route], in elements
    elems = [recv.ids_from[s][k] * cols[k] for k in range(n_mine) for s in range(n_ranks)]
    flat = regroup(flat, elems, n_mine, n_ranks)
    send = [sum(recv.ids_from[s][k] * cols[k] for k in range(n_mine)) for s in range(n_ranks)]
    all_routes = routing.all_routes
    starts = offsets_of([len(x) for x in routing.routes_to])
    recv_sizes = [
        sum(n * r.shard.cols for n, r in zip(recv.sent[i0 : i0 + len(lst)], lst))
        for i0, lst in zip(starts, routing.routes_to)
    ]
    back = comm.all_to_all(flat, recv_sizes, send, group, differentiable=torch.is_grad_enabled())
    chunks = torch.split(back, [n * r.shard.cols for n, r in zip(recv.sent, all_routes)])
    pieces: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in dims]
    for r, chunk, pos, n in zip(all_routes, chunks, recv.positions, recv.sent):
        d = dims[r.feature]
        if pos is None:
            pos = torch.arange(n, device=device)
        cols_r = torch.arange(r.shard.cols, device=device)
        idx = (pos.unsqueeze(1) * d + r.shard.col_offset + cols_r).reshape(-1)
        pieces[r.feature].append((idx, chunk))
    return pieces
