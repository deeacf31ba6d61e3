"""Lightning callback for managed collision: bucket-count schedule and per-epoch hit rate / evictions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_rec.mc.embedding import _ManagedCollisionWrapper


def managed_collision_modules(model: torch.nn.Module) -> list[tuple[str, _ManagedCollisionWrapper]]:
    """``(path, wrapper)`` for every managed-collision embedding module in ``model``."""
    return [(p, m) for p, m in model.named_modules() if isinstance(m, _ManagedCollisionWrapper)]


class ManagedCollisionCallback(L.Callback):
    """Resize managed-collision tables at epoch boundaries and log each epoch's hit rate and evictions.

    Args:
        resize_at: ``{epoch: num_buckets}`` or ``{epoch: {table: num_buckets}}``; at the start of that epoch
            every managed table (or each table named) is resized (ids, rows and optimizer state migrate; see
            ``resize``). Works sharded: every rank resizes its own buckets.
        resize_by: ``{epoch: factor}``; at the start of that epoch every managed table's bucket count is
            multiplied by ``factor`` (``2`` doubles, ``0.5`` halves), so tables with different bucket counts
            (the DLRM job caps them by table size) resize together. A table the product does not fit (a
            3-row table cannot take 2 buckets) keeps its count, with a warning naming it.
        log_stats: log ``mc/<path>/<table>/hit_rate`` and ``.../evicted`` per epoch (summed over ranks), and
            over every managed table ``mc/hit_rate`` and ``mc/evicted``. A hit is an id (counted with
            repeats) that already held a row; evictions are ids that lost their row to a new id.
        print_stats: rank 0 also prints one line per epoch with those totals.
    """

    def __init__(
        self,
        resize_at: Mapping[int, int | Mapping[str, int]] | None = None,
        log_stats: bool = True,
        print_stats: bool = False,
        resize_by: Mapping[int, float] | None = None,
    ) -> None:
        self.resize_at = {int(k): (dict(v) if isinstance(v, Mapping) else int(v)) for k, v in (resize_at or {}).items()}
        self.resize_by = {int(k): float(v) for k, v in (resize_by or {}).items()}
        both = sorted(set(self.resize_at) & set(self.resize_by))
        if both:
            raise ValueError(f"ManagedCollisionCallback: epochs {both} are in both resize_at and resize_by")
        self.log_stats = log_stats
        self.print_stats = print_stats
        self._totals: dict[str, list[int]] = {}
        self.history: list[dict[str, float]] = []  # per epoch: lookups, hits, evicted, hit_rate (all tables)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._totals = {}
        n = self.resize_at.get(trainer.current_epoch)
        factor = self.resize_by.get(trainer.current_epoch)
        for _, m in managed_collision_modules(pl_module):
            if n is not None:
                m.resize(n)
            elif factor is not None:
                counts = m.scaled_num_buckets(factor, skip_unfit=True)
                kept = sorted(set(m.mc_stats()) - set(counts))
                if kept:
                    rank_zero_warn(
                        f"ManagedCollisionCallback: resize_by={factor} at epoch {trainer.current_epoch} "
                        f"does not fit tables {kept} (their rows do not split into that many buckets); "
                        "they keep their bucket counts"
                    )
                m.resize(counts)

    def on_train_batch_end(  # type: ignore[override]
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        for path, m in managed_collision_modules(pl_module):
            for table, s in m.mc_stats().items():
                tot = self._totals.setdefault(f"{path}/{table}", [0, 0, 0])
                tot[0] += s.get("lookups", 0)
                tot[1] += s.get("hits", 0)
                tot[2] += s.get("evicted", 0)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not (self.log_stats or self.print_stats) or not self._totals:
            return
        keys = sorted(self._totals)
        t = torch.tensor([self._totals[k] for k in keys], dtype=torch.float64)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(t)  # each rank counted its own buckets' lookups
        lookups, hits, evicted = t.sum(0).tolist()
        total = {"lookups": lookups, "hits": hits, "evicted": evicted, "hit_rate": hits / max(lookups, 1.0)}
        self.history.append(total)
        if self.log_stats:
            # every rank holds the same (all-reduced) values; a MAX "sync" keeps them exact and tells Lightning
            # the values are global
            values = {
                f"mc/{k}/{what}": v
                for k, (n, h, e) in zip(keys, t.tolist())
                for what, v in (("hit_rate", h / max(n, 1.0)), ("evicted", e))
            }
            values.update({"mc/hit_rate": total["hit_rate"], "mc/evicted": evicted})
            pl_module.log_dict(values, sync_dist=True, reduce_fx="max")
        if self.print_stats and trainer.is_global_zero:
            print(
                f"managed collision, epoch {trainer.current_epoch}: hit rate {total['hit_rate']:.4f} "
                f"({int(hits):,} of {int(lookups):,} ids held a row), {int(evicted):,} ids evicted "
                f"({len(keys)} tables)",
                flush=True,
            )
