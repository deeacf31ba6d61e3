"""Fused (in-backward update) kernels of a sharded collection: what they accept, how they are built, and
the union-batch lookup that keeps every copy of a table exact (docs/ARCHITECTURE.md, "Fused optimizers and
the union-batch rule")."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist

from lightning_rec import kernels
from lightning_rec.configs import BaseEmbeddingConfig
from lightning_rec.fused_kinds import FusedOptimizerSpec, as_spec
from lightning_rec.pipeline import collectives as comm
from lightning_rec.pipeline.input_dist import as_int64, from_int64, regroup
from lightning_rec.pipeline.routing import RoutingTable
from lightning_rec.plans.shard_geometry import ShardMeta
from lightning_rec.sparse import offsets_from_lengths, segment_gather_index


def table_specs(option: object, tables: list[BaseEmbeddingConfig]) -> list[FusedOptimizerSpec | None]:
    """Each table's fused spec from a collection's ``embedding_optimizer``: one spec (or a dict of its fields) for
    all, or ``{table name: spec or None}``; raises unless every table or none is fused."""
    if isinstance(option, Mapping) and not isinstance(option.get("kind"), str):
        unknown = sorted(str(n) for n in option if n not in {t.name for t in tables})
        if unknown:
            raise ValueError(f"embedding_optimizer names tables {unknown} this collection does not have")
        specs = [as_spec(option.get(t.name)) for t in tables]
    else:
        specs = [as_spec(cast(Any, option))] * len(tables)
    fused = [t.name for t, s in zip(tables, specs) if s is not None]
    if fused and len(fused) < len(tables):
        plain = [t.name for t, s in zip(tables, specs) if s is None]
        raise ValueError(
            f"tables {fused} have a fused optimizer but {plain} of the same collection do not: a collection's "
            "tables are all fused or none"
        )
    return specs


def check_fused(
    tables: list[BaseEmbeddingConfig],
    shards: dict[str, list[ShardMeta] | None],
    specs: Sequence[FusedOptimizerSpec | None],
    device: torch.device | None = None,
) -> None:
    """Refuse what fbgemm's fused kernel cannot hold, on every rank alike, before anything is allocated."""
    # kernel (a shard rank or "dp", and a spec) -> its tables' dtypes
    kernel_dtypes: dict[tuple[int | str, FusedOptimizerSpec], dict[str, torch.dtype]] = {}
    for t, spec in zip(tables, specs):
        assert spec is not None  # table_specs: every table of a fused collection has one
        if t.dtype not in (torch.float32, torch.float16):
            raise ValueError(
                f"table {t.name!r}: embedding_optimizer (fused) needs float32 or float16 tables, got {t.dtype} "
                "(fbgemm has no fused CPU kernel for it); use embedding_optimizer=None for this collection"
            )
        if t.dtype == torch.float16 and spec.info.cpu_kernel == "torch" and device is not None and device.type == "cpu":
            raise ValueError(
                f"table {t.name!r}: the fused {spec.kind!r} optimizer runs on CPU as a torch update, which keeps "
                "float32 tables only; make the table float32 or train it on CUDA (fbgemm's kernel takes float16)"
            )
        pieces = shards[t.name]
        widths = [t.embedding_dim] if pieces is None else [s.cols for s in pieces if s.rows > 0]
        if spec.info.state_per_row and any(w != t.embedding_dim for w in widths):
            # a row-wise statistic (e.g. the mean squared gradient of the row) computed over a column shard is
            # not the full row's: the plan would change the math
            raise ValueError(
                f"table {t.name!r}: the fused {spec.kind!r} optimizer keeps one statistic per row, which a column "
                f"split would compute per column shard (shard widths {widths}); shard this table table_wise, "
                "row_wise, table_row_wise or data_parallel, or use an element-wise optimizer (sgd, adagrad)"
            )
        problem = kernels.fused_width_problem(t.name, t.embedding_dim, widths)
        if problem:
            raise ValueError(problem)
        owners: list[int | str] = ["dp"] if pieces is None else sorted({s.rank for s in pieces if s.rows > 0})
        for owner in owners:
            kernel_dtypes.setdefault((owner, spec), {})[t.name] = t.dtype
    for (owner, spec), dtypes in kernel_dtypes.items():
        if len(set(dtypes.values())) > 1:
            where = "the data-parallel tables" if owner == "dp" else f"the shards held by shard rank {owner}"
            where += f" with the fused optimizer {spec}"
            detail = ", ".join(f"{n!r}: {d}" for n, d in dtypes.items())
            raise ValueError(
                f"embedding_optimizer (fused): {where} share one kernel, which needs one dtype; got {detail}"
            )


class FusedGroup(NamedTuple):
    """One fused kernel and the inputs it looks up: positions among the lookup's features (or routes)."""

    kernel: kernels.FusedPooledKernel
    inputs: list[int]
    #: sequence kernels: each input's table in the kernel (the kernel has one feature per table)
    input_tables: tuple[int, ...] = ()


def build_kernels(
    sources: dict[str, tuple[tuple[int, int], torch.dtype, torch.Tensor | Callable[[torch.Tensor], object]]],
    specs: Sequence[FusedOptimizerSpec | None],
    table_names: list[str],
    feature_table: Sequence[int],
    routing: RoutingTable,
    local_tables: list[int],
    device: torch.device,
    pooled: bool = True,
) -> tuple[list[FusedGroup], list[FusedGroup]]:
    """The fused kernels of this rank's shards and of the data-parallel tables: one per spec, in order of each
    one's first table. Sequence lookups (``pooled=False``) get SUM kernels with one feature per table, which
    ``fused_rows`` feeds one id per bag (fbgemm's no-bag CPU mode is several times slower: F18), one per spec and
    width (their rows are one ``[ids, width]`` tensor).

    ``sources``: each table's local piece (or replica) by name, as ``(shape, dtype, initial weights)``; the
    initial weights (a tensor, possibly a view of the full table, or a function filling a tensor in place)
    go straight into the kernel's storage, so building a kernel adds no second copy of the piece.
    """

    def build(tables: list[int], input_table: Sequence[int]) -> list[FusedGroup]:
        groups = []

        def key(ti: int) -> tuple[FusedOptimizerSpec | None, int]:
            return specs[ti], 0 if pooled else sources[table_names[ti]][0][1]

        for k in dict.fromkeys(key(ti) for ti in tables):  # in order of first use
            spec = k[0]
            mine = [ti for ti in tables if key(ti) == k]
            pos = {ti: k for k, ti in enumerate(mine)}
            inputs = [i for i, ti in enumerate(input_table) if ti in pos]
            entries = [sources[table_names[ti]] for ti in mine]
            of_inputs = [pos[input_table[i]] for i in inputs]
            kernel = kernels.FusedPooledKernel(
                [(table_names[ti], e[0][0], e[0][1], e[1]) for ti, e in zip(mine, entries)],
                of_inputs if pooled else list(range(len(mine))),
                cast(FusedOptimizerSpec, spec),
                device=device,
                weights=[e[2] for e in entries],
            )
            groups.append(FusedGroup(kernel, inputs, () if pooled else tuple(of_inputs)))
        return groups

    shard = build(local_tables, [local_tables[k] for k in routing.my_route_table]) if local_tables else []
    dp = build(list(routing.dp_tables), [feature_table[f] for f in routing.dp_features]) if routing.dp_tables else []
    return shard, dp


def grouped_lookup(
    groups: list[FusedGroup],
    widths: list[int],
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    ids_per_input: list[int],
    batch: int,
    group: dist.ProcessGroup | None,
    scale: float,
    device: torch.device,
    ids_checked: bool = False,
) -> torch.Tensor:
    """SUM-pooled ``[batch, sum of widths]`` (inputs in order) through one or more fused kernels: each kernel
    looks up its inputs (:func:`union_lookup`) and its columns go back to their inputs' places."""
    args = (batch, group, scale, device, ids_checked)
    if len(groups) == 1 and groups[0].inputs == list(range(len(widths))):
        return union_lookup(groups[0].kernel, lengths, values, weights, ids_per_input, *args)
    per_lengths = lengths.view(len(widths), batch) if batch else lengths.new_zeros(len(widths), 0)
    id_pieces = torch.split(values, ids_per_input)
    w_pieces = torch.split(weights, ids_per_input) if weights is not None else None
    columns: list[torch.Tensor | None] = [None] * len(widths)
    for kernel, inputs, _ in groups:
        out = union_lookup(
            kernel,
            per_lengths[inputs].reshape(-1),
            torch.cat([id_pieces[i] for i in inputs]),
            None if w_pieces is None else torch.cat([w_pieces[i] for i in inputs]),
            [ids_per_input[i] for i in inputs],
            *args,
        )
        for i, col in zip(inputs, torch.split(out, [widths[i] for i in inputs], dim=1)):
            columns[i] = col
    missing = [i for i, c in enumerate(columns) if c is None]
    if missing:
        raise RuntimeError(f"fused lookup: inputs {missing} belong to no kernel")
    return torch.cat(cast(list[torch.Tensor], columns), dim=1)


def union_lookup(
    kernel: kernels.FusedPooledKernel,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    ids_per_feature: list[int],
    batch: int,
    group: dist.ProcessGroup | None,
    scale: float,
    device: torch.device,
    ids_checked: bool = False,
) -> torch.Tensor:
    """SUM-pooled ``[batch, width]`` from feature-major inputs; exact when ``group`` holds copies of the tables.

    A fused kernel updates in backward, so every copy must see the gradient of every rank's samples at
    once: each rank of ``group`` looks up the union batch (all ranks' bags, feature-major, ranks in
    group order), keeps its own rows of the output, and in backward all-gathers the rows' gradients
    into the union's gradient (``comm.own_rows_of_union``). Every copy then applies the same update
    (bitwise: same inputs, same kernel) and holds the same optimizer state. Cost: ``|group|`` x the
    lookup and its backward, plus two all-gathers in forward (sizes, then lengths, ids and weight bits in
    one buffer) and one of the pooled gradient in backward. Without autograd (evaluation) only the local
    batch is looked up. ``scale`` (the ``embedding_grad`` rule) scales the update once, in the kernel.
    ``ids_checked``: every rank checked its ids against the tables (``FusedPooledKernel.forward``).
    """
    if group is None or not torch.is_grad_enabled():
        return kernel(values, offsets_from_lengths(lengths), weights, grad_scale=scale, ids_checked=ids_checked)
    n = len(ids_per_feature)
    w_grad = weights is not None and weights.requires_grad
    info = comm.all_gather_ints([batch, int(w_grad), *ids_per_feature], group, device=device)
    batches = [row[0] for row in info]
    id_counts = [row[2:] for row in info]
    # weights that need a gradient (on any rank: all must pack alike) travel in their own differentiable
    # gather; others as bits in the buffer
    w_bits = weights is not None and not any(row[1] for row in info)
    parts = [lengths.long(), values.long()] + ([as_int64(cast(torch.Tensor, weights))] if w_bits else [])
    sizes = [n * b + (2 if w_bits else 1) * sum(c) for b, c in zip(batches, id_counts)]
    buf, stride = comm.all_gather_padded(torch.cat(parts), sizes, group)
    # regroup [rank][lengths | ids | weights][feature] into [feature][rank] pieces with one index (rank r's
    # part starts at r * stride; its ids after its n * b_r lengths, its weight bits after its ids)
    b_of = torch.tensor(batches, dtype=torch.long, device=device)
    counts = torch.tensor(id_counts, dtype=torch.long, device=device).view(len(batches), n)
    rank = torch.arange(len(batches), device=device).repeat(n)  # [feature][rank] order
    feat = torch.arange(n, device=device).repeat_interleave(len(batches))
    first_id = torch.arange(len(batches), device=device) * stride + n * b_of
    id_starts = first_id[rank] + (torch.cumsum(counts, 1) - counts)[rank, feat]
    starts = [rank * stride + feat * b_of[rank], id_starts]
    lens = [b_of[rank], counts[rank, feat]]
    if w_bits:
        starts.append(id_starts + counts.sum(1)[rank])
        lens.append(lens[1])
    n_lengths, n_ids = n * sum(batches), sum(map(sum, id_counts))
    index = segment_gather_index(torch.cat(starts), torch.cat(lens), n_lengths + n_ids * (2 if w_bits else 1))
    pieces = torch.split(buf.index_select(0, index), [n_lengths, n_ids, n_ids if w_bits else 0])
    union_lengths, union_values = pieces[0], pieces[1]
    if w_bits:
        assert weights is not None
        weights = from_int64(pieces[2], weights.dtype)
    elif weights is not None:
        seg = [c for row in id_counts for c in row]
        weights = regroup(comm.gather_union(weights, [sum(c) for c in id_counts], group), seg, len(batches), n)
    union = kernel(
        union_values, offsets_from_lengths(union_lengths), weights, grad_scale=scale, ids_checked=ids_checked
    )
    return comm.own_rows_of_union(union, batches, group)
