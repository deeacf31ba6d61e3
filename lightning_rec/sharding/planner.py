"""Automatic plans. For now one rule: whole tables, largest first, onto the least-loaded rank."""

from __future__ import annotations

from lightning_rec.configs import BaseEmbeddingConfig
from lightning_rec.sharding.plan import ParameterSharding, table_wise


def default_module_plan(tables: list[BaseEmbeddingConfig], group_size: int) -> dict[str, ParameterSharding]:
    """Table-wise, balancing bytes: deterministic for the same tables and group size."""
    load = [0] * group_size
    plan = {}
    order = sorted(
        range(len(tables)),
        key=lambda i: (-tables[i].num_embeddings * tables[i].embedding_dim * tables[i].dtype.itemsize, i),
    )
    for i in order:
        t = tables[i]
        rank = min(range(group_size), key=lambda r: (load[r], r))
        load[rank] += t.num_embeddings * t.embedding_dim * t.dtype.itemsize
        plan[t.name] = table_wise(rank)
    return {t.name: plan[t.name] for t in tables}
