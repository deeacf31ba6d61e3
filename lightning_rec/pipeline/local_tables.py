"""This rank's pieces of a collection's tables: how each is materialized, how they are placed, how the lookups see
them, and what converting the collection makes of them.

At sharding time (once, while ``shard_modules`` builds a sharded collection; never on the step path)
:func:`place_tables` decides which shards this rank holds and, for each, the storage it starts from: a plain
parameter, initialised or cut from the full table with one copy and broadcast to its replicas, or what a fused
kernel's storage is filled from. A full table is only ever read through views, so building on the meta device
(plus a table config's ``init_fn``) allocates nothing beyond the local shard.

In each forward the lookups see the tables through :func:`dp_lookup_weights` and :func:`shard_lookup_weights`,
which find the rows this rank looks up in each table and hand them to ``collectives.embedding_grad`` (whose
backward reduces the gradient over ranks; it returns the tables untouched where there is nothing to reduce or
scale).

``nn.Module._apply`` converts the tensors a module holds (``.to()``, ``.half()``, a precision plugin). A sharded
collection also keeps, per table, the dtype the wire carries (ranks without a piece of a table need it too) and
the device its pipeline makes tensors on. :func:`table_conversion` says what both become before anything is
converted, so that the lookup kernels for the result are resolved (and may refuse it) while the module is still
as it was.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, cast

import torch
import torch.distributed as dist
from torch import nn

from lightning_rec import _compat, kernels
from lightning_rec.configs import BaseEmbeddingConfig
from lightning_rec.embedding_modules import Table
from lightning_rec.pipeline import collectives as comm
from lightning_rec.pipeline.input_dist import Received
from lightning_rec.plans.shard_geometry import ShardMeta
from lightning_rec.sparse import KeyedJaggedTensor


def broadcast_from_first(w: torch.Tensor, group: dist.ProcessGroup) -> None:
    if dist.get_world_size(group) == 1:
        return
    with torch.no_grad():
        wire = w.float() if w.dtype == torch.bfloat16 else w
        dist.broadcast(wire, src=dist.get_process_group_ranks(group)[0], group=group)
        if wire is not w:
            w.copy_(wire)


#: a full table larger than this, materialized on a rank that keeps only a shard of it, gets a warning
LARGE_TABLE_BYTES = 256 * 2**20
_warned_large: set[tuple[str, tuple[int, ...]]] = set()


def _takes_offsets(fn: Callable[..., object]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return "row_offset" in params and "col_offset" in params


def init_shard(table: BaseEmbeddingConfig, weight: torch.Tensor, shard: ShardMeta | None = None) -> None:
    """Initialise ``weight``, the local piece ``shard`` of ``table`` (None: the full table), in place.

    An ``init_fn`` with keyword parameters ``row_offset`` and ``col_offset`` (default 0) gets the piece's
    position in the full table, so a position-based deterministic init gives a model built on the meta
    device exactly the shards a fully built model would be cut into. Any other ``init_fn`` (and the
    uniform default) is called on the piece as it is.
    """
    fn = table.init_fn
    if fn is None or not _takes_offsets(fn):
        table.init_weight(weight)
        return
    rows, cols = (0, 0) if shard is None else (shard.row_offset, shard.col_offset)
    with torch.no_grad():
        cast(Callable[..., object], fn)(weight, row_offset=rows, col_offset=cols)  # _takes_offsets(fn)


def materialize(
    table: BaseEmbeddingConfig, full: torch.Tensor, shard: ShardMeta | None, device: torch.device
) -> torch.Tensor:
    """This rank's piece of ``table`` on ``device``: from ``init_fn`` when the module is on the meta device,
    else cut from ``full`` with one copy (none when the piece is the whole table already on ``device``)."""
    shape = tuple(full.shape) if shard is None else (shard.rows, shard.cols)
    if full.is_meta:
        w = torch.empty(shape, dtype=full.dtype, device=device)
        init_shard(table, w, shard)
        return w
    if shape == tuple(full.shape):
        return full.to(device)  # the same storage when already there
    assert shard is not None  # no shard: the whole table, returned above
    return torch.empty(shape, dtype=full.dtype, device=device).copy_(shard.of(full))


def filler(
    table: BaseEmbeddingConfig, full: torch.Tensor, shard: ShardMeta | None
) -> torch.Tensor | Callable[[torch.Tensor], None]:
    """What the fused kernel copies its initial weights from: a view of ``full`` or, from the meta device,
    the table's init applied to the kernel's own storage."""
    if full.is_meta:
        return lambda w: init_shard(table, w, shard)
    return full if shard is None else shard.of(full)


def warn_large_tables(
    tables: list[BaseEmbeddingConfig],
    weights: list[torch.Tensor],
    shards: Mapping[str, list[ShardMeta] | None],
    me: int,
) -> None:
    """Warn (once per table) when a large full table sits on this rank only to be cut into a smaller piece."""
    for t, w in zip(tables, weights):
        pieces = shards[t.name]
        if pieces is None or w.is_meta:
            continue
        size = w.numel() * w.element_size()
        kept = sum(s.rows * s.cols for s in pieces if s.rank == me)
        key = (t.name, tuple(w.shape))
        if size <= LARGE_TABLE_BYTES or kept >= w.numel() or key in _warned_large:
            continue
        _warned_large.add(key)
        warnings.warn(
            f"table {t.name!r}: its full {w.shape[0]} x {w.shape[1]} {w.dtype} table ({size / 2**20:,.0f} MiB) was "
            f"materialized on this rank, which keeps {kept / w.numel():.0%} of it; build the collection on the "
            "meta device (device='meta') and shard_modules allocates only the local shard, initialised from the "
            "table config's init_fn",
            UserWarning,
            stacklevel=5,
        )


def requested_kernel(plan_kernel: str | None, module_kernel: str) -> str:
    """The kernel a table asks for: the plan's ``"torch"`` / ``"fbgemm"``; otherwise (``"auto"``, ``None`` or a
    TorchRec kernel name) the collection's own ``kernel`` setting, itself ``"auto"`` by default."""
    return plan_kernel if plan_kernel in ("torch", "fbgemm") else module_kernel


def target_device(module: nn.Module, device: torch.device | str | None) -> torch.device:
    """Where this rank's shards go: ``device``, else where the module's tables are (the default device for meta)."""
    if device is None:
        found = [p.device for p in module.parameters()]
        device = found[0] if found and found[0].type != "meta" else torch.get_default_device()
    return _compat.indexed_device(device)


#: a fused kernel table's start: its shape, dtype and initial weights (a tensor or a function filling one)
KernelSource = tuple[tuple[int, int], torch.dtype, torch.Tensor | Callable[[torch.Tensor], object]]


class LocalTables(NamedTuple):
    """What :func:`place_tables` made of one collection on this rank."""

    shards: list[tuple[int, ShardMeta]]  # (table index, shard) held here, table order
    container: kernels.TableContainer  # the plain tables (empty when fused)
    sources: dict[str, KernelSource]  # fused: each kernel table's start, by table name
    replicas: list[tuple[str, dist.ProcessGroup]]  # fused: tables to make equal over these groups once built


def place_tables(
    tables: Sequence[BaseEmbeddingConfig],
    weights: Sequence[torch.Tensor],
    shards: dict[str, list[ShardMeta] | None],
    me: int,
    fused: bool,
    dp_group: dist.ProcessGroup | None,
    replica_group: dist.ProcessGroup | None,
    device: torch.device,
) -> LocalTables:
    """The pieces of ``tables`` (full weights ``weights``) that shard rank ``me`` holds.

    Plain tables are materialized on ``device`` (meta-built tables get only their piece, filled by their
    ``init_fn``) and copies are made equal at once (replicas start equal, as DDP makes dense replicas equal).
    Fused tables only record where their kernel's storage starts from, so no shard-sized copy is made on the
    way; their copies are made equal after the kernel exists.
    """
    held: list[tuple[int, ShardMeta]] = []
    group: dist.ProcessGroup | None
    container = kernels.TableContainer()
    sources: dict[str, KernelSource] = {}
    replicas: list[tuple[str, dist.ProcessGroup]] = []
    for i, (t, full) in enumerate(zip(tables, weights)):
        full = full.detach()
        table_shards = shards[t.name]
        s: ShardMeta | None
        if table_shards is None:
            s, group = None, dp_group
        else:
            mine = [s for s in table_shards if s.rank == me]
            if not mine:
                continue
            (s,) = mine
            group = replica_group
        if fused:
            if s is not None and s.rows == 0:
                continue  # a zero-row shard receives no ids; the fused kernel holds only shards with rows
            shape = tuple(full.shape) if s is None else (s.rows, s.cols)
            sources[t.name] = ((shape[0], shape[1]), full.dtype, filler(t, full, s))
            if group is not None:
                replicas.append((t.name, group))
        else:
            w = materialize(t, full, s, device)
            if group is not None:
                broadcast_from_first(w, group)
            container.add(t.name, Table(w))
        if s is not None:
            held.append((i, s))
    return LocalTables(held, container, sources, replicas)


def dp_lookup_weights(
    weights: list[torch.Tensor],
    kjt: KeyedJaggedTensor,
    feature_table: Sequence[int],
    dp_tables: Sequence[int],
    group: dist.ProcessGroup | None,
    scale: float,
) -> list[torch.Tensor]:
    """The data-parallel tables ``weights`` (tables ``dp_tables``) as the lookup of ``kjt`` sees them: their
    backward sums the rows some rank touched over ``group``. ``feature_table``: each feature's table."""
    opk = kjt.offset_per_key()
    ids = [
        torch.cat([kjt.values()[opk[f] : opk[f + 1]] for f, t in enumerate(feature_table) if t == ti])
        for ti in dp_tables
    ]
    return comm.embedding_grad(weights, ids, group, scale)


def shard_lookup_weights(
    weights: list[torch.Tensor],
    recv: Received,
    my_route_table: Sequence[int],
    replica_group: dist.ProcessGroup | None,
    scale: float,
    device: torch.device,
) -> list[torch.Tensor]:
    """This rank's shards ``weights`` as the lookup of ``recv`` sees them; under 2D replicas their backward sums
    over ``replica_group``. ``my_route_table``: the local shard each received route reads."""
    empty = torch.zeros(0, dtype=torch.long, device=device)
    ids = [empty] * len(weights)
    if replica_group is not None and weights:
        route_ids = torch.split(recv.values, recv.ids_per_route())
        ids = [
            torch.cat([route_ids[j] for j, t in enumerate(my_route_table) if t == k] or [empty])
            for k in range(len(weights))
        ]
    return comm.embedding_grad(weights, ids, replica_group, scale)


class TableConversion(NamedTuple):
    fn: Callable[[torch.Tensor], torch.Tensor]  # what to apply to the collection's tensors
    dtypes: list[torch.dtype]  # every table's dtype afterwards, in config order
    device: torch.device  # with its index


def table_conversion(
    fn: Callable[[torch.Tensor], torch.Tensor], dtypes: list[torch.dtype], device: torch.device, keep_dtypes: bool
) -> TableConversion:
    """``fn`` applied to tables of ``dtypes`` on ``device``; ``keep_dtypes``: only move them (``keep_table_dtypes``)."""
    if keep_dtypes:
        # a precision plugin converting the model moves tables but keeps the dtype their config fixed
        convert = fn
        fn = lambda t: t.to(convert(torch.empty(0, dtype=t.dtype, device=t.device)).device)  # noqa: E731
    new_dtypes = [fn(torch.empty(0, dtype=d, device=device)).dtype for d in dtypes]
    return TableConversion(fn, new_dtypes, _compat.indexed_device(fn(torch.empty(0, device=device)).device))
