"""TorchRec's placement descriptions: ``ParameterSharding`` (how one table is placed, as a plan writes it) and
the ``sharding_spec`` classes that list its shards (``EnumerableShardingSpec`` of ``ShardMetadata`` with a
``ShardPlacement``).

Plain values checked on construction; what each sharding type makes of them is ``kinds.py``'s business.
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass

import torch

from lightning_rec.configs import ShardingType

#: the optional fields of ParameterSharding that say where shards go
PLACEMENT_FIELDS = ("ranks", "row_sizes", "col_sizes", "host_indexes")


#: TorchRec's compute kernel names (accepted in plans; the lookup kernel here is chosen by "auto" / "torch" /
#: "fbgemm", and TorchRec's names pick "auto")
COMPUTE_KERNELS = (
    "auto",
    "torch",
    "fbgemm",
    "dense",
    "fused",
    "fused_uvm",
    "fused_uvm_caching",
    "quant",
    "quant_uvm",
    "quant_uvm_caching",
    "key_value",
    "customized_kernel",
)


# -- TorchRec's shard descriptions (torch's ShardMetadata / EnumerableShardingSpec, which live in the deprecated
# "_shard" package of torch.distributed, next to ShardedTensor: the same fields and equality, without it) ---
class ShardPlacement:
    """Where a shard lives, TorchRec's ``"rank:N/device"`` string: ``rank()`` and ``device()`` as torch's
    ``_remote_device`` gives them."""

    __slots__ = ("_device", "_rank")

    def __init__(self, placement: str | ShardPlacement) -> None:
        text = str(placement)
        m = re.fullmatch(r"rank:(\d+)/(.+)", text)
        try:
            device = torch.device(m[2]) if m else None
        except (RuntimeError, TypeError):
            device = None
        if m is None or device is None:
            raise ValueError(f"shard placement {text!r} is not of the form 'rank:N/<device>', e.g. 'rank:1/cuda:1'")
        self._rank, self._device = int(m[1]), device

    def rank(self) -> int:
        return self._rank

    def device(self) -> torch.device:
        return self._device

    def __str__(self) -> str:
        return f"rank:{self._rank}/{self._device}"

    __repr__ = __str__

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            other = ShardPlacement(other)
        return isinstance(other, ShardPlacement) and (self._rank, self._device) == (other._rank, other._device)

    def __hash__(self) -> int:
        return hash((self._rank, self._device))


@dataclass
class ShardMetadata:
    """One shard of a table: ``shard_offsets`` ``[row, column]``, ``shard_sizes`` ``[rows, columns]`` and its
    ``placement`` (a ``"rank:N/device"`` string is parsed into a :class:`ShardPlacement`)."""

    shard_offsets: list[int]
    shard_sizes: list[int]
    placement: ShardPlacement | str | None = None

    def __post_init__(self) -> None:
        self.shard_offsets, self.shard_sizes = [int(x) for x in self.shard_offsets], [int(x) for x in self.shard_sizes]
        if len(self.shard_offsets) != len(self.shard_sizes):
            raise ValueError(f"shard_offsets {self.shard_offsets} and shard_sizes {self.shard_sizes} differ in rank")
        if self.placement is not None:
            self.placement = ShardPlacement(self.placement)


@dataclass
class EnumerableShardingSpec:
    """TorchRec's ``sharding_spec``: the shards of a table, listed."""

    shards: list[ShardMetadata]


@dataclass(eq=False)
class ParameterSharding:
    """How one table is placed.

    Args:
        sharding_type: a ``ShardingType`` (or its string value; a member compares equal to its string).
        ranks: TABLE_WISE: ``[rank]``; COLUMN_WISE / TABLE_COLUMN_WISE: one rank per column shard. For the
            other types the ranks follow from the placement; a resolved plan fills them in (TorchRec's order:
            column shards, then row blocks), and a plan that gives them must give exactly those.
        row_sizes: ROW_WISE only: rows per rank of the group (uneven placement); default even blocks.
        col_sizes: COLUMN_WISE / GRID_SHARD: width of each column shard; default even widths.
        host_indexes: TABLE_ROW_WISE: ``[host]``; GRID_SHARD: one host per column shard.
        compute_kernel: lookup kernel for the local shards: ``"torch"`` or ``"fbgemm"`` as written; ``"auto"``
            (the default) and TorchRec's kernel names follow the collection's own ``kernel`` setting. A fused
            embedding optimizer always uses its fused kernel.
        num_buckets: ROW_WISE only: TorchRec's bucketized row-wise: ``num_buckets`` equal buckets (they must
            divide ``num_embeddings``) spread over the ranks, the first ranks taking one more.
        sharding_spec: TorchRec's description of the shards: torch's ``EnumerableShardingSpec`` of
            ``ShardMetadata`` (offsets, sizes, placement ``"rank:N/cuda:M"`` or ``"rank:N/cpu"``; this module's
            classes, with the fields and equality of torch's), None for a
            data-parallel table. ``construct_module_sharding_plan`` fills it in; a plan that gives one must
            give the shards its other fields resolve to (checked at sharding time).

    Two placements that both carry a ``sharding_spec`` are equal when their type, kernel, ranks and shards
    are: the spec is the resolved layout, whichever fields (``row_sizes``, ``num_buckets``...) produced it.
    """

    sharding_type: ShardingType | str
    ranks: list[int] | None = None
    row_sizes: list[int] | None = None
    col_sizes: list[int] | None = None
    host_indexes: list[int] | None = None
    compute_kernel: str = "auto"
    num_buckets: int | None = None
    sharding_spec: EnumerableShardingSpec | None = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ParameterSharding):
            return NotImplemented
        key: tuple[str, ...] = ("sharding_type", "compute_kernel", "ranks", "sharding_spec")
        if self.sharding_spec is None or other.sharding_spec is None:
            key += (*PLACEMENT_FIELDS, "num_buckets")
        return all(getattr(self, k) == getattr(other, k) for k in key)

    __hash__ = None  # type: ignore[assignment]  # mutable, as a dataclass with eq

    def __post_init__(self) -> None:
        if not isinstance(self.sharding_type, ShardingType):
            try:
                self.sharding_type = ShardingType(str(self.sharding_type).lower())
            except ValueError:
                raise ValueError(
                    f"unknown sharding type {self.sharding_type!r}; choose one of {[s.value for s in ShardingType]}"
                ) from None
        if self.compute_kernel is None:
            self.compute_kernel = "auto"
        if str(self.compute_kernel).lower() not in COMPUTE_KERNELS:
            raise ValueError(f"unknown compute_kernel {self.compute_kernel!r}; choose one of {list(COMPUTE_KERNELS)}")
        self.compute_kernel = str(self.compute_kernel).lower()
        nb = self.num_buckets
        if nb is not None and (isinstance(nb, bool) or not isinstance(nb, numbers.Integral) or nb <= 0):
            raise ValueError(f"num_buckets must be a positive integer, got {nb!r}")
        if nb is not None and self.sharding_type != ShardingType.ROW_WISE:
            raise ValueError(f"num_buckets applies to row_wise only, not {self.sharding_type.value}")
        spec = self.sharding_spec
        if spec is not None and not isinstance(spec, EnumerableShardingSpec):
            raise TypeError(
                f"sharding_spec must be an EnumerableShardingSpec of ShardMetadata (TorchRec's), got "
                f"{type(spec).__name__}"
            )
