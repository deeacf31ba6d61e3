"""Building this rank's pieces of the tables at shard time: initialised, cut or reused, and broadcast to replicas.

Every function here runs once, while ``shard_modules`` builds a sharded collection; none is on the step path.
A full table is only ever read through views, so building on the meta device (plus a table config's
``init_fn``) allocates nothing beyond the local shard.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from lightning_rec import _compat
from lightning_rec.configs import BaseEmbeddingConfig
from lightning_rec.plans.shard_geometry import ShardMeta


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
