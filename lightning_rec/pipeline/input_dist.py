"""Stage 1, the input dist: every route's ids to the shard's owner (:class:`InputDist`).

Built once per layout from a :class:`~lightning_rec.pipeline.routing.RoutingTable` and a process group (its
bucketing derived and its payload builder decided then, both ``input_payload.py``); the sharded
collections start it per batch from their
``input_dist`` stage with the batch alone (see docs/ARCHITECTURE.md, "One lookup, walked through"). Every
tensor it creates lives on ``device``, the module's device, so the same code runs over gloo on CPU and over
NCCL (or gloo) on CUDA. Under ``torch.compile`` it runs eagerly (a graph break, see ``collectives``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist

from lightning_rec import transport
from lightning_rec.pipeline import collectives as comm
from lightning_rec.pipeline.input_payload import (
    Bucketing,
    Outgoing,
    RowKey,
    build_bucketing,
    build_payload,
    empty_payload,
    payload_kind,
)
from lightning_rec.pipeline.routing import RoutingTable
from lightning_rec.plans.shard_geometry import offsets_of
from lightning_rec.sparse import KeyedJaggedTensor, offsets_from_lengths, segment_gather_index

__all__ = [
    "InputDist",
    "InputRejected",
    "PendingInputDist",
    "Received",
    "RowKey",
    "as_int64",
    "from_int64",
    "regroup",
]


def regroup(x: torch.Tensor, seg_sizes: list[int], n_outer: int, n_inner: int) -> torch.Tensor:
    """Reorder contiguous segments laid out ``[outer][inner]`` into ``[inner][outer]`` order."""
    if n_outer == 1 or n_inner == 1:  # the transpose of a single row or column: already in order
        return x
    sizes = torch.tensor(seg_sizes, dtype=torch.long, device=x.device)
    starts = offsets_from_lengths(sizes)[:-1]
    perm = torch.arange(n_outer * n_inner, device=x.device).view(n_outer, n_inner).t().reshape(-1)
    return x[segment_gather_index(starts[perm], sizes[perm], sum(seg_sizes))]


@dataclass(frozen=True)
class Received:
    """What the input dist delivered to this rank, and what the output dist needs to send results back.

    ``lengths`` / ``values`` / ``weights`` are route-major (this rank's routes, each holding the bags of
    every source rank in group order), ready for the lookup. ``ids_from[s][k]``: ids rank ``s`` sent for
    this rank's route ``k``. ``positions[i]`` / ``sent[i]``: for route ``i`` of ``routing.all_routes``, where
    in the feature's local ids the ids this rank sent came from (None: all of them, in order; the list is
    empty when the caller did not ask for positions), and how many. ``batches``: every shard rank's batch
    size, in group order (they travelled with the ids).
    """

    lengths: torch.Tensor
    values: torch.Tensor
    weights: torch.Tensor | None
    ids_from: list[list[int]]
    positions: list[torch.Tensor | None]
    sent: list[int]
    batches: tuple[int, ...] = ()

    def ids_per_route(self) -> list[int]:
        """Ids this rank looks up for each of its routes (over all source ranks)."""
        return [sum(col) for col in zip(*self.ids_from)] if self.ids_from and self.ids_from[0] else []


class InputRejected(ValueError):
    """Some rank of the shard group rejected its input; raised on every rank, in the same collective step."""


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_HEADER = 4  # per rank pair: batch size, rejected, weights need a gradient, lengths and ids fit in int32
_INT32_END = 1 << 31


def as_int64(w: torch.Tensor) -> torch.Tensor:
    """Float weights as int64 words holding their bits (exact, reversible by :func:`from_int64`)."""
    bits = w.contiguous().view(_BITS[w.element_size()])
    return bits if bits.dtype == torch.long else bits.to(torch.long)


def from_int64(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    bits = _BITS[torch.empty(0, dtype=dtype).element_size()]
    return (x if bits == torch.long else x.to(bits)).view(dtype)


class _InFlight(NamedTuple):
    """An input dist's exchange in flight and what :meth:`PendingInputDist.wait` needs to unpack it."""

    work: transport.PendingPieces[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
    batches: tuple[int, ...]
    ids_from: list[list[int]]
    sent: list[int]
    positions: list[torch.Tensor | None]
    packed_dtype: torch.dtype | None  # the weights' dtype where their bits travelled with the ids
    separate_weights: torch.Tensor | None  # weights that travelled in their own differentiable all-to-all
    n_mine: int


class PendingInputDist:
    """An input dist whose payload all-to-all is in flight; :meth:`wait` returns what arrived.

    Made by :meth:`InputDist.start_input_dist`; waiting twice returns the same :class:`Received`.
    """

    def __init__(self, received: Received | None = None, in_flight: _InFlight | None = None) -> None:
        self._received = received
        self._in_flight = in_flight

    @torch.compiler.disable
    def wait(self) -> Received:
        if self._received is None:
            assert self._in_flight is not None  # one of the two is given
            self._received = _unpack(self._in_flight)
            self._in_flight = None
        return self._received


class InputDist:
    """The input dist of one layout: its routing, group and device, its bucketing (its tensors on ``device``) and
    the payload builder each kind of batch gets (:class:`~lightning_rec.pipeline.input_payload.PayloadKind`),
    decided here once.

    ``with_positions``: deliver where in each feature's ids every sent id came from (the sequence output
    needs it). ``ranks``: the global rank of every group rank, to name them in errors. :meth:`to` gives the
    same dist on another device.
    """

    def __init__(
        self,
        routing: RoutingTable,
        group: dist.ProcessGroup,
        device: torch.device,
        *,
        with_positions: bool = True,
        ranks: list[int] | None = None,
        bucketing: Bucketing | None = None,
    ) -> None:
        self.routing, self.group, self.device = routing, group, device
        self.with_positions, self.ranks = with_positions, ranks
        self.bucketing = build_bucketing(routing, device) if bucketing is None else bucketing
        # per (ids checked, raw ids present): only checked ids of no raw-id feature may take fbgemm's bucketize
        self.kinds = {
            (checked, raw): payload_kind(self.bucketing, checked, raw, device.type)
            for checked in (False, True)
            for raw in (False, True)
        }
        self.per_dest = [len(lst) for lst in routing.routes_to]

    def to(self, device: torch.device) -> InputDist:
        """This dist on ``device`` (its bucketing's tensors moved, the builders decided again for the device)."""
        return InputDist(
            self.routing,
            self.group,
            device,
            with_positions=self.with_positions,
            ranks=self.ranks,
            bucketing=self.bucketing.to(device),
        )

    def start_input_dist(
        self,
        kjt: KeyedJaggedTensor | None,
        weights: torch.Tensor | None,
        *,
        rejected: bool = False,
        ids_checked: bool = False,
        async_op: bool = True,
        row_keys: Mapping[int, RowKey] | None = None,
    ) -> PendingInputDist:
        """Send every route's ids (made local to the shard's row block) to the shard owner; the payload flies
        async.

        ``weights`` are the per-sample weights in the dtype every rank agreed on (or None); ``rejected``: this
        rank's input failed its checks (``kjt`` may then be None): it still joins the exchange, so that every
        rank raises :class:`InputRejected` together instead of waiting. ``ids_checked``: every id is known to
        lie in its table (checked by the caller), so fbgemm's bucketize kernel may split them by row block.
        ``row_keys``: for features fed raw ids this forward (managed collision), ``{feature: ids -> a row of the
        block that owns each id}``; those ids are routed by that row and travel unchanged (their owner remaps
        them).
        Comm, two collectives: an all-to-all of a fixed-size header per rank pair (batch size, rejected flag,
        whether weights need a gradient, whether its lengths and ids fit in int32, id count of every route),
        then one all-to-all of lengths, ids and weights (their bits) in one int64 buffer; int32 instead when
        every rank's fit, there are no weights and the exchange goes through torch.distributed (half the bytes
        on the wire; widened back on arrival). Per-sample weights that need a gradient travel in a third,
        differentiable all-to-all instead.

        Example, 2 ranks, one row-wise table of 10 rows (0-4 | 5-9), rank 0's batch ``[[3, 7], [8]]``: rank 0
        sends rank 1 the header ``[2, 0, 0, 1, 2]`` and the payload ``[1, 1, 2, 3]`` (lengths, then ids 7-5,
        8-5).
        """
        routing, group, device, per_dest, bk = self.routing, self.group, self.device, self.per_dest, self.bucketing
        b = 0 if kjt is None else kjt.stride()
        n_ranks, n_mine, n_routes = routing.group_size, len(routing.my_routes), len(bk.route_features)
        if kjt is None or rejected:
            out = empty_payload(n_routes, b, device)
        else:
            kind = self.kinds[(ids_checked, bool(row_keys))]
            out = build_payload(kind, kjt, weights, bk, self.with_positions, row_keys or {})
        if n_ranks == 1:  # this rank is the whole shard group: nothing to exchange
            if rejected:
                raise InputRejected("this rank rejected its input")
            lengths, values, ws = out.flat(b, device)
            recv = Received(
                lengths=lengths,
                values=values,
                weights=ws,
                ids_from=[out.sent],
                positions=out.positions,
                sent=out.sent,
                batches=(b,),
            )
            return PendingInputDist(recv)
        weighted = out.weights is not None or (out.pieces is not None and out.pieces.weights is not None)
        w_grad = weighted and weights is not None and weights.requires_grad and torch.is_grad_enabled()
        fits = (
            not weighted
            and not _through_shared_memory(group, device)
            and _fits_int32(out, kjt, ids_checked and not row_keys and bk.rows_fit_int32)
        )
        header, i = [], 0
        for k in per_dest:
            header += [b, int(rejected), int(w_grad), int(fits), *out.sent[i : i + k]]
            i += k
        h = _HEADER + n_mine
        got = comm.all_to_all(
            torch.tensor(header, dtype=torch.long, device=device),
            [h] * n_ranks,
            [_HEADER + k for k in per_dest],
            group,
        ).tolist()
        ranks = self.ranks
        bad = [s if ranks is None else ranks[s] for s in range(n_ranks) if got[s * h + 1]]
        if bad:
            raise InputRejected(
                f"ranks {bad} rejected their input (see the error raised there); stopping this rank too"
            )
        batches = tuple(got[s * h] for s in range(n_ranks))
        ids_from = [got[s * h + _HEADER : (s + 1) * h] for s in range(n_ranks)]
        w_apart = any(got[s * h + 2] for s in range(n_ranks))  # every rank sends weights the same way
        narrow = all(got[s * h + 3] for s in range(n_ranks))  # every rank's lengths and ids fit in int32
        packed = weighted and not w_apart
        # to each rank, its routes' lengths, then ids, then weight bits: pieces of one int64 all-to-all
        route_lengths, route_values, route_weights = out.per_route(b)
        sends: list[list[torch.Tensor]] = []
        value_counts = [sum(out.sent[i0 : i0 + k]) for i0, k in zip(_starts(per_dest), per_dest)]
        for r, i0 in enumerate(_starts(per_dest)):
            i1 = i0 + per_dest[r]
            sends.append(route_lengths[i0:i1] + route_values[i0:i1])
            if packed:
                assert route_weights is not None
                sends[-1] += [as_int64(w) for w in route_weights[i0:i1]]
        if narrow:
            sends = _narrowed(sends, device)
        recv_sizes = [[batches[s]] * n_mine + ids_from[s] + (ids_from[s] if packed else []) for s in range(n_ranks)]
        consume = partial(_route_major, n_mine=n_mine, packed=packed, device=device)
        work = transport.all_to_all_pieces(sends, recv_sizes, consume, group, device, async_op=async_op)
        separate = None
        if w_apart:
            w = out.flat(b, device).weights if weighted else None
            w = w if w is not None else torch.zeros(0, device=device)
            separate = comm.all_to_all(w, [sum(x) for x in ids_from], value_counts, group, differentiable=True)
        return PendingInputDist(
            in_flight=_InFlight(
                work=work,
                batches=batches,
                ids_from=ids_from,
                sent=out.sent,
                positions=out.positions,
                packed_dtype=weights.dtype if packed and weights is not None else None,
                separate_weights=separate,
                n_mine=n_mine,
            )
        )


def _fits_int32(out: Outgoing, kjt: KeyedJaggedTensor | None, ids_in_tables: bool) -> bool:
    """Whether every length and id this rank sends is an int32 (then int32 carries them exactly).
    ``ids_in_tables``: the ids were checked against tables of at most 2**31 rows (then no need to look)."""
    if kjt is None:
        return True
    values = out.values if out.pieces is None else kjt.values()  # pieces are slices of the input's ids
    if values is None or values.numel() == 0:
        return True
    if values.numel() >= _INT32_END:  # a bag could be that long
        return False
    if ids_in_tables:
        return True
    lo, hi = torch.stack(list(torch.aminmax(values))).tolist()  # one host sync for both bounds
    return lo >= -_INT32_END and hi < _INT32_END


def _through_shared_memory(group: dist.ProcessGroup, device: torch.device) -> bool:
    # the shared-memory transport copies each piece once either way: narrowing would add a pass, save no wire
    return device.type == "cpu" and transport.shared_group(group) is not None


def _narrowed(sends: list[list[torch.Tensor]], device: torch.device) -> list[list[torch.Tensor]]:
    """The int64 pieces as int32 views of one buffer (sent in place)."""
    flat = [t for lst in sends for t in lst]
    sizes = [t.numel() for t in flat]
    # a same-dtype cat, then one cast: the kernels every device has (no cat into another dtype)
    buf = torch.cat(flat).to(torch.int32) if flat else torch.zeros(0, dtype=torch.int32, device=device)
    views = iter(torch.split(buf, sizes))
    return [[next(views) for _ in lst] for lst in sends]


def _route_major(
    got: list[list[torch.Tensor]], n_mine: int, packed: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Every source's ``[lengths | ids | weights][route]`` pieces as route-major lengths, ids, weight bits
    (int64: pieces that travelled as int32 are widened)."""

    def cat(at: int) -> torch.Tensor:
        parts = [pieces[at + k] for k in range(n_mine) for pieces in got]
        return torch.cat(parts).long() if parts else torch.zeros(0, dtype=torch.long, device=device)

    return cat(0), cat(n_mine), cat(2 * n_mine) if packed else None


def _starts(sizes: list[int]) -> list[int]:
    return offsets_of(sizes)[:-1]


def _unpack(f: _InFlight) -> Received:
    """What arrived, route-major (each route's bags from every source rank in group order)."""
    lengths, values, weights = f.work.wait()
    if f.packed_dtype is not None:
        # packed_dtype is set only where the weight bits travelled with the ids
        weights = from_int64(weights, f.packed_dtype)  # type: ignore[arg-type]
    if f.separate_weights is not None:
        weights = regroup(f.separate_weights, [c for row in f.ids_from for c in row], len(f.batches), f.n_mine)
    return Received(
        lengths=lengths,
        values=values,
        weights=weights,
        ids_from=f.ids_from,
        positions=f.positions,
        sent=f.sent,
        batches=f.batches,
    )
