"""Fused (in-backward update) lookups of sequence collections: one row per id, exact when tables have copies.

Rows come from a SUM kernel fed one id per bag (``_rows``): the same rows and updates as fbgemm's no-bag mode, whose
CPU kernel is several times slower (docs/ARCHITECTURE.md F18).

The pooled collections' union-batch rule (``fused_lookup.union_lookup``), for rows instead of bags: every copy of
a table (data-parallel tables; shards under 2D replicas) looks up the ids of every rank holding a copy and keeps
its own rows; backward all-gathers each rank's row gradients into the union's, so every copy applies the same
update (docs/ARCHITECTURE.md, "Fused optimizers and the union-batch rule").
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_rec import kernels
from lightning_rec.pipeline import collectives as comm
from lightning_rec.pipeline.fused_lookup import FusedGroup
from lightning_rec.sparse import segment_gather_index


def _rows(
    kernel: kernels.FusedPooledKernel,
    values: torch.Tensor,
    per_table: list[int],
    scale: float,
    ids_checked: bool,
) -> torch.Tensor:
    """``[len(values), dim]``: each id's row, through a SUM kernel with one feature per table, one id per bag.

    ``values`` holds table 0's ids, then table 1's, ... (``per_table`` of each). Every table gets as many bags as
    the busiest one (the rest empty); a bag of one id pools to its row and passes its row's gradient back, so
    rows and updates are the no-bag lookup's, at the SUM kernel's speed. Memory: the ``[bags, tables x dim]``
    output, up to the number of tables times the rows when one table has all the ids.
    """
    n_tables, dim = len(per_table), kernel.dims[0]
    bags = max(per_table, default=0)
    dev = values.device
    counts = torch.tensor(per_table, dtype=torch.long, device=dev)
    starts = torch.cumsum(counts, 0) - counts
    slots = torch.arange(bags, device=dev)
    offsets = torch.cat(
        [(starts[:, None] + torch.minimum(slots[None, :], counts[:, None])).reshape(-1), counts.sum().view(1)]
    )
    out = kernel(values, offsets, grad_scale=scale, ids_checked=ids_checked)  # [bags, tables x dim]
    # the j-th id of table t is bag j of table t's columns: row j * tables + t of the [bags * tables, dim] view
    n = int(values.numel())
    table = torch.repeat_interleave(torch.arange(n_tables, device=dev), counts, output_size=n)
    index = (torch.arange(n, device=dev) - starts[table]) * n_tables + table
    return out.reshape(bags * n_tables, dim).index_select(0, index)


def _per_table(counts: list[int], input_tables: tuple[int, ...], n_tables: int) -> list[int]:
    """Ids per kernel table from ids per input (a table's inputs are consecutive: the kernels' table order)."""
    out = [0] * n_tables
    for c, t in zip(counts, input_tables):
        out[t] += c
    return out


def union_rows(
    kernel: kernels.FusedPooledKernel,
    input_tables: tuple[int, ...],
    values: list[torch.Tensor],
    group: dist.ProcessGroup | None,
    scale: float,
    device: torch.device,
    ids_checked: bool,
) -> list[torch.Tensor]:
    """Each input's ``[ids, dim]`` rows through a fused kernel with one feature per table (inputs: features or
    routes, in order; ``input_tables[i]``: input i's table in the kernel, consecutive inputs sharing a table).

    With ``group`` (ranks holding copies of the kernel's tables) and autograd on, the kernel looks up the union of
    every rank's ids, input-major and ranks in group order within an input, and this rank keeps its own rows.
    """
    n_tables = len(kernel.table_names)
    counts = [v.numel() for v in values]
    if group is None or not torch.is_grad_enabled():
        flat = torch.cat(values) if values else torch.zeros(0, dtype=torch.long, device=device)
        out = _rows(kernel, flat, _per_table(counts, input_tables, n_tables), scale, ids_checked)
        return list(torch.split(out, counts))
    info = comm.all_gather_ints(counts, group, device=device)  # [rank][input]
    ranks, n = len(info), len(counts)
    totals = [sum(row) for row in info]
    buf, stride = comm.all_gather_padded(torch.cat(values).long(), totals, group)
    per = torch.tensor(info, dtype=torch.long, device=device)  # [rank, input]
    # where rank r's ids of input i sit in the gathered buffer, taken in [input][rank] order
    src = (torch.arange(ranks, device=device) * stride)[:, None] + (torch.cumsum(per, 1) - per)
    union = buf.index_select(0, segment_gather_index(src.t().reshape(-1), per.t().reshape(-1), sum(totals)))
    union_counts = [sum(row[i] for row in info) for i in range(n)]
    out = _rows(kernel, union, _per_table(union_counts, input_tables, n_tables), scale, ids_checked)
    # the union's rows in [rank][input] order, so that each rank's rows are one slice of it
    at = (torch.cumsum(per.t().reshape(-1), 0) - per.t().reshape(-1)).view(n, ranks).t()  # [rank, input] start
    rank_major = out.index_select(0, segment_gather_index(at.reshape(-1), per.reshape(-1), sum(totals)))
    mine = comm.own_rows_of_union(rank_major, totals, group)
    return list(torch.split(mine, counts))


def grouped_rows(
    groups: list[FusedGroup],
    values: list[torch.Tensor],
    group: dist.ProcessGroup | None,
    scale: float,
    device: torch.device,
    ids_checked: bool,
) -> list[torch.Tensor]:
    """Each input's rows through the kernels that hold its table (one kernel per spec and width)."""
    rows: list[torch.Tensor | None] = [None] * len(values)
    for kernel, inputs, input_tables in groups:
        got = union_rows(kernel, input_tables, [values[i] for i in inputs], group, scale, device, ids_checked)
        for i, r in zip(inputs, got):
            rows[i] = r
    missing = [i for i, r in enumerate(rows) if r is None]
    if missing:
        raise RuntimeError(f"fused sequence lookup: inputs {missing} belong to no kernel")
    return [r for r in rows if r is not None]
