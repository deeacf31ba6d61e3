"""Which fused optimizer each table trains with: one spec for every table, or a spec per table with a default.

TorchRec users pick the embedding optimizer per table (row-wise Adagrad for the huge id tables, SGD or Adam for
small ones). :class:`PerTableOptimizers` is the strategy's way of saying that
(``RecShardedStrategy(embedding_optimizer=PerTableOptimizers(default=..., tables={...}))``, or in YAML
``{default: {kind: sgd, lr: 0.1}, tables: {big_ids: {kind: rowwise_adagrad, lr: 0.05}}}``); in-backward marks
and a sharder's ``fused_params`` say it per parameter / per module type. Tables sharing a spec share a kernel.

A low layer: imports only ``fused_kinds``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_rec.fused_kinds import FusedOptimizerSpec, as_spec

#: a collection's tables -> their fused spec (None: the table is an ordinary parameter)
TableSpecs = dict[str, FusedOptimizerSpec | None]


@dataclass(frozen=True)
class PerTableOptimizers:
    """A fused optimizer per table name, and a default for the tables not named.

    Args:
        default: the spec of every table not in ``tables`` (None: those tables are ordinary parameters, trained
            by the optimizers of ``configure_optimizers``).
        tables: ``{table name: spec or None}``; a name applies to the tables of that name in every collection.
            Specs may be :class:`FusedOptimizerSpec` objects or dicts of their fields.
    """

    default: FusedOptimizerSpec | None = None
    tables: Mapping[str, FusedOptimizerSpec | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "default", as_spec(self.default))
        if not isinstance(self.tables, Mapping):
            kind = type(self.tables).__name__
            raise TypeError(f"PerTableOptimizers.tables must map table names to specs, got {kind}")
        specs: dict[str, FusedOptimizerSpec | None] = {}
        for name, spec in self.tables.items():
            if not isinstance(name, str):
                raise TypeError(f"PerTableOptimizers.tables: table names are strings, got {name!r}")
            try:
                specs[name] = as_spec(spec)
            except (TypeError, ValueError) as e:
                raise type(e)(f"table {name!r}: {e}") from None
        object.__setattr__(self, "tables", specs)

    def __hash__(self) -> int:
        return hash((self.default, tuple(sorted(self.tables.items(), key=lambda kv: kv[0]))))

    def spec_of(self, table: str) -> FusedOptimizerSpec | None:
        """The spec table ``table`` trains with."""
        return self.tables.get(table, self.default)


EmbeddingOptimizer = FusedOptimizerSpec | PerTableOptimizers


def as_table_optimizers(x: Any) -> EmbeddingOptimizer | None:
    """The strategy's ``embedding_optimizer`` option, checked: None, one spec (or a dict of its fields), or a spec
    per table (:class:`PerTableOptimizers`, or a dict with the keys ``tables`` and, optionally, ``default``)."""
    if x is None or isinstance(x, (FusedOptimizerSpec, PerTableOptimizers)):
        return x
    if isinstance(x, Mapping) and "kind" not in x and "tables" in x:
        unknown = sorted(str(k) for k in x if k not in ("default", "tables"))
        if unknown:
            raise ValueError(
                f"per-table embedding_optimizer: unknown keys {unknown}; expected 'tables' (table name -> spec) "
                "and optionally 'default'"
            )
        return PerTableOptimizers(default=x.get("default"), tables=x["tables"])
    return as_spec(x)


def spec_of(option: EmbeddingOptimizer | None, table: str) -> FusedOptimizerSpec | None:
    """The spec ``option`` gives table ``table``."""
    if isinstance(option, PerTableOptimizers):
        return option.spec_of(table)
    return option


def named_tables(option: EmbeddingOptimizer | None) -> list[str]:
    """The table names ``option`` names explicitly (checked against the model's tables at sharding)."""
    return list(option.tables) if isinstance(option, PerTableOptimizers) else []


def summary(specs: Mapping[str, TableSpecs]) -> EmbeddingOptimizer | None:
    """What the model's tables train with, said once: None (nothing fused), the one spec of every fused table, or a
    :class:`PerTableOptimizers` naming each fused table's."""
    fused = {t: s for per in specs.values() for t, s in per.items() if s is not None}
    distinct = set(fused.values())
    if len(distinct) <= 1:
        return next(iter(distinct), None)
    return PerTableOptimizers(tables=fused)
