"""What a shard is: the rectangle math of a table's shards, and TorchRec's descriptions of a placement.

The math (:class:`ShardMeta`, :class:`Tiling`, even splits and offsets, DTensor placements) is the one source for
bucketing, local shapes and checkpoint metadata. TorchRec's placement descriptions are plain values checked on
construction: :class:`ParameterSharding` (how one table is placed, as a plan writes it) and the ``sharding_spec``
classes that list its shards (:class:`EnumerableShardingSpec` of :class:`ShardMetadata` with a
:class:`ShardPlacement`); what each sharding type makes of them is ``kinds.py``'s business.

Ranks here are ranks of the model-parallel (shard) group, never global ranks.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lightning_rec.configs import ShardingType


@dataclass(frozen=True)
class ShardMeta:
    """One rectangular piece of a table: rows ``[row_offset, row_offset + rows)``, columns likewise."""

    row_offset: int
    rows: int
    col_offset: int
    cols: int
    rank: int

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """This piece of ``full`` (a view)."""
        return full[self.row_offset : self.row_offset + self.rows, self.col_offset : self.col_offset + self.cols]


def even_blocks(total: int, parts: int) -> np.ndarray:
    """:func:`even_split` as an int64 array (what the planner's vectorized cost model needs)."""
    block = -(-total // parts)
    return np.clip(total - np.arange(parts, dtype=np.int64) * block, 0, block)


def even_split(total: int, parts: int) -> list[int]:
    """Sizes of ``torch.chunk``-style blocks: ``ceil(total / parts)`` each, the tail short or empty.

    >>> even_split(10, 4), even_split(5, 4)
    ([3, 3, 3, 1], [2, 2, 1, 0])
    """
    return even_blocks(total, parts).tolist()


def offsets_of(sizes: list[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


@dataclass(frozen=True, eq=False)
class Tiling:
    """A table cut into ``k`` column blocks, each split into the same ``n`` row blocks.

    Column block ``c`` (``col_sizes[c]`` wide) is split into row blocks ``row_sizes`` on the ranks
    ``owners[c]``. ``rank``, ``rows`` and ``cols`` hold one entry per shard (column block major): the
    planner's cost model reads them; :meth:`shards` gives the ``ShardMeta`` list the sharded modules and
    checkpoints use, so both see the same tiling.
    """

    row_sizes: np.ndarray  # [n]
    col_sizes: np.ndarray  # [k]
    owners: np.ndarray  # [k, n]

    @staticmethod
    def grid(
        row_sizes: Sequence[int] | np.ndarray,
        col_sizes: Sequence[int],
        owners: Sequence[int] | Sequence[Sequence[int]] | np.ndarray,
    ) -> Tiling:
        return Tiling(
            np.asarray(row_sizes, dtype=np.int64),
            np.asarray(col_sizes, dtype=np.int64),
            np.asarray(owners, dtype=np.int64).reshape(len(col_sizes), -1),
        )

    @property
    def col_blocks(self) -> int:
        return len(self.col_sizes)

    @property
    def rank(self) -> np.ndarray:
        return self.owners.reshape(-1)

    @property
    def rows(self) -> np.ndarray:
        return np.tile(self.row_sizes, len(self.col_sizes))

    @property
    def cols(self) -> np.ndarray:
        return np.repeat(self.col_sizes, len(self.row_sizes))

    def shards(self) -> list[ShardMeta]:
        row_offs, col_offs = offsets_of(self.row_sizes.tolist()), offsets_of(self.col_sizes.tolist())
        owners = self.owners.tolist()
        return [
            ShardMeta(
                row_offs[r], row_offs[r + 1] - row_offs[r], col_offs[c], col_offs[c + 1] - col_offs[c], owners[c][r]
            )
            for c in range(len(self.col_sizes))
            for r in range(len(self.row_sizes))
        ]


def block_shards(
    num_rows: int, dim: int, row_sizes_per_col: list[list[int]], col_sizes: list[int], ranks_per_col: list[list[int]]
) -> list[ShardMeta]:
    """Tile a ``[num_rows, dim]`` table: column block ``c`` is split into row blocks on ``ranks_per_col[c]``."""
    shards = []
    col_offs = offsets_of(col_sizes)
    for c, (cols, ranks, row_sizes) in enumerate(zip(col_sizes, ranks_per_col, row_sizes_per_col)):
        row_offs = offsets_of(row_sizes)
        assert row_offs[-1] == num_rows and col_offs[-1] == dim
        for r, rank in enumerate(ranks):
            shards.append(ShardMeta(row_offs[r], row_sizes[r], col_offs[c], cols, rank))
    return shards


def dtensor_placement(shards: Sequence[ShardMeta], num_rows: int, dim: int, group_size: int) -> tuple[str, int] | None:
    """How a table's tiling maps onto DTensor placements over a 1-D mesh of the shard group, if it does.

    ``("owner", rank)``: one shard holds the whole table (table-wise): ``Replicate()`` on a mesh of that rank.
    ``("shard", d)``: shard-group rank ``i`` holds ``torch.chunk``'s block ``i`` along dimension ``d`` (what
    ``Shard(d)`` means; even row-wise and column-wise splits). None: anything else (custom sizes, ranks out of
    order, blocks of one host, grids), described by local pieces with offsets.

    >>> dtensor_placement([ShardMeta(0, 3, 0, 4, 0), ShardMeta(3, 2, 0, 4, 1)], 5, 4, 2)
    ('shard', 0)
    """
    full = [s for s in shards if s.rows > 0 and s.cols > 0]
    if len(full) == 1 and (full[0].rows, full[0].cols) == (num_rows, dim):
        return ("owner", full[0].rank)
    for d, total in ((0, num_rows), (1, dim)):
        sizes = even_split(total, group_size)
        offs = offsets_of(sizes)
        want = {(offs[r], sizes[r], r) for r in range(group_size) if sizes[r] > 0}
        got = {
            ((s.row_offset, s.rows) if d == 0 else (s.col_offset, s.cols)) + (s.rank,)
            for s in full
            if ((s.col_offset, s.cols) if d == 0 else (s.row_offset, s.rows)) == (0, dim if d == 0 else num_rows)
        }
        if len(got) == len(full) and got == want and total > 0:
            return ("shard", d)
    return None


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
