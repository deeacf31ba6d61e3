"""The sparse types' checks and layout arithmetic, apart from the classes: bags' lengths and offsets, strides,
and a KeyedJaggedTensor's key-major layout (the eager constructor's derived and checked fields, the ids per key,
the gathers that reorder keys).

The functions take tensors and lists, never a sparse type, so the classes' TorchScript methods compile them as
free functions and this module needs nothing of the classes.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple, cast

import torch

from lightning_rec._compat import FxProxyableMeta


class SparseMeta(FxProxyableMeta):
    """Metaclass of the sparse types: under ``torch.fx`` tracing, building one from traced tensors records a
    node instead of running the constructor (whose checks would need concrete values)."""


class SparseInputError(ValueError, AssertionError):
    """Bad lengths / offsets. A ValueError here; also an AssertionError, which is what TorchRec raises."""


def checks_enabled() -> bool:
    """Data-dependent checks run eagerly only: under torch.compile / TorchScript they would break the graph;
    and not inside :func:`from_checked`."""
    if torch.jit.is_scripting():
        return False
    return not (torch.compiler.is_compiling() or _from_checked())


@torch.jit.unused
def _from_checked() -> bool:
    return _FROM_CHECKED.on


class _Flag(threading.local):
    on = False


_FROM_CHECKED = _Flag()


@contextlib.contextmanager
def from_checked() -> Iterator[None]:
    """Build sparse types from parts an input check already saw (a permutation of a checked KJT, say): their
    data-dependent checks are skipped, each of which would make a CUDA host wait for its device."""
    before, _FROM_CHECKED.on = _FROM_CHECKED.on, True
    try:
        yield
    finally:
        _FROM_CHECKED.on = before


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """``[0, cumsum(lengths)]`` in the dtype of ``lengths`` (int32 stays int32, as in TorchRec)."""
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0, dtype=lengths.dtype)])


def _check_integer(name: str, t: torch.Tensor, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise SparseInputError(f"{what}: `{name}` must be 1-D, got shape {tuple(t.shape)}")
    # torch.tensor([]) is float32: an empty tensor carries no values to misread
    if t.numel() and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise SparseInputError(f"{what}: `{name}` must hold integers, got dtype {t.dtype}")


def lengths_and_offsets(
    values: torch.Tensor,
    lengths: torch.Tensor | None,
    offsets: torch.Tensor | None,
    what: str,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Both of ``lengths`` / ``offsets`` from whichever was given, checked against ``values`` when eager; and
    the number of entries the bags cover (-1 when not checked: under torch.compile, or on the meta device).

    As in TorchRec, ``values`` (and ``weights``) may run past the last bag: those trailing entries belong to no
    bag (every method reads bags through the offsets; the lookups drop them). Fewer entries than the bags
    cover is an error.
    """
    if lengths is None and offsets is None:
        if values.numel() == 0:  # TorchRec's ``KeyedJaggedTensor([], torch.Tensor())``: nothing to cut
            lengths = torch.zeros(0, dtype=torch.int32, device=values.device)
        else:
            raise SparseInputError(f"{what} needs `lengths` or `offsets`")
    # values on the meta device have shapes only: nothing to check against
    check = checks_enabled() and values.device.type != "meta"
    if isinstance(lengths, torch.Tensor) and lengths.numel() == 0 and lengths.dim() > 1:
        lengths = lengths.reshape(-1)  # TorchRec accepts torch.tensor([[], []])
    if lengths is not None:
        if check:
            _check_integer("lengths", lengths, what)
        if not lengths.numel() and lengths.is_floating_point():
            lengths = lengths.long()
        computed = offsets_from_lengths(lengths)
        if offsets is not None and check:
            _check_integer("offsets", offsets, what)
            if not torch.equal(offsets.long(), computed.long()):
                raise SparseInputError(f"{what}: `offsets` do not match the cumulative sum of `lengths`")
        given = "lengths"
        offsets = computed if offsets is None else offsets
    else:
        assert offsets is not None
        if check:
            _check_integer("offsets", offsets, what)
        if offsets.numel() == 0:  # TorchRec accepts an empty offsets tensor for no bags
            offsets = torch.zeros(
                1, dtype=torch.long if offsets.is_floating_point() else offsets.dtype, device=offsets.device
            )
        given = "offsets"
        lengths = offsets[1:] - offsets[:-1]
    total = -1
    if check:
        # every bound in one read: on a GPU each read would make the host wait for the device
        low = lengths.min().long() if lengths.numel() else torch.zeros((), dtype=torch.long, device=offsets.device)
        first, smallest, total = torch.stack([offsets[0].long(), low, offsets[-1].long()]).tolist()
        if first != 0:
            raise SparseInputError(f"{what}: `offsets` must start with 0 and have one more entry than bags")
        if smallest < 0:
            if given == "lengths":
                raise SparseInputError(f"{what}: `lengths` must be non-negative, got min {smallest}")
            raise SparseInputError(f"{what}: `offsets` must be non-decreasing")
        if total > values.size(0):
            raise SparseInputError(f"{what}: lengths sum to {total} but `values` has only {values.size(0)} entries")
        if weights is not None and total > weights.size(0):
            raise SparseInputError(f"{what}: lengths sum to {total} but `weights` has only {weights.size(0)} entries")
    return lengths, offsets, total


def script_lengths_and_offsets(
    lengths: torch.Tensor | None, offsets: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lengths_and_offsets`` under TorchScript: the arithmetic only (no checks, as in TorchRec)."""
    if lengths is None:
        if offsets is None:
            raise ValueError("needs `lengths` or `offsets`")
        return offsets[1:] - offsets[:-1], offsets
    if offsets is None:
        return lengths, offsets_from_lengths(lengths)
    return lengths, offsets


def segment_gather_index(starts: torch.Tensor, lens: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Index that concatenates segments ``[starts[i], starts[i] + lens[i])`` in order, without a loop."""
    if total is None:
        total = int(lens.sum()) if lens.numel() else 0
    # no branch on ``total``: under torch.compile it is a symbolic size (an empty result needs none)
    out_starts = torch.cumsum(lens, 0) - lens
    shift = torch.repeat_interleave(starts - out_starts, lens, output_size=total)
    return torch.arange(total, device=starts.device) + shift


def cumsum_list(xs: list[int]) -> list[int]:
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


def check_no_trailing(t: Any, what: str) -> None:  # a KeyedJaggedTensor or a JaggedTensor
    # TorchRec concatenates the raw values, so entries past one input's last bag would shift the next input's
    # bags: a silently different batch. Refused here.
    if t.values().is_meta:
        return  # shapes only
    covered = int(t.offsets()[-1]) if t.offsets().numel() else 0
    w = t.weights_or_none()
    if t.values().size(0) != covered or (w is not None and w.size(0) != covered):
        raise SparseInputError(
            f"{what}: an input has values / weights past its last bag ({t.values().size(0)} values, "
            f"{None if w is None else w.size(0)} weights, lengths cover {covered}); concatenating would shift "
            "the next input's bags"
        )


def script_strides(
    keys: list[str], n_bags: int, stride: int | None, stride_per_key_per_rank: list[list[int]] | None
) -> tuple[int, list[list[int]], list[int]]:
    """The constructor's stride arithmetic under TorchScript: ``(stride, per key per rank, per key)``."""
    if stride_per_key_per_rank is not None:
        spk = [sum(r) for r in stride_per_key_per_rank]
        if stride is None:
            stride = max(spk) if len(spk) > 0 else 0
        return stride, stride_per_key_per_rank, spk
    if len(keys) == 0:
        no_ranks: list[list[int]] = []
        no_keys: list[int] = []
        return 0 if stride is None else stride, no_ranks, no_keys
    inferred = n_bags // len(keys)
    return inferred, [[inferred] for _ in keys], [inferred for _ in keys]


def eager_strides(
    keys: list[str], n_bags: int, stride: int | None, stride_per_key_per_rank: Any, check: bool
) -> tuple[int, list[list[int]], list[int]]:
    """The KJT constructor's ``(stride, stride per key per rank, stride per key)``, checked when ``check``."""
    if stride_per_key_per_rank is not None:
        spkpr = [[int(s) for s in r] for r in stride_per_key_per_rank]
        spk = [sum(r) for r in spkpr]
        if check and (len(spk) != len(keys) or sum(spk) != n_bags):
            raise SparseInputError(
                f"KeyedJaggedTensor: stride_per_key_per_rank gives {spk} bags per key for keys {keys}, "
                f"but lengths has {n_bags} bags"
            )
        return (stride if stride is not None else (max(spk) if spk else 0)), spkpr, spk
    if keys:
        inferred = n_bags // len(keys)
        if check and n_bags % len(keys):
            raise SparseInputError(
                f"KeyedJaggedTensor: {n_bags} lengths cannot be split evenly over {len(keys)} keys; "
                "for a batch size per feature pass stride_per_key_per_rank"
            )
        if check and stride is not None and stride != inferred:
            raise SparseInputError(
                f"KeyedJaggedTensor: stride={stride} but {n_bags} lengths over {len(keys)} keys "
                f"give a batch size of {inferred}"
            )
        return inferred, [[inferred] for _ in keys], [inferred] * len(keys)
    if check and n_bags:
        raise SparseInputError("KeyedJaggedTensor with no keys must have no lengths")
    return stride or 0, [], []


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
