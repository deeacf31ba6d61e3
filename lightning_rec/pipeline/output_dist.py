"""Stage 3, the output dist: pooled rows back to each sample's rank, placed into the ``[batch, sum of dims]``
output as they come out of the exchange (:class:`PooledOutputDist`); and the sequence collections' output dist
(:class:`SequenceOutputDist`).

Each is an object built once per layout, when the collection is built (and moved with it), holding what does
not change from batch to batch: the routing, the group, the column placement (``routing.py``), the wire
codecs (``qcomm.py``) and, between hosts, the host blocks and the host's group (``host_output_dist.py``); its
variant is an :class:`OutputDistKind`. A call takes one batch's lookups and batch sizes.

Every block (the data-parallel tables' pooled rows, and each rank's pooled rows for this rank's samples) lands
as the column groups of its :class:`~lightning_rec.pipeline.routing.ColumnPlacement`: each group is one
strided copy, or add where an earlier block wrote those columns (row blocks of a table add up). The placing
happens inside the exchange (docs/ARCHITECTURE.md, "How the bytes move"): every rank's rows are copied or added
into their columns straight out of the buffer that brought them, and backward gathers each block's gradient
from the same groups straight into the reverse exchange, with no flat buffer on either side. One path serves
every layout and group size; where the shard group spans hosts and a host holds columns twice (row blocks), the
hierarchical exchange of ``host_output_dist.py`` runs instead (unquantized).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_rec import transport
from lightning_rec.pipeline import collectives as comm
from lightning_rec.pipeline.host_output_dist import Plan, hierarchical_output_dist, host_plan
from lightning_rec.pipeline.input_dist import Received, regroup
from lightning_rec.pipeline.qcomm import QuantizedCommCodecs
from lightning_rec.pipeline.routing import RoutingTable, _group_view, _put, _take, column_placement
from lightning_rec.plans.shard_geometry import offsets_of


class OutputDistKind(enum.Enum):
    """Which exchange a pooled output dist runs, decided once when it is built."""

    #: every rank's block straight to each destination, in the rows' own dtype
    FLAT = "flat"
    #: a host's row blocks added within the host before they cross to another (``host_output_dist.py``)
    HIERARCHICAL = "hierarchical"
    #: the flat exchange with rows and gradients on the wire in the codecs' precision (``qcomm.py``)
    QUANTIZED = "quantized"


class PooledOutputDist:
    """The pooled output dist of one layout: every rank's pooled rows for this rank's samples into their columns.

    ``codecs``: the wire precision of the rows and of their gradients (None: as they are). Without codecs, where
    the shard group spans hosts and adding a host's row blocks there first saves bytes (or
    ``LIGHTNING_REC_OUTPUT_DIST=hierarchical``), it runs the host blocks, and makes the host's group now: every
    rank of the shard group builds it at the same step. Holds no tensor: a device move keeps it.
    """

    def __init__(
        self, routing: RoutingTable, group: dist.ProcessGroup, codecs: QuantizedCommCodecs | None = None
    ) -> None:
        self.routing, self.group = routing, group
        self.codecs = None if codecs is None or codecs.is_identity else codecs
        self.placement = column_placement(routing)
        self.width = routing.feat_off[-1]
        self.host_plan: Plan | None = None
        if self.codecs is None and routing.has_model_parallel and transport.spans_hosts(group):
            self.host_plan = host_plan(routing, self.placement, group)
        self.kind = (
            OutputDistKind.QUANTIZED
            if self.codecs is not None
            else OutputDistKind.FLAT
            if self.host_plan is None
            else OutputDistKind.HIERARCHICAL
        )

    @torch.compiler.disable
    def __call__(
        self, pooled: torch.Tensor, dp_pooled: torch.Tensor | None, batches: Sequence[int], b: int
    ) -> torch.Tensor:
        """The ``[b, width]`` output of this rank's samples: every rank's pooled rows for them (``pooled`` is this
        rank's lookup, ``[sum(batches), its route columns]``, ``batches`` every rank's batch size) and
        ``dp_pooled``, the data-parallel tables' pooled rows (or None), each in its columns. Backward runs on
        every rank (an anchor needs a gradient even where ``pooled`` does not), as
        :func:`collectives.all_to_all`'s does."""
        if self.host_plan is not None:
            return hierarchical_output_dist(pooled, dp_pooled, self.routing, self.host_plan, batches, b, self.group)
        anchor = torch.zeros(0, device=pooled.device, requires_grad=torch.is_grad_enabled())
        dp = () if dp_pooled is None else (dp_pooled,)
        return _PooledOutputDist.apply(pooled, anchor, self, tuple(batches), b, *dp)


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
        od: PooledOutputDist,
        batches: tuple[int, ...],
        b: int,
        *dp: torch.Tensor,
    ) -> torch.Tensor:
        runs, adds, cols_from, codecs = od.placement.runs, od.placement.adds, od.routing.cols_from, od.codecs
        zero = od.placement.zero_fill
        out = (torch.zeros if zero else torch.empty)(b, od.width, dtype=pooled.dtype, device=pooled.device)
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

        transport.all_to_all_pieces(sends, [[b * w] for w in cols_from], place, od.group, pooled.device).wait()
        ctx.od, ctx.batches, ctx.b, ctx.shape = od, batches, b, pooled.shape
        ctx.dp_shape = dp[0].shape if dp else None
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        od, b = ctx.od, ctx.b
        bwd = None if od.codecs is None or od.codecs.backward.is_identity else od.codecs.backward
        wire = grad if bwd is None else bwd.encode(grad)
        sends: list[list[torch.Tensor]] = []
        for groups, w in zip(od.placement.runs[1:], od.routing.cols_from):
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
        transport.all_to_all_views(sends, recvs, od.group)
        if bwd is not None:
            grad_pooled = bwd.decode(grad_pooled, grad.dtype)
        grad_dp = None
        if ctx.dp_shape is not None:
            dp_runs = od.placement.runs[0]
            whole = b * sum(n * count for _, _, n, count, _ in dp_runs) == ctx.dp_shape.numel()
            grad_dp = (torch.empty if whole else torch.zeros)(ctx.dp_shape, dtype=grad.dtype, device=grad.device)
            _take(grad_dp, grad, dp_runs)
        return (grad_pooled if ctx.needs_input_grad[0] else None), None, None, None, None, grad_dp


class SequenceOutputDist:
    """The sequence output dist of one layout: every id's embedding (the columns of its shard) back to the id's
    rank. Holds this layout's per-route column indices on ``device``; :meth:`to` gives it on another device (or
    with another wire dtype, ``wire``: the dtype the rows travel in)."""

    def __init__(
        self,
        routing: RoutingTable,
        group: dist.ProcessGroup,
        dims: Sequence[int],
        device: torch.device,
        wire: torch.dtype,
    ) -> None:
        self.routing, self.group, self.dims, self.device, self.wire = routing, group, list(dims), device, wire
        self._all_routes = routing.all_routes
        self._cols = [r.shard.cols for r in routing.my_routes]
        starts = offsets_of([len(x) for x in routing.routes_to])
        self._dest_routes = [(i0, len(lst)) for i0, lst in zip(starts, routing.routes_to)]
        # per route: the columns of the feature's output its shard fills
        self._route_cols = [torch.arange(r.shard.cols, device=device) + r.shard.col_offset for r in self._all_routes]

    def to(self, device: torch.device, wire: torch.dtype) -> SequenceOutputDist:
        return SequenceOutputDist(self.routing, self.group, self.dims, device, wire)

    @torch.compiler.disable
    def __call__(self, embs: list[torch.Tensor], recv: Received) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """``embs[k]`` holds route ``k``'s per-id rows (source-major); ``recv`` what the input dist delivered.
        Returns, per feature, ``(flat index into the feature's [ids, dim] output, values)`` pieces to be summed
        into place."""
        wire, device, cols = self.wire, self.device, self._cols
        n_mine, n_ranks = len(cols), self.routing.group_size
        flat = torch.cat([e.to(wire).reshape(-1) for e in embs]) if embs else torch.zeros(0, dtype=wire, device=device)
        # route-major [route][source] -> source-major [source][route], in elements
        elems = [recv.ids_from[s][k] * cols[k] for k in range(n_mine) for s in range(n_ranks)]
        flat = regroup(flat, elems, n_mine, n_ranks)
        send = [sum(recv.ids_from[s][k] * cols[k] for k in range(n_mine)) for s in range(n_ranks)]
        all_routes = self._all_routes
        recv_sizes = [
            sum(n * r.shard.cols for n, r in zip(recv.sent[i0 : i0 + k], all_routes[i0 : i0 + k]))
            for i0, k in self._dest_routes
        ]
        back = comm.all_to_all(flat, recv_sizes, send, self.group, differentiable=torch.is_grad_enabled())
        chunks = torch.split(back, [n * r.shard.cols for n, r in zip(recv.sent, all_routes)])
        pieces: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.dims]
        for r, route_cols, chunk, pos, n in zip(all_routes, self._route_cols, chunks, recv.positions, recv.sent):
            if pos is None:
                pos = torch.arange(n, device=device)
            idx = (pos.unsqueeze(1) * self.dims[r.feature] + route_cols).reshape(-1)
            pieces[r.feature].append((idx, chunk))
        return pieces
