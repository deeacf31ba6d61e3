"""Managed-collision modules: raw 64-bit ids -> rows of a fixed-size table, with eviction (TorchRec names)."""

from __future__ import annotations

import os
from collections.abc import ItemsView, Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from lightning_rec import _compat
from lightning_rec.configs import BaseEmbeddingConfig
from lightning_rec.kernels import TableContainer
from lightning_rec.mc import _batch, _remap
from lightning_rec.sparse import KeyedJaggedTensor

DEFAULT_NUM_BUCKETS = 768


class LRU_EvictionPolicy:
    """Evict the id accessed least recently; a new id always takes a row while its bucket has one."""

    name = "lru"

    def __repr__(self) -> str:
        return "LRU_EvictionPolicy()"


class LFU_EvictionPolicy:
    """Evict the id seen least often (then least recently), and only for a new id seen more often this step."""

    name = "lfu"

    def __repr__(self) -> str:
        return "LFU_EvictionPolicy()"


def _fresh_generation() -> int:
    # a value no checkpoint holds: tells an in-place load (DCP) apart from our own updates
    return int.from_bytes(os.urandom(8), "little") >> 2


class MCHManagedCollisionModule(nn.Module):
    """One table's managed collision: maps raw int64 ids to rows ``[0, zch_size)`` (TorchRec's MCH module).

    The rows are split into ``num_buckets`` buckets of ``zch_size / num_buckets`` rows; a raw id belongs to
    the bucket its hash falls in and is only ever placed in that bucket's rows, so a rank owning a bucket's
    rows remaps its ids alone. A raw id keeps its row until evicted; see ``_remap.remap_step`` for the rules.

    State (in ``state_dict``): ``_mch_raw_ids`` (id per row, -1 empty), ``_mch_last_access`` (step of last
    access), ``_mch_counts`` (accesses), ``_mch_step``, ``_mch_num_buckets`` (the bucket count the state
    was written with). Loading state written with another bucket count migrates on the next forward.

    Args:
        zch_size: rows of the table (its ``num_embeddings``).
        eviction_policy: ``LRU_EvictionPolicy()`` (default) or ``LFU_EvictionPolicy()``.
        eviction_interval: TorchRec's argument (in its position); 1, the only value: admission and eviction
            run at every step.
        num_buckets: bucket count; must divide ``zch_size``.
        name: table name, for error messages.
    """

    per_rank_state = True  # each rank remaps its own buckets: DDP must not broadcast it (sharded.ddp_ignored_names)

    # buffers (register_buffer in __init__)
    _mch_raw_ids: torch.Tensor
    _mch_last_access: torch.Tensor
    _mch_counts: torch.Tensor
    _mch_step: torch.Tensor
    _mch_num_buckets: torch.Tensor
    _mch_generation: torch.Tensor

    def __init__(
        self,
        zch_size: int,
        device: torch.device | str | None = None,
        eviction_policy: LRU_EvictionPolicy | LFU_EvictionPolicy | None = None,
        eviction_interval: int = 1,
        *,
        num_buckets: int = DEFAULT_NUM_BUCKETS,
        name: str | None = None,
    ) -> None:
        super().__init__()
        if eviction_interval != 1:
            # TorchRec's argument, in its position: every step here admits and evicts (its interval 1); buffering
            # new ids for several steps would change which ids get rows, so another interval is refused
            raise ValueError(
                f"managed collision {name!r}: eviction_interval={eviction_interval!r} is not supported; ids are "
                "admitted and evicted at every step (eviction_interval=1)"
            )
        if device is not None and torch.device(device).type not in ("cpu", "meta"):
            raise ValueError(f"managed collision {name!r}: remapping runs on CPU, got device {device}")
        self._name = name
        policy = eviction_policy if eviction_policy is not None else LRU_EvictionPolicy()
        if not isinstance(policy, (LRU_EvictionPolicy, LFU_EvictionPolicy)):
            raise TypeError(f"managed collision {name!r}: unknown eviction policy {policy!r}")
        self._eviction_policy = policy
        if zch_size <= 0:
            raise ValueError(f"managed collision {name!r}: zch_size must be positive, got {zch_size}")
        self._zch_size = int(zch_size)
        self.check_num_buckets(num_buckets)
        self._target_num_buckets = int(num_buckets)
        # the remap state is real from the start, on the CPU, even in a model built on the meta device
        # (device="meta" as TorchRec's examples pass it, or under torch.device("meta")): only tables are deferred
        long, cpu = torch.int64, torch.device("cpu")
        self.register_buffer("_mch_raw_ids", torch.full((zch_size,), -1, dtype=long, device=cpu))
        self.register_buffer("_mch_last_access", torch.zeros(zch_size, dtype=long, device=cpu))
        self.register_buffer("_mch_counts", torch.zeros(zch_size, dtype=long, device=cpu))
        self.register_buffer("_mch_step", torch.zeros((), dtype=long, device=cpu))
        self.register_buffer("_mch_num_buckets", torch.tensor(int(num_buckets), dtype=long, device=cpu))
        self.register_buffer("_mch_generation", torch.tensor(_fresh_generation(), dtype=long, device=cpu))
        self._index: _remap.SlotIndex | None = None
        self._index_generation: int | None = None
        self._owned: torch.Tensor | None = None  # rows this rank owns when sharded (None: all)
        self._group: dist.ProcessGroup | None = None  # set while the table is sharded
        self.last_stats: dict[str, int] = {}
        _compat.register_state_dict_hook(self, _gather_state_hook)

    def _label(self) -> str:
        return "module" if self._name is None else f"table {self._name!r}"

    @property
    def zch_size(self) -> int:
        return self._zch_size

    @property
    def num_buckets(self) -> int:
        """The bucket count this module remaps with (after any pending migration)."""
        return self._target_num_buckets

    @property
    def eviction_policy(self) -> LRU_EvictionPolicy | LFU_EvictionPolicy:
        return self._eviction_policy

    def check_num_buckets(self, num_buckets: int, current: int | None = None) -> None:
        """Raise unless ``num_buckets`` divides the table and divides or is a multiple of ``current``."""
        n = int(num_buckets)
        if n <= 0 or self._zch_size % n or n > _remap.MAX_BUCKETS:
            raise ValueError(
                f"managed collision {self._label()}: num_buckets={num_buckets} must be a positive divisor of "
                f"zch_size={self._zch_size} (at most {_remap.MAX_BUCKETS})"
            )
        if current is not None and n % current and current % n:
            raise ValueError(
                f"managed collision {self._label()}: cannot resize from {current} to {n} buckets; the new count "
                "must be a multiple or a divisor of the current one (each new bucket then lies inside one old "
                "bucket's rows or covers whole old buckets)"
            )

    def _touch(self) -> None:
        gen = _fresh_generation()
        self._mch_generation.fill_(gen)
        self._index_generation = gen

    def prepare(self, owned: torch.Tensor | None = None, group: dist.ProcessGroup | None = None) -> None:
        """Rebuild derived state after a load (or first use); with ``owned``, forget rows this rank does not own.

        ``group``: the shard group when sharded; ``state_dict`` then gathers every rank's rows (collective).
        """
        self._group = group
        # the wrapper passes the same cached mask every step: skip the O(table) comparison then
        changed_owner = owned is not self._owned and (
            (owned is None) != (self._owned is None)
            or (owned is not None and not torch.equal(owned, cast(torch.Tensor, self._owned)))
        )
        if self._index is None or changed_owner or int(self._mch_generation) != self._index_generation:
            self._owned = owned
            if owned is not None:
                self._mch_raw_ids[~owned] = -1
                self._mch_last_access[~owned] = 0
                self._mch_counts[~owned] = 0
            self._check_state()
            self._index = _remap.SlotIndex(self._mch_raw_ids)
            self._touch()

    def _check_state(self) -> None:
        nb = int(self._mch_num_buckets)
        self.check_num_buckets(nb)
        occ = self._mch_raw_ids >= 0
        rows = occ.nonzero().flatten()
        bad = _remap.bucket_of(self._mch_raw_ids[rows], nb) != rows // (self._zch_size // nb)
        ids = self._mch_raw_ids[rows]
        if bool(bad.any()) or ids.unique().numel() != ids.numel():
            raise ValueError(
                f"managed collision {self._label()}: the loaded remap table is inconsistent (an id outside its "
                f"bucket's rows for {nb} buckets, or an id in two rows)"
            )

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],  # type: ignore[override]
        error_msgs: list[str],
    ) -> None:
        # with tables "a" and "a.b", the key "a.b._mch_raw_ids" starts with this module's prefix "a." but is
        # the other table's; the container checks unexpected keys
        n = len(unexpected_keys)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        del unexpected_keys[n:]

    def pending_resize(self) -> bool:
        return int(self._mch_num_buckets) != self._target_num_buckets

    def begin_step(self) -> int:
        """Advance the step counter (every rank, every training forward) and return the new step."""
        if not self.training:
            return int(self._mch_step)
        if int(self._mch_step) >= _remap.MAX_STEPS:
            raise RuntimeError(f"managed collision {self._label()}: step counter reached {_remap.MAX_STEPS}")
        self._mch_step += 1
        return int(self._mch_step)

    def remap(self, ids: torch.Tensor) -> _remap.StepResult:
        """Remap one step's ids (any order; several features of the table together) and admit new ids.

        In eval mode (``module.eval()``) the state is only read: new ids get their bucket's fallback row.
        """
        return remap_tables([self], [ids])[0]

    def _table_state(self) -> _batch.TableState:
        if self._index is None:
            self.prepare()
        assert self._index is not None  # prepare() builds it
        return _batch.TableState(
            self._mch_raw_ids,
            self._mch_last_access,
            self._mch_counts,
            self._index,
            int(self._mch_num_buckets),
            int(self._mch_step),
            self._eviction_policy.name == "lfu",
        )

    def _after_remap(self, res: _remap.StepResult) -> None:
        if res.admitted_slots.numel():
            self._touch()
        self.last_stats = {
            "lookups": res.lookups,
            "hits": res.hits,
            "evicted": res.evicted,
            "admitted": int(res.admitted_slots.numel()),
            "unadmitted": res.unadmitted,
        }

    def resize_plan(self, num_buckets: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Move ids to ``num_buckets`` buckets; returns ``(src_rows, dst_rows, evicted)`` for the caller's rows."""
        if self._index is None:
            self.prepare(self._owned, self._group)
        cur = int(self._mch_num_buckets)
        self.check_num_buckets(num_buckets, cur)
        src, dst, evicted = _remap.resize_plan(
            self._mch_raw_ids, self._mch_last_access, self._mch_counts, int(num_buckets), self._eviction_policy.name
        )
        for buf in (self._mch_raw_ids, self._mch_last_access, self._mch_counts):
            moved = buf[src].clone()
            buf.fill_(-1 if buf is self._mch_raw_ids else 0)
            buf[dst] = moved
        self._mch_num_buckets.fill_(int(num_buckets))
        self._target_num_buckets = int(num_buckets)
        self._index = _remap.SlotIndex(self._mch_raw_ids)
        self._touch()
        return src, dst, evicted

    def set_target_num_buckets(self, num_buckets: int) -> None:
        self.check_num_buckets(num_buckets)
        self._target_num_buckets = int(num_buckets)

    def extra_repr(self) -> str:
        return f"zch_size={self._zch_size}, num_buckets={self._target_num_buckets}, policy={self._eviction_policy}"


def remap_tables(mods: Sequence[MCHManagedCollisionModule], ids: Sequence[torch.Tensor]) -> list[_remap.StepResult]:
    """``[m.remap(v) for m, v in zip(mods, ids)]`` in one pass over all tables (``_batch.remap_batch``).

    Modules in eval mode only read their state; training and eval modules are remapped in two passes.
    """
    vals = [v.to(torch.int64) for v in ids]
    for m, v in zip(mods, vals):
        if v.numel() and int(v.min()) < 0:
            raise ValueError(f"managed collision {m._label()}: raw ids must be non-negative, got {int(v.min())}")
    out: list[_remap.StepResult | None] = [None] * len(mods)
    for training in (True, False):
        pick = [i for i, m in enumerate(mods) if m.training == training]
        if pick:
            res = _batch.remap_batch([vals[i] for i in pick], [mods[i]._table_state() for i in pick], update=training)
            for i, r in zip(pick, res):
                mods[i]._after_remap(r)
                out[i] = r
    return out  # type: ignore[return-value]


def _gather_state_hook(
    module: MCHManagedCollisionModule, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any]
) -> dict[str, Any]:
    """Sharded: fill every rank's buffers with the owners' rows, so state_dict is the full, replicated state.

    Collective over the shard group. Rows a rank does not own are empty (-1 / 0), so MAX picks the owner's
    values. The buffers themselves are filled (not copies), so an in-place load (DCP) reaches them; the next
    forward forgets the rows this rank does not own again.
    """
    if module._group is None:
        return state_dict
    stacked = torch.stack([module._mch_raw_ids, module._mch_last_access, module._mch_counts])
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX, group=module._group)
    module._mch_raw_ids.copy_(stacked[0])
    module._mch_last_access.copy_(stacked[1])
    module._mch_counts.copy_(stacked[2])
    dist.all_reduce(module._mch_generation, op=dist.ReduceOp.MAX, group=module._group)
    module._index_generation = None
    return state_dict


class ManagedCollisionCollection(nn.Module):
    """Managed-collision modules keyed by table name, with the tables' configs (TorchRec's MCC).

    ``forward(kjt)`` returns the KJT with every feature's ids remapped to rows of its table (the same keys,
    lengths and weights). Features of one table are remapped together, in one step.
    """

    def __init__(
        self,
        managed_collision_modules: Mapping[str, MCHManagedCollisionModule],
        embedding_configs: Sequence[BaseEmbeddingConfig],
    ) -> None:
        super().__init__()
        configs = {c.name: c for c in embedding_configs}
        unknown = [t for t in managed_collision_modules if t not in configs]
        if unknown:
            raise ValueError(f"managed collision modules for tables {unknown} that have no config ({sorted(configs)})")
        for t, m in managed_collision_modules.items():
            if not isinstance(m, MCHManagedCollisionModule):
                raise TypeError(f"table {t!r}: expected an MCHManagedCollisionModule, got {type(m).__name__}")
            if m.zch_size != configs[t].num_embeddings:
                raise ValueError(
                    f"table {t!r}: managed collision zch_size={m.zch_size} but the table has "
                    f"num_embeddings={configs[t].num_embeddings}"
                )
            if m._name is None:
                m._name = t
        self._embedding_configs = list(embedding_configs)
        self._managed_collision_modules = _ModuleMap(managed_collision_modules)
        self._feature_to_table = {
            f: c.name for c in embedding_configs for f in c.feature_names if c.name in managed_collision_modules
        }

    def embedding_configs(self) -> list[BaseEmbeddingConfig]:
        return list(self._embedding_configs)

    def modules_by_table(self) -> dict[str, MCHManagedCollisionModule]:
        return dict(self._managed_collision_modules.items())

    def table_features(self, keys: Sequence[str]) -> dict[str, list[int]]:
        """``{table: positions in keys of its features}`` for the managed tables."""
        out: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            t = self._feature_to_table.get(k)
            if t is not None:
                out.setdefault(t, []).append(i)
        return out

    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        remapped, _ = remap_local(self, features)
        return remapped


class _ModuleMap(TableContainer):
    """Children keyed by table name (any string; ``ModuleDict`` would refuse dots)."""

    def __init__(self, modules: Mapping[str, nn.Module]) -> None:
        super().__init__()
        for k, m in modules.items():
            self.add(k, m)

    def items(self) -> ItemsView[str, MCHManagedCollisionModule]:
        return _compat.child_modules(self).items()


def split_by_table(
    mcc: ManagedCollisionCollection, kjt: KeyedJaggedTensor
) -> tuple[list[torch.Tensor], dict[str, list[int]]]:
    """``(per-key value segments, {table: key positions})`` for the managed tables of ``kjt``."""
    # remap state lives on CPU (sorting and hashing small batches); ids come back on the input's device
    segs = list(torch.split(kjt.values().cpu(), kjt.length_per_key()))
    return segs, mcc.table_features(kjt.keys())


def rebuild(kjt: KeyedJaggedTensor, segs: list[torch.Tensor]) -> KeyedJaggedTensor:
    values = torch.cat(segs) if segs else kjt.values()
    values = values.to(device=kjt.values().device, dtype=kjt.values().dtype)
    return KeyedJaggedTensor(
        kjt.keys(), values, weights=kjt.weights_or_none(), lengths=kjt.lengths(), stride=kjt.stride()
    )


def remap_local(
    mcc: ManagedCollisionCollection, kjt: KeyedJaggedTensor
) -> tuple[KeyedJaggedTensor, dict[str, _remap.StepResult]]:
    """Single-process remap of every managed table's ids; returns the remapped KJT and each table's result."""
    if not isinstance(kjt, KeyedJaggedTensor):
        raise TypeError(f"expected a KeyedJaggedTensor, got {type(kjt).__name__}")
    segs, by_table = split_by_table(mcc, kjt)
    mods = mcc.modules_by_table()
    ids = []
    for t, m in mods.items():
        m.prepare()
        m.begin_step()
        pos = by_table.get(t, [])
        ids.append(torch.cat([segs[i] for i in pos]) if pos else torch.zeros(0, dtype=torch.int64))
    results = dict(zip(mods, remap_tables(list(mods.values()), ids)))
    for t, res in results.items():
        pos = by_table.get(t, [])
        for i, o in zip(pos, torch.split(res.slots, [segs[i].numel() for i in pos])):
            segs[i] = o
    return rebuild(kjt, segs), results
