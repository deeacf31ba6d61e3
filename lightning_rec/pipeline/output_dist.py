"""Stage 3, the output dist: pooled rows back to each sample's rank, placed into the ``[batch, sum of dims]``
output as they come out of the exchange (:class:`PooledOutputDist`), in the wire precision its codecs give
(TorchRec's quantized comms); and the sequence collections' output dist (:class:`SequenceOutputDist`).

Each is an object built once per layout, when the collection is built (and moved with it), holding what does
not change from batch to batch: the routing, the group, the column placement (``routing.py``), the wire
codecs (:class:`QuantizedCommCodecs`) and, between hosts, the host blocks and the host's group
(``host_output_dist.py``); its variant is an :class:`OutputDistKind`, decided here when it is built (with
``LIGHTNING_REC_OUTPUT_DIST``, :func:`mode_from_env`). A call takes one batch's lookups and batch sizes.

Every block (the data-parallel tables' pooled rows, and each rank's pooled rows for this rank's samples) lands
as the column groups of its :class:`~lightning_rec.pipeline.routing.ColumnPlacement`: each group is one
strided copy, or add where an earlier block wrote those columns (row blocks of a table add up). The placing
happens inside the exchange (docs/ARCHITECTURE.md, "How the bytes move"): every rank's rows are copied or added
into their columns straight out of the buffer that brought them, and backward gathers each block's gradient
from the same groups straight into the reverse exchange, with no flat buffer on either side. One path serves
every layout and group size; where the shard group spans hosts and a host holds columns twice (row blocks), the
hierarchical exchange of ``host_output_dist.py`` runs instead (unquantized).

Quantized comms keep TorchRec's API (:class:`QCommsConfig`, :class:`CommType`, :func:`get_qcomm_codecs_registry`):
the pooled output dist sends its rows (forward) and their gradients (backward) as fp16 or bf16 instead of the
tables' dtype, halving the exchange's bytes. A codec (:class:`WireCodec`) multiplies by its loss scale (if any),
clamps to the wire type's range (fp16: +-65504, as TorchRec does; bf16 has fp32's range) and rounds to the
nearest wire value; the receiver widens back and divides by the scale. Everything else stays exact: the sums of
row blocks and MEAN run in the output dtype after widening, data-parallel columns never travel, and ids are
untouched.

Error bound (round to nearest, ``u`` = 2**-11 for fp16, 2**-8 for bf16): every output element is the sum of
its blocks' partial sums ``p_k`` (one block per shard that holds a piece of the feature's row or column),
so ``|out - out_fp32| <= u * sum_k |p_k| + n_k * tiny`` where ``tiny`` is the wire type's spacing at zero
(fp16: 2**-24 / scale, from values that fall below its normal range; bf16 keeps fp32's), plus whatever
clamping cut off (values beyond +-65504 / scale in fp16). The same holds in backward for each pooled
gradient a shard receives, with the backward precision and scale; a table row's gradient sums those over
bags, so its error is at most ``u`` times the sum of the absolute received gradients. The tests check these
bounds element by element at 2 and 4 processes (``tests/distributed/test_qcomm.py``).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_rec import transport
from lightning_rec.pipeline import collectives as comm
from lightning_rec.pipeline.host_output_dist import MODES, Plan, hierarchical_output_dist, host_plan
from lightning_rec.pipeline.input_dist import Received, regroup
from lightning_rec.pipeline.routing import RoutingTable, _group_view, _put, _take, column_placement
from lightning_rec.plans.shard_geometry import offsets_of

ENV = "LIGHTNING_REC_OUTPUT_DIST"  # "flat" | "hierarchical" | "auto" (default); the same on every rank


def mode_from_env() -> str:
    """``LIGHTNING_REC_OUTPUT_DIST`` now (empty: ``auto``); raises naming the accepted values for any other.
    Sharding reads it first, on every rank, to check that all ranks agree (``agreement.settings``)."""
    mode = os.environ.get(ENV, "auto") or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}: expected one of {', '.join(MODES)}")
    return mode


class OutputDistKind(enum.Enum):
    """Which exchange a pooled output dist runs, decided once when it is built."""

    #: every rank's block straight to each destination, in the rows' own dtype
    FLAT = "flat"
    #: a host's row blocks added within the host before they cross to another (``host_output_dist.py``)
    HIERARCHICAL = "hierarchical"
    #: the flat exchange with rows and gradients on the wire in the codecs' precision (:class:`WireCodec`)
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
            self.host_plan = host_plan(routing, self.placement, group, mode_from_env())
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


@enum.unique
class CommType(enum.Enum):
    """TorchRec's wire precisions. FP8 and INT8 are TorchRec's row-wise quantized codecs and are refused."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"
    INT8 = "int8"

    def __str__(self) -> str:
        return self.value


@enum.unique
class CommOp(enum.Enum):
    """The collectives a codec may apply to, by TorchRec's names."""

    POOLED_EMBEDDINGS_ALL_TO_ALL = "pooled_embeddings_all_to_all"
    POOLED_EMBEDDINGS_REDUCE_SCATTER = "pooled_embeddings_reduce_scatter"
    SEQUENCE_EMBEDDINGS_ALL_TO_ALL = "sequence_embeddings_all_to_all"


_WIRE = {CommType.FP32: None, CommType.FP16: torch.float16, CommType.BF16: torch.bfloat16}


def _comm_type(value: CommType | str, what: str) -> CommType:
    try:
        kind = value if isinstance(value, CommType) else CommType(str(value).lower())
    except ValueError:
        raise ValueError(f"{what}={value!r}: expected one of {[str(c) for c in CommType]}") from None
    if kind not in _WIRE:
        raise ValueError(
            f"{what}={kind}: lightning_rec's quantized comms send fp16 or bf16 (or fp32, i.e. unchanged); "
            "TorchRec's row-wise fp8 / int8 codecs are not supported"
        )
    return kind


def _scale(value: float | None, what: str) -> float | None:
    if value is None:
        return None
    scale = float(value)
    if not (scale > 0 and scale != float("inf")):
        raise ValueError(f"{what}={value!r}: a loss scale must be a positive finite number (or None)")
    return scale


@dataclass
class QCommsConfig:
    """Which precision the pooled embeddings travel in, forward and backward (TorchRec's fields).

    ``forward_loss_scale`` / ``backward_loss_scale`` multiply the values before they are rounded to the wire
    type and divide them after (keeping small gradients out of fp16's subnormal range). TorchRec's fp8 fields
    are accepted only as None.
    """

    forward_precision: CommType = CommType.FP32
    backward_precision: CommType = CommType.FP32
    forward_loss_scale: float | None = None
    backward_loss_scale: float | None = None
    fp8_quantize_dim: int | None = None
    fp8_quantize_dim_bwd: int | None = None
    fp8_bwd_uses_143: bool | None = False

    def __post_init__(self) -> None:
        self.forward_precision = _comm_type(self.forward_precision, "forward_precision")
        self.backward_precision = _comm_type(self.backward_precision, "backward_precision")
        self.forward_loss_scale = _scale(self.forward_loss_scale, "forward_loss_scale")
        self.backward_loss_scale = _scale(self.backward_loss_scale, "backward_loss_scale")
        if self.fp8_quantize_dim is not None or self.fp8_quantize_dim_bwd is not None or self.fp8_bwd_uses_143:
            raise ValueError("the fp8 options of QCommsConfig need an fp8 precision, which is not supported")


@dataclass(frozen=True)
class WireCodec:
    """How one direction of the pooled output dist travels: ``dtype`` (None: the values' own) and a loss scale."""

    dtype: torch.dtype | None = None
    scale: float | None = None

    @property
    def is_identity(self) -> bool:
        return self.dtype is None and self.scale is None

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as it goes on the wire (a new tensor unless the codec changes nothing)."""
        if self.is_identity or (self.dtype == x.dtype and self.scale is None):
            return x
        y = (x * self.scale if self.scale is not None else x).to(self.dtype or x.dtype)
        if y.dtype == torch.float16:
            # beyond +-65504 rounds to +-inf: clamping after the cast gives clamping before it, on half the bytes
            limit = torch.finfo(torch.float16).max
            y.clamp_(-limit, limit)
        return y

    def decode(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """What arrived, widened to ``dtype`` and unscaled."""
        x = y.to(dtype)
        return x / self.scale if self.scale is not None else x

    def __str__(self) -> str:
        kind = "as is" if self.dtype is None else str(self.dtype).removeprefix("torch.")
        return kind if self.scale is None else f"{kind} x{self.scale:g}"


@dataclass(frozen=True)
class QuantizedCommCodecs:
    """The codecs of one collective: forward values and backward gradients (TorchRec's name)."""

    forward: WireCodec = WireCodec()
    backward: WireCodec = WireCodec()

    @property
    def is_identity(self) -> bool:
        return self.forward.is_identity and self.backward.is_identity

    def __str__(self) -> str:
        return f"forward {self.forward}, backward {self.backward}"


def get_qcomm_codecs_registry(
    qcomms_config: QCommsConfig | None,
    comm_ops: Sequence[CommOp] | None = None,
    device: torch.device | None = None,
) -> dict[str, QuantizedCommCodecs] | None:
    """TorchRec's registry of codecs by collective, for a sharder's ``qcomm_codecs_registry`` argument.

    ``comm_ops`` defaults to the two pooled collectives (all-to-all and reduce-scatter), which lightning_rec
    runs as one exchange. ``device`` is accepted for TorchRec's signature; the codecs work on any device.
    """
    if qcomms_config is None:
        return None
    ops = (
        list(comm_ops)
        if comm_ops is not None
        else [
            CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL,
            CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER,
        ]
    )
    codecs = QuantizedCommCodecs(
        WireCodec(_WIRE[qcomms_config.forward_precision], qcomms_config.forward_loss_scale),
        WireCodec(_WIRE[qcomms_config.backward_precision], qcomms_config.backward_loss_scale),
    )
    return {CommOp(op).value: codecs for op in ops}


def pooled_codecs(registry: Mapping[str, QuantizedCommCodecs] | None) -> QuantizedCommCodecs | None:
    """The codecs of the pooled output dist, or None (fp32 / unchanged). Row blocks that add up (TorchRec's
    reduce-scatter) and whole blocks (its all-to-all) travel in one exchange here, so the two must agree."""
    if not registry:
        return None
    unknown = sorted(set(registry) - {op.value for op in CommOp})
    if unknown:
        raise ValueError(f"qcomm_codecs_registry: unknown collectives {unknown}; known: {[op.value for op in CommOp]}")
    wrong = [k for k, v in registry.items() if not isinstance(v, QuantizedCommCodecs)]
    if wrong:
        raise TypeError(
            f"qcomm_codecs_registry: {wrong} must map to QuantizedCommCodecs; build the registry with "
            "get_qcomm_codecs_registry(QCommsConfig(...))"
        )
    found = {
        op: registry[op.value]
        for op in (CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL, CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER)
        if op.value in registry
    }
    if len(set(found.values())) > 1:
        raise ValueError(
            "qcomm_codecs_registry: lightning_rec's pooled output dist is one exchange for whole blocks and for "
            f"row blocks that add up, so {CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.value} and "
            f"{CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.value} need the same codecs; got "
            + ", ".join(f"{op.value}: {c}" for op, c in found.items())
        )
    codecs = next(iter(found.values()), None)
    return None if codecs is None or codecs.is_identity else codecs


def sequence_codecs(registry: Mapping[str, QuantizedCommCodecs] | None) -> QuantizedCommCodecs | None:
    """The sequence output dist's codecs (None where unchanged); not supported otherwise."""
    codecs = (registry or {}).get(CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL.value)
    return None if codecs is None or codecs.is_identity else codecs


def refuse_sequence_codecs(
    registry: Mapping[str, QuantizedCommCodecs] | None, collections: str, source: str = "the registry"
) -> None:
    """Raise if ``registry``, the codecs given for the sequence collections ``collections`` (read from ``source``),
    quantizes the sequence all-to-all: quantized comms apply to pooled embeddings only.

    The one rule for every front end: ``shard_modules`` applies it to its registry where the model has sequence
    collections, ``front_end.sharders_qcomm_registry`` to the registry of TorchRec's EmbeddingCollection sharder.
    """
    if sequence_codecs(registry) is not None:
        raise ValueError(
            f"quantized comms apply to pooled embeddings only; {collections} would get "
            f"{CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL.value} codecs: leave that collective out of {source}"
        )
