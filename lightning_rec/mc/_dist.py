"""Sharded remapping: each id is remapped on the rank that owns its bucket's rows.

Two ways. Folded (the default, :func:`remap_received`): the sharded collection's own input dist routes raw
ids by bucket owner (:func:`bucket_rows`, through the wrapper's stage hook) and the owner remaps them when the
lookup takes them: no communication beyond the lookup's. Separate (:func:`remap_sharded`; when the remapped ids
must go back to the sender: ``return_remapped_features=True`` or ``remap()``), per step and per rank: bucketize
the raw ids, all-to-all them to the owners (counts first, then ids), let each owner remap the ids of its buckets
(all ranks' ids of a bucket together, so its decisions equal one process's), and all-to-all the rows back.

Example, 2 ranks, a row-wise table of 2 buckets (bucket 0 on rank 0, bucket 1 on rank 1): rank 0 holds ids
``[a(b0), c(b1)]``, rank 1 ``[d(b1)]``; rank 1 receives ``[c]`` from rank 0 and ``[d]`` from itself and
remaps ``{c, d}`` in one step; the separate way then returns ``c``'s row to rank 0, the folded way looks it
up on rank 1 and returns the pooled row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_rec import transport
from lightning_rec.configs import BaseEmbeddingConfig
from lightning_rec.mc import _remap
from lightning_rec.mc.modules import (
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
    rebuild,
    remap_tables,
    split_by_table,
)
from lightning_rec.pipeline.input_dist import Received
from lightning_rec.pipeline.sharded_collection import ShardedCollection
from lightning_rec.plans.shard_geometry import ShardMeta
from lightning_rec.sparse import KeyedJaggedTensor


@dataclass
class Ownership:
    """Which shard-group rank owns each row of one managed table."""

    owner_of_row: torch.Tensor  # [zch] int64
    owned_rows: torch.Tensor  # [zch] bool, this rank


def row_shards(coll: ShardedCollection, table: str) -> tuple[BaseEmbeddingConfig, list[ShardMeta]]:
    """``table``'s config and its shards holding rows; raises unless one rank holds each row whole."""
    cfg = next(c for c in coll.tables if c.name == table)
    shards = coll.shards[table]
    if shards is None:
        raise ValueError(
            f"managed collision table {table!r} is data-parallel; shard it table-wise or row-wise so that one "
            "rank owns each bucket"
        )
    if coll.replica_group is not None:
        raise ValueError(f"managed collision table {table!r}: 2D (replicated) sharding is not supported")
    for s in shards:
        if s.col_offset != 0 or s.cols != cfg.embedding_dim:
            raise ValueError(
                f"managed collision table {table!r} is split by columns; shard it table-wise or row-wise so that "
                "one rank holds each row whole"
            )
    return cfg, [s for s in shards if s.rows > 0]


def ownership(coll: ShardedCollection, table: str, m: MCHManagedCollisionModule) -> Ownership:
    cfg, shards = row_shards(coll, table)
    owner = torch.full((cfg.num_embeddings,), -1, dtype=torch.int64)
    for s in shards:
        owner[s.row_offset : s.row_offset + s.rows] = s.rank
    check_alignment(coll, table, m.zch_size, int(m._mch_num_buckets))
    check_alignment(coll, table, m.zch_size, m.num_buckets)
    return Ownership(owner, owner == dist.get_rank(coll.shard_group))


def check_alignment(coll: ShardedCollection, table: str, zch: int, num_buckets: int) -> None:
    """Raise unless every shard of ``table`` holds whole buckets of ``num_buckets``."""
    _, shards = row_shards(coll, table)
    bs = zch // num_buckets
    for s in shards:
        if s.row_offset % bs or s.rows % bs:
            raise ValueError(
                f"managed collision table {table!r}: rank {s.rank}'s rows {s.row_offset}..{s.row_offset + s.rows - 1} "
                f"split a bucket of {bs} rows ({num_buckets} buckets); row-wise shard boundaries must fall on "
                "bucket boundaries (choose a bucket count or shard sizes that agree)"
            )


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    out = torch.empty(sum(recv), dtype=x.dtype)
    transport.all_to_all_single(out, x.contiguous(), recv, send, group)
    return out


def remap_sharded(
    mcc: ManagedCollisionCollection,
    kjt: KeyedJaggedTensor,
    coll: ShardedCollection,
    owners: dict[str, Ownership],
) -> tuple[KeyedJaggedTensor, dict[str, _remap.StepResult]]:
    """Collective remap of ``kjt``: every rank of the shard group calls it with its local batch."""
    if not isinstance(kjt, KeyedJaggedTensor):
        raise TypeError(f"expected a KeyedJaggedTensor, got {type(kjt).__name__}")
    group = coll.shard_group
    world = dist.get_world_size(group)
    segs, by_table = split_by_table(mcc, kjt)
    mods = mcc.modules_by_table()
    # the same feature order on every rank: managed tables in config order, their features in config order
    keys = kjt.keys()
    feats: list[tuple[str, int]] = []
    problem = ""
    for cfg in mcc.embedding_configs():
        if cfg.name not in mods:
            continue
        for f in cfg.feature_names:
            if f not in keys:
                problem = problem or f"feature {f!r} of managed table {cfg.name!r} is missing from the input {keys}"
            feats.append((cfg.name, keys.index(f) if f in keys else -1))
    nf = len(feats)
    no_ids = torch.zeros(0, dtype=torch.int64)
    perms: list[torch.Tensor] = []
    pieces: list[Sequence[torch.Tensor]] = []
    # one column per feature, and a last one flagging bad input: a rank that raised alone would leave the
    # others waiting in the collective, so every rank learns of it from the counts and raises
    counts = torch.zeros(world, nf + 1, dtype=torch.int64)
    for j, (t, i) in enumerate(feats):
        m = mods[t]
        v = segs[i].to(torch.int64) if i >= 0 else no_ids
        if v.numel() and int(v.min()) < 0:
            problem = problem or f"managed collision {t!r}: raw ids must be non-negative, got {int(v.min())}"
            v = no_ids
        bs = m.zch_size // int(m._mch_num_buckets)
        d = owners[t].owner_of_row[_remap.bucket_of(v, int(m._mch_num_buckets)) * bs]
        perm = torch.sort(d, stable=True).indices
        perms.append(perm)
        pieces.append(torch.split(v[perm], torch.bincount(d, minlength=world).tolist()))
        counts[:, j] = torch.bincount(d, minlength=world)
    if problem:
        counts.zero_()
        counts[:, nf] = 1
        pieces = [[no_ids] * world for _ in range(nf)]
    send_vals = torch.cat([pieces[j][r] for r in range(world) for j in range(nf)] or [no_ids])
    recv_counts = _all_to_all(counts.flatten(), [nf + 1] * world, [nf + 1] * world, group).view(world, nf + 1)
    bad = recv_counts[:, nf].nonzero().flatten().tolist()
    if problem or bad:
        raise ValueError(
            problem
            or f"managed collision: the input of shard-group rank(s) {bad} is invalid "
            "(their error says why); no rank remapped this step"
        )
    counts, recv_counts = counts[:, :nf], recv_counts[:, :nf]
    send_split, recv_split = counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    recv_vals = _all_to_all(send_vals, send_split, recv_split, group)
    # owner side: recv_vals is [src rank][feature] segments; remap each table's ids together
    recv_segs = list(torch.split(recv_vals, recv_counts.flatten().tolist()))
    out_segs = list(recv_segs)
    idxs, ids = [], []
    for t, m in mods.items():
        m.begin_step()
        idx = [r * nf + j for r in range(world) for j in range(nf) if feats[j][0] == t]
        idxs.append(idx)
        ids.append(torch.cat([recv_segs[k] for k in idx]) if idx else torch.zeros(0, dtype=torch.int64))
    results = dict(zip(mods, remap_tables(list(mods.values()), ids)))
    for idx, res in zip(idxs, results.values()):
        for k, o in zip(idx, torch.split(res.slots, [recv_segs[k].numel() for k in idx])):
            out_segs[k] = o
    back = _all_to_all(torch.cat(out_segs) if out_segs else recv_vals, recv_split, send_split, group)
    # sender side: back is [dest rank][feature]; undo the sort by destination
    back_segs = torch.split(back, counts.flatten().tolist())
    for j, (_, i) in enumerate(feats):
        slots = torch.cat([back_segs[r * nf + j] for r in range(world)])
        out = torch.empty_like(slots)
        out[perms[j]] = slots
        segs[i] = out
    del by_table
    return rebuild(kjt, segs), results


# -- remapping folded into the sharded collection's input dist -------------------------------------------------
def bucket_rows(m: MCHManagedCollisionModule, ids: torch.Tensor) -> torch.Tensor:
    """Raw ids -> the first row of their bucket: the input dist sends each id to the block holding that row.

    The bucket count is read now. An input dist routed before a resize is still delivered to the right rank:
    every valid count keeps whole buckets on one rank and nests in the other (``_remap.bucket_of``), so the rank
    owning an id's bucket is the same at both.
    """
    nb = int(m._mch_num_buckets)
    return _remap.bucket_of(ids, nb) * (m.zch_size // nb)


def remap_received(
    coll: ShardedCollection, mods: dict[str, MCHManagedCollisionModule], recv: Received
) -> tuple[Received, dict[str, _remap.StepResult]]:
    """Owner side of the fold: remap the raw ids this rank received for its shards, made local to the shards.

    ``recv.values`` are route-major (this rank's routes, each holding every source rank's bags); a table's
    routes (one per feature) are remapped together, in one step, as one process remaps the global batch.
    Every rank remaps every table (an empty one where it holds no rows), so each has stats for the step, and
    begins the step first, as one process does before remapping.
    """
    for m in mods.values():
        m.begin_step()
    routing = coll.routing
    names = [t.name for t in coll.tables]
    mine = routing.my_routes
    segs = list(torch.split(recv.values, recv.ids_per_route())) if mine else []
    # one pass over every table (``remap_tables``): the fixed cost of a remap is paid once, not per table
    routes_of: dict[str, list[int]] = {t: [] for t in mods}
    for k, r in enumerate(mine):
        if names[r.table] in routes_of:
            routes_of[names[r.table]].append(k)
    ids = [
        torch.cat([segs[k] for k in ks]).cpu() if ks else torch.zeros(0, dtype=torch.int64) for ks in routes_of.values()
    ]
    results = dict(zip(mods, remap_tables(list(mods.values()), ids)))
    for ks, res in zip(routes_of.values(), results.values()):
        for k, rows in zip(ks, torch.split(res.slots, [segs[k].numel() for k in ks])):
            segs[k] = (rows - mine[k].shard.row_offset).to(recv.values.device)
    if not segs:
        return recv, results
    return dataclasses.replace(recv, values=torch.cat(segs)), results
