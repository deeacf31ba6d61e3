"""A KeyedJaggedTensor's key-major layout arithmetic, apart from the class: the eager constructor's derived
and checked fields, the ids per key, and the gathers that reorder keys.

Functions of tensors and lists only (no KeyedJaggedTensor in their signatures), so the class's TorchScript
methods compile them as free functions and this module needs nothing of the class.
"""

import itertools
from typing import NamedTuple, cast

import torch

from lightning_rec.sparse._utils import (
    SparseInputError,
    checks_enabled,
    eager_strides,
    lengths_and_offsets,
    segment_gather_index,
)


class EagerFields(NamedTuple):
    """The fields an eagerly built KeyedJaggedTensor stores, derived from its constructor's arguments."""

    keys: list[str]
    lengths: torch.Tensor
    offsets: torch.Tensor
    stride: int
    stride_per_key_per_rank: list[list[int]]
    stride_per_key: list[int]
    length_per_key: list[int] | None


def _as_int(x: object) -> int | torch.SymInt:
    return x if isinstance(x, torch.SymInt) else int(x)  # type: ignore[call-overload]


def eager_fields(
    keys: list[str],
    values: torch.Tensor,
    weights: torch.Tensor | None,
    lengths: torch.Tensor | None,
    offsets: torch.Tensor | None,
    stride: int | None,
    stride_per_key_per_rank: list[list[int]] | None,
    length_per_key: list[int] | None,
    offset_per_key: list[int] | None,
) -> EagerFields:
    """The constructor's fields outside TorchScript, checked against each other where checks are on."""
    keys = list(keys)
    check = checks_enabled()
    if check:
        for k in keys:
            if not isinstance(k, str):
                raise TypeError(f"KeyedJaggedTensor keys must be strings, got {k!r}")
        if not isinstance(values, torch.Tensor) or values.dim() < 1:
            raise ValueError("KeyedJaggedTensor `values` must be a tensor with at least one dimension")
    lengths, offsets, covered = lengths_and_offsets(values, lengths, offsets, "KeyedJaggedTensor", weights)
    stride, spkpr, spk = eager_strides(keys, lengths.numel(), stride, stride_per_key_per_rank, check)
    lpk: list[int] | None = None
    # symbolic sizes (torch.export, torch.compile) stay symbols: int() would guard on a data-dependent value
    if length_per_key is not None:
        # a SymInt stands in for an int while tracing
        lpk = cast("list[int]", [_as_int(x) for x in length_per_key])
    elif offset_per_key is not None:
        lpk = cast("list[int]", [_as_int(b - a) for a, b in itertools.pairwise(offset_per_key)])
    if check and lpk is not None and (len(lpk) != len(keys) or (covered >= 0 and sum(lpk) != covered)):
        raise SparseInputError(
            f"KeyedJaggedTensor: length_per_key {lpk} does not split the {covered} "
            f"values the lengths cover over keys {keys}"
        )
    return EagerFields(keys, lengths, offsets, stride, spkpr, spk, lpk)


def ids_per_key(
    n_keys: int,
    values: torch.Tensor,
    lengths: torch.Tensor,
    offsets: torch.Tensor,
    stride: int,
    variable_stride: bool,
    lengths_offset_per_key: list[int],
) -> list[int]:
    """Number of ids of each key: one device sync (none on the meta device)."""
    if n_keys == 0:
        no_keys: list[int] = []
        return no_keys
    if values.is_meta:
        # shapes only, no lengths to read: TorchRec's placeholder split of the values over the keys
        lpk = [values.size(0) // n_keys] * n_keys
        lpk[0] += values.size(0) % n_keys
        return lpk
    if not variable_stride:
        return torch.jit.annotate(list[int], lengths.view(n_keys, stride).sum(1).tolist())
    bounds = offsets[lengths_offset_per_key]
    return torch.jit.annotate(list[int], (bounds[1:] - bounds[:-1]).tolist())


def permutation(
    indices: list[int],
    offset_per_key: list[int],
    length_per_key: list[int],
    lengths: torch.Tensor,
    stride: int,
    stride_per_key: list[int],
    lengths_offset_per_key: list[int],
    variable_stride: bool,
) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Keys ``indices`` (reordered or repeated): ``(gather index of their values, their ids per key, their bag
    lengths)``, key-major."""
    n = len(stride_per_key)
    for i in indices:
        if i < 0 or i >= n:
            raise ValueError("permute index out of range for " + str(n) + " keys")
    dev = lengths.device
    new_lpk = [length_per_key[i] for i in indices]
    gather = segment_gather_index(
        torch.tensor([offset_per_key[i] for i in indices], dtype=torch.long, device=dev),
        torch.tensor(new_lpk, dtype=torch.long, device=dev),
        total=sum(new_lpk),
    )
    if variable_stride:
        bag_gather = segment_gather_index(
            torch.tensor([lengths_offset_per_key[i] for i in indices], dtype=torch.long, device=dev),
            torch.tensor([stride_per_key[i] for i in indices], dtype=torch.long, device=dev),
            total=sum([stride_per_key[i] for i in indices]),
        )
        return gather, new_lpk, lengths[bag_gather]
    if n > 0:
        idx = torch.tensor(indices, dtype=torch.long, device=dev)
        return gather, new_lpk, lengths.view(n, stride)[idx].reshape(-1)
    return gather, new_lpk, lengths
