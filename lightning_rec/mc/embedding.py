"""Embedding collections behind managed collision: raw ids in, remapped rows looked up (TorchRec's MC-EBC / MC-EC).

The same wrapper runs unsharded and sharded. Sharded, it remaps on the owners: it installs a permanent stage hook
on its collection (``pipeline.stages.RawIdHook``, :class:`_RemapOnOwner`, carried over by ``shard_modules``), so
the collection's own input dist routes each raw id to the rank owning its bucket's rows, and that rank remaps it
when the forward takes the delivery (``_dist.remap_received``): no exchange beyond the lookup's, and the step's
remap runs inside the forward of its batch even when a train pipeline started the input dist a batch early.
Only when the remapped ids must come back (``return_remapped_features=True``, ``remap()``) is remapping a
separate exchange before the lookup (``_dist.remap_sharded``); that path cannot start its input dist early.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any, cast

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from lightning_rec import _compat
from lightning_rec.configs import BaseEmbeddingConfig
from lightning_rec.embedding_modules import EmbeddingBagCollection, EmbeddingCollection, FeatureLayout
from lightning_rec.mc import _dist, _remap
from lightning_rec.mc.modules import ManagedCollisionCollection, MCHManagedCollisionModule, remap_local
from lightning_rec.pipeline.input_dist import Received
from lightning_rec.pipeline.sharded_collection import ShardedCollection
from lightning_rec.pipeline.stages import RAW_ID_HOOK_ATTR
from lightning_rec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor

RowInit = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_WRAPPERS: weakref.WeakSet = weakref.WeakSet()
_STEP_HOOK: list[RemovableHandle] = []  # torch's global optimizer step pre-hook, added with the first wrapper
_STEP_HOOK_LOCK = threading.Lock()


class _ManagedCollisionWrapper(nn.Module):
    _attr = ""

    def __init__(
        self,
        embedding_module: nn.Module,
        managed_collision_collection: ManagedCollisionCollection,
        return_remapped_features: bool = False,
        row_init: str | RowInit | None = "uniform",
        seed: int = 0,
    ) -> None:
        super().__init__()
        # nn.Module.__getattr__ hides the type of a collection's (sharded or not) layout
        configs = {c.name: c for c in cast(FeatureLayout, embedding_module._layout).tables}
        for t, m in managed_collision_collection.modules_by_table().items():
            if t not in configs or configs[t].num_embeddings != m.zch_size:
                raise ValueError(
                    f"managed collision table {t!r} is not a table of the embedding module with {m.zch_size} rows"
                )
        if not (row_init in ("uniform", "zeros", None) or callable(row_init)):
            raise ValueError(f"row_init must be 'uniform', 'zeros', None or a callable, got {row_init!r}")
        self._embedding_module = embedding_module
        self._managed_collision_collection = managed_collision_collection
        self._return_remapped_features = return_remapped_features
        self._row_init = row_init
        self._seed = int(seed)
        self._table_seeds: dict[str, int] = {}
        self._configs = configs
        self._optimizers: list[weakref.ref] = []
        self._owner_cache: dict[tuple, _dist.Ownership] = {}
        self._hook = _RemapOnOwner(self)
        self._fold = True
        self._sync_hook()
        with _STEP_HOOK_LOCK:  # global: a process without managed tables keeps every optimizer step free of it
            _WRAPPERS.add(self)
            if not _STEP_HOOK:
                _STEP_HOOK.append(register_optimizer_step_pre_hook(_auto_register))

    @property
    def _fold_remap(self) -> bool:
        """Sharded: remap on the owners at the collection's input dist delivery (no extra all-to-all); False
        keeps the separate remap exchange (benchmarks compare the two). Changing it installs or removes the hook."""
        return self._fold

    @_fold_remap.setter
    def _fold_remap(self, fold: bool) -> None:
        self._fold = bool(fold)
        self._sync_hook()

    def _sync_hook(self) -> None:
        """Install the stage hook on the collection where it remaps on the owners, else remove it. An unsharded
        collection only carries it (and ignores it) for ``shard_modules`` to hand to its sharded twin."""
        hook = self._hook if self._fold and not self._return_remapped_features else None
        coll = self._embedding_module
        if isinstance(coll, ShardedCollection):
            coll.set_raw_id_hook(hook)
        else:
            setattr(coll, RAW_ID_HOOK_ATTR, hook)

    @property
    def supports_input_pipelining(self) -> bool:
        """Whether a train pipeline may start this module's input dist a batch early: yes where the collection is
        unsharded (it has none) or remaps on the owners at delivery; no where remapping is a separate exchange
        before the lookup (``return_remapped_features=True``), which reads state the previous batch changes."""
        coll = self._embedding_module
        return not isinstance(coll, ShardedCollection) or coll.raw_id_hook is self._hook

    @property
    def embedding_module(self) -> nn.Module:
        """The wrapped collection (sharded after ``shard_modules``); plans name it ``<path>._embedding_module``."""
        return self._embedding_module

    # -- optimizer state ----------------------------------------------------------------------------
    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Reset / migrate this optimizer's per-row state with the rows (done automatically at its first step)."""
        if not any(r() is optimizer for r in self._optimizers):
            self._optimizers.append(weakref.ref(optimizer))

    def _table_weights(self, only: str | None = None) -> dict[str, tuple[torch.Tensor, int]]:
        """``{table: (local weight, global row of its first row)}`` for the managed tables held here (or ``only``)."""
        coll = self._embedding_module
        sharded = isinstance(coll, ShardedCollection)
        tables = getattr(coll, cast(ShardedCollection, coll).table_attr if sharded else self._attr)
        # first global row of each table this rank holds rows of (one pass over the local shards)
        offsets: dict[str, int] = {}
        if sharded:
            names = [t.name for t in cast(ShardedCollection, coll).tables]
            for ti, s in cast(ShardedCollection, coll).local_shards:
                if s.rows > 0:
                    offsets.setdefault(names[ti], s.row_offset)
        out = {}
        for t in [only] if only is not None else self._managed_collision_collection.modules_by_table():
            offset = offsets.get(t) if sharded else 0
            if offset is not None:
                out[t] = (tables[t].weight, offset)
        return out

    def _state_tensors(self, table: str, weight: torch.Tensor, fused: dict | None = None) -> list[torch.Tensor]:
        """Per-row optimizer state of ``table``: registered torch optimizers and fused kernels.

        ``fused``: ``_fused_states()`` when the caller already read it (once per step).
        """
        found = []
        for ref in self._optimizers:
            opt = ref()
            if opt is None:
                continue
            for v in opt.state.get(weight, {}).values():
                if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == weight.shape[0]:
                    found.append(v)
        if fused is None:
            fused = self._fused_states()
        found += fused.get(table, [])
        return found

    def _fused_states(self) -> dict[str, list[torch.Tensor]]:
        """``{table: fused kernels' per-row state tensors}`` (views of the live state)."""
        coll = self._embedding_module
        out: dict[str, list[torch.Tensor]] = {}
        if isinstance(coll, ShardedCollection):
            for k in coll.fused_kernels():
                for t, st in k.optimizer_states().items():
                    out.setdefault(t, []).extend(st.values())
        return out

    def _reinit_all(self, results: dict[str, _remap.StepResult]) -> None:
        """Re-initialise the rows new ids took in every table (weights and optimizer state), one pass per step."""
        admitted = {t: r for t, r in results.items() if r.admitted_slots.numel()}
        if not admitted:
            return
        held = self._table_weights()
        fused = self._fused_states()
        admitted = {t: r for t, r in admitted.items() if t in held}
        values = self._uniform_values(admitted) if self._row_init == "uniform" else {}
        for t, r in admitted.items():
            self._reinit_rows(t, r.admitted_slots, r.admitted_ids, held[t], fused, values.get(t))

    def _uniform_values(self, admitted: dict[str, _remap.StepResult]) -> dict[str, torch.Tensor]:
        """``_reinit_values`` of every table's admitted ids, one hash pass per embedding width."""
        by_dim: dict[int, list[str]] = {}
        for t in admitted:
            by_dim.setdefault(self._configs[t].embedding_dim, []).append(t)
        out: dict[str, torch.Tensor] = {}
        for dim, tables in by_dim.items():
            n = torch.tensor([admitted[t].admitted_ids.numel() for t in tables])
            cfgs = [self._configs[t] for t in tables]

            def per_row(xs: Sequence[float | None], dtype: torch.dtype, n: torch.Tensor = n) -> torch.Tensor:
                return torch.repeat_interleave(torch.tensor(xs, dtype=dtype), n)

            lows, highs = [c.weight_init_min for c in cfgs], [c.weight_init_max for c in cfgs]
            one_range = len(set(lows)) == 1 and len(set(highs)) == 1  # scalars: cheaper than per-row tensors
            vals = _remap.hashed_uniform_rows(
                torch.cat([admitted[t].admitted_ids for t in tables]),
                dim,
                per_row([self._table_seed(t) for t in tables], torch.int64),
                # the configs' __post_init__ fills in the default bounds
                cast(float, lows[0]) if one_range else per_row(lows, torch.float64),
                cast(float, highs[0]) if one_range else per_row(highs, torch.float64),
            )
            out.update(zip(tables, torch.split(vals, n.tolist())))
        return out

    def _reinit_rows(
        self,
        table: str,
        rows: torch.Tensor,
        ids: torch.Tensor,
        held: tuple[torch.Tensor, int] | None = None,
        fused: dict | None = None,
        values: torch.Tensor | None = None,
    ) -> None:
        if rows.numel() == 0:
            return
        if held is None:
            held = self._table_weights(table).get(table)
            if held is None:
                return
        weight, offset = held
        local = (rows - offset).to(weight.device)
        with torch.no_grad():
            cfg = self._configs[table]
            if self._row_init == "uniform":
                if values is None:
                    values = self._reinit_values(table, ids, cfg)
                weight[local] = values.to(weight.device, weight.dtype)
            elif self._row_init == "zeros":
                weight[local] = 0
            elif callable(self._row_init):
                weight[local] = self._row_init(weight[local], ids).to(weight.device, weight.dtype)
            for v in self._state_tensors(table, weight, fused):
                v[local] = 0
            # a gradient kept from an earlier micro-batch (accumulation) belongs to the id that left the row
            _drop_kept_gradient(weight, local)
            if isinstance(self._embedding_module, ShardedCollection):
                for k in self._embedding_module.fused_kernels():
                    if table in k.table_names:
                        k.drop_kept_rows(table, local)

    def _reinit_values(self, table: str, ids: torch.Tensor, cfg: BaseEmbeddingConfig) -> torch.Tensor:
        # a pure function of (seed, table, id): every rank and layout re-initialises a row identically (the
        # configs' __post_init__ fills in the default bounds)
        return _remap.hashed_uniform(
            ids,
            cfg.embedding_dim,
            self._table_seed(table),
            cast(float, cfg.weight_init_min),
            cast(float, cfg.weight_init_max),
        )

    def _table_seed(self, table: str) -> int:
        seed = self._table_seeds.get(table)
        if seed is None:
            seed = int(_remap.splitmix64(torch.tensor([self._seed])).item()) ^ hash_name(table)
            self._table_seeds[table] = seed
        return seed

    def _move_rows(self, table: str, src: torch.Tensor, dst: torch.Tensor) -> None:
        if src.numel() == 0:
            return
        held = self._table_weights(table).get(table)
        if held is None:
            return
        weight, offset = held
        s, d = (src - offset).to(weight.device), (dst - offset).to(weight.device)
        with torch.no_grad():
            for v in [weight, *self._state_tensors(table, weight)]:
                v[d] = v[s].clone()

    # -- remapping ----------------------------------------------------------------------------------
    def _prepare(self) -> dict[str, _dist.Ownership] | None:
        coll = self._embedding_module
        owners = None
        if isinstance(coll, ShardedCollection):
            mods = self._managed_collision_collection.modules_by_table()
            owners = {}
            for t, m in mods.items():
                # O(table) to build: once per (collection, bucket counts), not per step
                key = (id(coll), t, int(m._mch_num_buckets), m.num_buckets)
                if key not in self._owner_cache:
                    self._owner_cache = {k: v for k, v in self._owner_cache.items() if k[:2] != key[:2]}
                    self._owner_cache[key] = _dist.ownership(coll, t, m)
                owners[t] = self._owner_cache[key]
        for t, m in self._managed_collision_collection.modules_by_table().items():
            m.prepare(
                None if owners is None else owners[t].owned_rows,
                None if owners is None else cast(ShardedCollection, coll).shard_group,
            )
            if m.pending_resize():
                self._resize_table(t, m, m.num_buckets, owners)
        return owners

    def _resize_table(
        self, t: str, m: MCHManagedCollisionModule, num_buckets: int, owners: dict[str, _dist.Ownership] | None
    ) -> int:
        if owners is not None:
            _dist.check_alignment(cast(ShardedCollection, self._embedding_module), t, m.zch_size, num_buckets)
        src, dst, evicted = m.resize_plan(num_buckets)
        moving = src != dst
        self._move_rows(t, src[moving], dst[moving])
        return evicted

    def resize(self, num_buckets: int | Mapping[str, int]) -> dict[str, int]:
        """Change managed tables' bucket counts; ids, rows and optimizer state move with the ids.

        ``num_buckets``: one count for every managed table, or ``{table: count}`` (tables left out keep
        theirs). A count must divide its table and be a multiple or divisor of the current count. Returns
        ``{table: ids evicted}`` (only a split can evict: a half-bucket with more ids than rows keeps the
        ones its policy ranks first). Sharded: every rank calls it (no communication is needed, since a new
        bucket's rows lie on the rank that owned the old rows); shard boundaries must fall on new buckets.
        """
        mods = self._managed_collision_collection.modules_by_table()
        if isinstance(num_buckets, Mapping):
            unknown = sorted(set(num_buckets) - set(mods))
            if unknown:
                raise ValueError(f"resize: tables {unknown} are not managed tables of this module ({sorted(mods)})")
            counts = {t: int(n) for t, n in num_buckets.items()}
        else:
            counts = dict.fromkeys(mods, int(num_buckets))
        owners = self._prepare()
        for t, n in counts.items():
            m = mods[t]
            m.check_num_buckets(n, int(m._mch_num_buckets))
            if owners is not None:
                _dist.check_alignment(cast(ShardedCollection, self._embedding_module), t, m.zch_size, n)
        return {t: self._resize_table(t, mods[t], n, owners) for t, n in counts.items()}

    def scaled_num_buckets(self, factor: float, skip_unfit: bool = False) -> dict[str, int]:
        """``{table: current bucket count x factor}`` (e.g. 2 or 0.5) for ``resize``.

        Raises where the product is not a bucket count the table takes (a whole divisor of its rows); with
        ``skip_unfit=True`` such tables are left out instead (they keep their count).
        """
        f = Fraction(factor).limit_denominator(1 << 20)
        if f <= 0:
            raise ValueError(f"resize factor must be positive, got {factor}")
        out = {}
        for t, m in self._managed_collision_collection.modules_by_table().items():
            n = m.num_buckets * f
            try:
                if n.denominator != 1:
                    raise ValueError(
                        f"managed collision table {t!r}: {m.num_buckets} buckets x {factor} is not a whole bucket count"
                    )
                m.check_num_buckets(int(n), m.num_buckets)
            except ValueError:
                if skip_unfit:
                    continue
                raise
            out[t] = int(n)
        return out

    def remap(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """Remap ``features`` (advancing the step, admitting and evicting ids); collective when sharded."""
        owners = self._prepare()
        if owners is None:
            kjt, results = remap_local(self._managed_collision_collection, features)
        else:
            kjt, results = _dist.remap_sharded(
                self._managed_collision_collection, features, cast(ShardedCollection, self._embedding_module), owners
            )
        self._reinit_all(results)
        return kjt

    def _lookup(self, features: KeyedJaggedTensor) -> tuple[Any, KeyedJaggedTensor | None]:
        """The embedding module's output for raw ``features``, and the remapped KJT when it is asked for.

        Sharded, without ``return_remapped_features``: the collection's input dist routes the raw ids to the
        owners of their buckets, and the stage hook remaps them there when the lookup takes them
        (:meth:`_remap_received`): the remapped ids never travel back, and nothing here runs before the input
        dist, which a train pipeline may have started a batch ago.
        """
        coll = self._embedding_module
        if not (isinstance(coll, ShardedCollection) and self._fold and not self._return_remapped_features):
            kjt = self.remap(features)
            return self._embedding_module(kjt), (kjt if self._return_remapped_features else None)
        if coll.raw_id_hook is not self._hook:  # a collection that was not sharded from the one we marked
            coll.set_raw_id_hook(self._hook)
        return coll(features), None

    def _remap_received(self, recv: Received) -> Received:
        """The stage hook's remap, on every rank of the shard group when the forward takes its input dist's
        delivery: the step's bookkeeping first (owners, a migration to a loaded bucket count, the step counter),
        then the remap of the ids this rank received and the re-initialisation of the rows new ids took. All of it
        here, at delivery, so it follows the previous batch's remap and optimizer step however early the ids left.
        """
        coll = cast(ShardedCollection, self._embedding_module)
        self._prepare()
        recv, results = _dist.remap_received(coll, self._managed_collision_collection.modules_by_table(), recv)
        self._reinit_all(results)
        return recv

    def mc_stats(self) -> dict[str, dict[str, int]]:
        """Last step's ``{table: {lookups, hits, admitted, evicted, unadmitted}}`` (this rank's buckets)."""
        return {t: dict(m.last_stats) for t, m in self._managed_collision_collection.modules_by_table().items()}


class _RemapOnOwner:
    """A wrapper's stage hook on its sharded collection (``pipeline.stages.RawIdHook``): the managed tables take
    raw ids, routed to their bucket's owner, and remapped there at delivery (``wrapper._remap_received``)."""

    def __init__(self, wrapper: _ManagedCollisionWrapper) -> None:
        self._wrapper = wrapper
        self.tables = frozenset(wrapper._managed_collision_collection.modules_by_table())

    def attach(self, collection: nn.Module) -> None:
        # at sharding: a layout that cannot give each bucket one owner fails here, not at the first step
        for t in sorted(self.tables):
            _dist.row_shards(cast(ShardedCollection, collection), t)

    def row_key(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        return _dist.bucket_rows(self._wrapper._managed_collision_collection.modules_by_table()[table], ids)

    def on_received(self, received: Received) -> Received:
        return self._wrapper._remap_received(received)


def hash_name(name: str) -> int:
    """A stable 62-bit hash of a table name (Python's ``hash`` differs between processes)."""
    h = 1469598103934665603
    for b in name.encode():
        h = ((h ^ b) * 1099511628211) & ((1 << 62) - 1)
    return h


class ManagedCollisionEmbeddingBagCollection(_ManagedCollisionWrapper):
    """An ``EmbeddingBagCollection`` fed through a ``ManagedCollisionCollection`` (TorchRec's MC-EBC).

    ``forward(kjt)`` takes raw int64 ids and returns ``(KeyedTensor, remapped KJT or None)``; the remapped
    KJT is returned with ``return_remapped_features=True``. A row taken by a new id is re-initialised
    (``row_init``: ``"uniform"`` in the table's init range, a pure function of the id so every layout
    agrees; ``"zeros"``; ``None`` keeps the old values; or ``callable(rows, ids) -> rows``) and its optimizer
    state reset: fused kernels' state always, a torch optimizer's per-row state once it is registered
    (automatically at its first ``step``). State that is not per row (Adam's ``step``) is left alone.
    Shard it with ``shard_modules`` / the strategy like any model: the inner collection is sharded
    (table-wise or row-wise) and remapping follows it.
    """

    _attr = "embedding_bags"

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        managed_collision_collection: ManagedCollisionCollection,
        return_remapped_features: bool = False,
        row_init: str | RowInit | None = "uniform",
        seed: int = 0,
    ) -> None:
        super().__init__(
            embedding_bag_collection, managed_collision_collection, return_remapped_features, row_init, seed
        )

    def forward(self, features: KeyedJaggedTensor) -> tuple[KeyedTensor, KeyedJaggedTensor | None]:
        return self._lookup(features)


class ManagedCollisionEmbeddingCollection(_ManagedCollisionWrapper):
    """An ``EmbeddingCollection`` fed through a ``ManagedCollisionCollection`` (TorchRec's MC-EC).

    ``forward(kjt)`` returns ``({feature: JaggedTensor}, remapped KJT or None)``; otherwise as
    ``ManagedCollisionEmbeddingBagCollection``.
    """

    _attr = "embeddings"

    def __init__(
        self,
        embedding_collection: EmbeddingCollection,
        managed_collision_collection: ManagedCollisionCollection,
        return_remapped_features: bool = False,
        row_init: str | RowInit | None = "uniform",
        seed: int = 0,
    ) -> None:
        super().__init__(embedding_collection, managed_collision_collection, return_remapped_features, row_init, seed)

    def forward(self, features: KeyedJaggedTensor) -> tuple[dict[str, JaggedTensor], KeyedJaggedTensor | None]:
        return self._lookup(features)


def _drop_kept_gradient(weight: torch.Tensor, rows: torch.Tensor) -> None:
    """Forget ``rows`` of ``weight``'s accumulated gradient (dense or sparse)."""
    grad = weight.grad
    if grad is None:
        return
    if not grad.is_sparse:
        grad[rows] = 0
        return
    ids, values = _compat.sparse_rows(grad)
    keep = ~torch.isin(ids, rows)
    if not bool(keep.all()):
        weight.grad = torch.sparse_coo_tensor(ids[keep].unsqueeze(0), values[keep], grad.shape)


def _auto_register(optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    # an optimizer stepping a managed table's weights must see its per-row state reset on eviction
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for w in list(_WRAPPERS):
        if any(id(weight) in params for weight, _ in w._table_weights().values()):
            w.register_optimizer(optimizer)
