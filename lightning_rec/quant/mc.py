"""Managed-collision collections served quantized (TorchRec's ``QuantManagedCollisionEmbeddingBagCollection`` /
``QuantManagedCollisionEmbeddingCollection``).

Each keeps the trained id -> row map of its managed tables and the quantized table: raw ids are remapped, read
only, exactly as the float module remaps them in ``eval()`` (an id that holds a row gets it; any other id its
bucket's fallback row, ``hash(id) % bucket size``), then looked up in the quantized rows. Serving never admits or
evicts an id, in ``train()`` mode too: a new id would need its row re-initialised, and quantized rows are not
trained. The remap is elementwise aten ops over a sorted copy of the map (``searchsorted``, the bucket hash), so it
runs on the tables' device and traces into a ``torch.export`` program.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar, cast

import torch
from torch import nn

from lightning_rec.configs import EmbeddingBagConfig, EmbeddingConfig
from lightning_rec.embedding_modules import EmbeddingBagCollection as FloatEmbeddingBagCollection
from lightning_rec.embedding_modules import EmbeddingCollection as FloatEmbeddingCollection
from lightning_rec.kernels import TableContainer
from lightning_rec.mc import (
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
    MCHManagedCollisionModule,
)
from lightning_rec.mc._remap import bucket_of, splitmix64
from lightning_rec.quant import embedding_modules as quant
from lightning_rec.quant.rows import DEFAULT_ROW_ALIGNMENT
from lightning_rec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor, checks_enabled

_Float = TypeVar("_Float", FloatEmbeddingBagCollection, FloatEmbeddingCollection)
_Quant = TypeVar("_Quant", quant.EmbeddingBagCollection, quant.EmbeddingCollection)


class FrozenMCHModule(nn.Module):
    """One managed table's id -> row map, read only: what an ``MCHManagedCollisionModule`` remaps in ``eval()``.

    State (``state_dict``): ``_mch_raw_ids`` (the raw id each row holds, -1 empty; the float module's buffer of
    that name, so its entries load here) and ``_mch_num_buckets``. The sorted index the lookup searches is derived
    from them, and rebuilt whenever a state_dict is loaded.
    """

    _mch_raw_ids: torch.Tensor
    _mch_num_buckets: torch.Tensor
    _sorted_ids: torch.Tensor
    _sorted_rows: torch.Tensor

    def __init__(self, raw_ids: torch.Tensor, num_buckets: int, name: str) -> None:
        super().__init__()
        self._name = name
        self.register_buffer("_mch_raw_ids", raw_ids.detach().to(torch.int64).clone())
        self.register_buffer("_mch_num_buckets", torch.tensor(int(num_buckets), dtype=torch.int64))
        self.register_buffer("_sorted_ids", torch.zeros(0, dtype=torch.int64), persistent=False)
        self.register_buffer("_sorted_rows", torch.zeros(0, dtype=torch.int64), persistent=False)
        self._num_buckets = int(num_buckets)
        problem = self._rebuild()
        if problem:
            raise ValueError(problem)

    @classmethod
    def from_module(
        cls, m: MCHManagedCollisionModule, table: str, device: torch.device | str | None
    ) -> FrozenMCHModule:
        """The map ``m`` holds now (whatever ``m`` has remapped or loaded), on ``device``."""
        if m.pending_resize():
            raise ValueError(
                f"managed collision table {table!r}: its state was written with {int(m._mch_num_buckets)} buckets but "
                f"the module is set to {m.num_buckets}; run a forward (or resize()) of the float model first, so the "
                "rows move with their ids before they are quantized"
            )
        return cls(m._mch_raw_ids.to(device or "cpu"), int(m._mch_num_buckets), table)

    @property
    def zch_size(self) -> int:
        return self._mch_raw_ids.numel()

    @property
    def num_buckets(self) -> int:
        return self._num_buckets

    def _rebuild(self) -> str | None:
        """Derive the sorted index from the state; a description of what is wrong with the state, or None."""
        raw, nb = self._mch_raw_ids, int(self._mch_num_buckets)
        zch = raw.numel()
        if nb <= 0 or zch % nb:
            return f"managed collision table {self._name!r}: {nb} buckets do not divide its {zch} rows"
        rows = (raw >= 0).nonzero().flatten()
        ids, order = torch.sort(raw[rows])
        rows = rows[order]
        if bool((ids[1:] == ids[:-1]).any()) or bool((bucket_of(ids, nb) != rows // (zch // nb)).any()):
            return (
                f"managed collision table {self._name!r}: inconsistent id -> row map (an id in two rows, or in a row "
                f"outside its bucket for {nb} buckets)"
            )
        self._sorted_ids, self._sorted_rows, self._num_buckets = ids, rows, nb
        return None

    def _load_from_state_dict(  # type: ignore[override]
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # keys of a table "a.b" start with table "a"'s prefix: the container checks unexpected keys
        n = len(unexpected_keys)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        del unexpected_keys[n:]
        problem = self._rebuild()
        if problem:
            error_msgs.append(problem)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The row of each raw id (int64, any shape); nothing changes."""
        ids = ids.to(torch.int64)
        bs = self.zch_size // self._num_buckets
        fallback = bucket_of(ids, self._num_buckets) * bs + splitmix64(ids).remainder(bs)
        n = self._sorted_ids.numel()
        if n == 0:
            return fallback
        pos = torch.searchsorted(self._sorted_ids, ids).clamp(max=n - 1)
        return torch.where(self._sorted_ids[pos] == ids, self._sorted_rows[pos], fallback)

    def extra_repr(self) -> str:
        return f"zch_size={self.zch_size}, num_buckets={self._num_buckets}, ids={self._sorted_ids.numel()}"


class FrozenManagedCollisionCollection(nn.Module):
    """The managed tables' maps (:class:`FrozenMCHModule`, keyed by table name) of a quantized managed-collision
    collection; ``forward(kjt)`` returns the KJT with every managed feature's raw ids replaced by their rows."""

    def __init__(self, mcc: ManagedCollisionCollection, device: torch.device | str | None = None) -> None:
        super().__init__()
        if not isinstance(mcc, ManagedCollisionCollection):
            raise TypeError(f"expected a ManagedCollisionCollection, got {type(mcc).__name__}")
        self._embedding_configs = mcc.embedding_configs()
        self._managed_collision_modules = TableContainer()
        for t, m in mcc.modules_by_table().items():
            self._managed_collision_modules.add(t, FrozenMCHModule.from_module(m, t, device))
        self._tables = list(mcc.modules_by_table())
        self._feature_to_table = {
            f: c.name for c in self._embedding_configs for f in c.feature_names if c.name in self._tables
        }

    def embedding_configs(self) -> list[Any]:
        return list(self._embedding_configs)

    def modules_by_table(self) -> dict[str, FrozenMCHModule]:
        return {t: cast(FrozenMCHModule, self._managed_collision_modules[t]) for t in self._tables}

    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"expected a KeyedJaggedTensor, got {type(features).__name__}")
        keys = features.keys()
        if not any(k in self._feature_to_table for k in keys):
            return features
        values = features.values()
        bounds = features.offset_per_key()
        pieces = []
        for i, k in enumerate(keys):
            seg = values[bounds[i] : bounds[i + 1]]
            t = self._feature_to_table.get(k)
            if t is not None:
                if checks_enabled() and seg.numel() and int(seg.min()) < 0:
                    raise ValueError(
                        f"feature {k!r} (managed collision table {t!r}): raw ids must be non-negative, got "
                        f"{int(seg.min())}"
                    )
                seg = self._managed_collision_modules[t](seg)
            pieces.append(seg.to(torch.int64))
        variable = features.variable_stride_per_key()
        # the same bags: lengths, offsets and per-key sizes carried over (symbolic under torch.export)
        return KeyedJaggedTensor(
            keys,
            torch.cat(pieces),
            weights=features.weights_or_none(),
            lengths=features.lengths(),
            offsets=features.offsets(),
            stride=None if variable else features.stride(),
            stride_per_key_per_rank=features.stride_per_key_per_rank() if variable else None,
            length_per_key=features.length_per_key(),
        )


def _inner(module: nn.Module, wrapper: type, float_type: type[_Float], quant_type: type[_Quant]) -> _Float | _Quant:
    """The collection of managed-collision ``module``: an unsharded float one, or one quantized already
    (``torch.ao.quantization.quantize_dynamic``, TorchRec's way, converts the children before their parent)."""
    if not isinstance(module, wrapper):
        raise TypeError(f"from_float expects a lightning_rec {wrapper.__name__}, got {type(module).__name__}")
    coll = cast(Any, module).embedding_module
    if not isinstance(coll, (float_type, quant_type)) or isinstance(coll, _QuantManagedCollision):
        raise TypeError(
            f"from_float needs the {wrapper.__name__}'s collection unsharded (a {float_type.__name__}), got "
            f"{type(coll).__name__}: quantize the unsharded copy (lightning_rec.export.inference_model) or a "
            "checkpoint directory (lightning_rec.quant.load_quantized)"
        )
    return coll


class _QuantManagedCollision:
    """What both quantized managed-collision collections add to their quantized collection."""

    _managed_collision_collection: FrozenManagedCollisionCollection
    _return_remapped_features: bool

    def _init_mc(
        self,
        mcc: ManagedCollisionCollection | FrozenManagedCollisionCollection,
        return_remapped_features: bool,
        tables: Sequence[Any],
    ) -> None:
        if mcc is None:
            raise ValueError("a quantized managed-collision collection needs managed_collision_collection")
        names = {t.name: t.num_embeddings for t in tables}
        for t, m in mcc.modules_by_table().items():
            if names.get(t) != m.zch_size:
                raise ValueError(
                    f"managed collision table {t!r} ({m.zch_size} rows) is not a table of the collection {names}"
                )
        device = cast(Any, self).device
        frozen = mcc if isinstance(mcc, FrozenManagedCollisionCollection) else FrozenManagedCollisionCollection(mcc)
        self._managed_collision_collection = frozen.to(device)
        self._return_remapped_features = return_remapped_features

    def remap(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``features`` with every managed feature's raw ids replaced by their rows (read only)."""
        return self._managed_collision_collection(features)


class QuantManagedCollisionEmbeddingBagCollection(_QuantManagedCollision, quant.EmbeddingBagCollection):
    """A quantized ``EmbeddingBagCollection`` behind its frozen managed-collision maps (TorchRec's name).

    ``forward(kjt) -> (KeyedTensor, remapped KJT or None)`` as the float ``ManagedCollisionEmbeddingBagCollection``
    in ``eval()`` (the remapped KJT with ``return_remapped_features=True``). Build it with :meth:`from_float` or
    :func:`lightning_rec.quant.quantize_embeddings`; constructed directly, arguments as the quantized
    ``EmbeddingBagCollection`` plus the float ``managed_collision_collection`` whose maps it copies.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: torch.device | str | None = None,
        output_dtype: torch.dtype = torch.float32,
        *,
        managed_collision_collection: ManagedCollisionCollection | FrozenManagedCollisionCollection,
        return_remapped_features: bool = False,
        row_alignment: int | None = DEFAULT_ROW_ALIGNMENT,
        kernel: str = "auto",
        strict_features: bool = False,
    ) -> None:
        super().__init__(
            tables,
            is_weighted,
            device,
            output_dtype,
            row_alignment=row_alignment,
            kernel=kernel,
            strict_features=strict_features,
        )
        self._init_mc(managed_collision_collection, return_remapped_features, tables)

    @classmethod
    def from_float(  # type: ignore[override]
        cls,
        module: ManagedCollisionEmbeddingBagCollection,
        return_remapped_features: bool | None = None,
        use_precomputed_fake_quant: bool = False,
        *,
        dtype: Any = None,
        output_dtype: torch.dtype | None = None,
        per_table_weight_dtype: Mapping[str, Any] | None = None,
        row_alignment: int | None = DEFAULT_ROW_ALIGNMENT,
        kernel: str = "auto",
    ) -> QuantManagedCollisionEmbeddingBagCollection:
        """The quantized copy of a float (unsharded) ``ManagedCollisionEmbeddingBagCollection``: its maps as they
        are now, its table quantized as ``EmbeddingBagCollection.from_float`` would (options alike; the qconfig is
        read from ``module``), or taken as it is where ``torch.ao.quantization.quantize_dynamic`` quantized it
        already. ``return_remapped_features``: None keeps the module's."""
        ebc = _inner(
            module, ManagedCollisionEmbeddingBagCollection, FloatEmbeddingBagCollection, quant.EmbeddingBagCollection
        )
        if isinstance(ebc, quant.EmbeddingBagCollection):
            done = cls(
                ebc.embedding_bag_configs(),
                ebc.is_weighted(),
                ebc.device,
                ebc.output_dtype(),
                managed_collision_collection=_mcc(module),
                return_remapped_features=_remapped(module, return_remapped_features),
                row_alignment=ebc.row_alignment,
                kernel=ebc._lookup.kernel,
                strict_features=ebc._layout.strict,
            )
            done.copy_rows_from(ebc)
            return done
        dtype, out, per_table = quant.from_float_options(module, dtype, output_dtype, per_table_weight_dtype)
        configs = quant.quantized_configs(ebc.embedding_bag_configs(), dtype, per_table)
        q = cls(
            configs,
            ebc.is_weighted(),
            ebc.device,
            out,
            managed_collision_collection=_mcc(module),
            return_remapped_features=_remapped(module, return_remapped_features),
            row_alignment=row_alignment,
            kernel=kernel,
            strict_features=ebc._layout.strict,
        )
        q.quantize_from({t.name: cast(torch.Tensor, ebc.embedding_bags[t.name].weight) for t in configs})
        return q

    def forward(self, features: KeyedJaggedTensor) -> tuple[KeyedTensor, KeyedJaggedTensor | None]:  # type: ignore[override]
        kjt = self.remap(features)
        return super().forward(kjt), (kjt if self._return_remapped_features else None)


class QuantManagedCollisionEmbeddingCollection(_QuantManagedCollision, quant.EmbeddingCollection):
    """A quantized ``EmbeddingCollection`` behind its frozen managed-collision maps (TorchRec's
    ``torchrec.quant.embedding_modules.QuantManagedCollisionEmbeddingCollection``).

    ``forward(kjt) -> ({feature: JaggedTensor}, remapped KJT or None)``; otherwise as
    :class:`QuantManagedCollisionEmbeddingBagCollection`.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        device: torch.device | str | None = None,
        need_indices: bool = False,
        output_dtype: torch.dtype = torch.float32,
        *,
        managed_collision_collection: ManagedCollisionCollection | FrozenManagedCollisionCollection,
        return_remapped_features: bool = False,
        row_alignment: int | None = DEFAULT_ROW_ALIGNMENT,
        kernel: str = "auto",
        strict_features: bool = False,
    ) -> None:
        super().__init__(
            tables,
            device,
            need_indices,
            output_dtype,
            row_alignment=row_alignment,
            kernel=kernel,
            strict_features=strict_features,
        )
        self._init_mc(managed_collision_collection, return_remapped_features, tables)

    @classmethod
    def from_float(  # type: ignore[override]
        cls,
        module: ManagedCollisionEmbeddingCollection,
        return_remapped_features: bool | None = None,
        use_precomputed_fake_quant: bool = False,
        *,
        dtype: Any = None,
        output_dtype: torch.dtype | None = None,
        per_table_weight_dtype: Mapping[str, Any] | None = None,
        row_alignment: int | None = DEFAULT_ROW_ALIGNMENT,
        kernel: str = "auto",
    ) -> QuantManagedCollisionEmbeddingCollection:
        """The quantized copy of a float (unsharded) ``ManagedCollisionEmbeddingCollection``; as the pooled one's."""
        ec = _inner(module, ManagedCollisionEmbeddingCollection, FloatEmbeddingCollection, quant.EmbeddingCollection)
        if isinstance(ec, quant.EmbeddingCollection):
            done = cls(
                ec.embedding_configs(),
                ec.device,
                ec.need_indices(),
                ec.output_dtype(),
                managed_collision_collection=_mcc(module),
                return_remapped_features=_remapped(module, return_remapped_features),
                row_alignment=ec.row_alignment,
                kernel=ec._lookup.kernel,
                strict_features=ec._layout.strict,
            )
            done.copy_rows_from(ec)
            return done
        dtype, out, per_table = quant.from_float_options(module, dtype, output_dtype, per_table_weight_dtype)
        configs = quant.quantized_configs(ec.embedding_configs(), dtype, per_table)
        q = cls(
            configs,
            ec.device,
            ec.need_indices(),
            out,
            managed_collision_collection=_mcc(module),
            return_remapped_features=_remapped(module, return_remapped_features),
            row_alignment=row_alignment,
            kernel=kernel,
            strict_features=ec._layout.strict,
        )
        q.quantize_from({t.name: cast(torch.Tensor, ec.embeddings[t.name].weight) for t in configs})
        return q

    def forward(  # type: ignore[override]
        self, features: KeyedJaggedTensor
    ) -> tuple[dict[str, JaggedTensor], KeyedJaggedTensor | None]:
        kjt = self.remap(features)
        return super().forward(kjt), (kjt if self._return_remapped_features else None)


def _mcc(module: nn.Module) -> ManagedCollisionCollection:
    return cast(ManagedCollisionCollection, module._managed_collision_collection)


def _remapped(module: nn.Module, given: bool | None) -> bool:
    return bool(cast(Any, module)._return_remapped_features) if given is None else bool(given)
