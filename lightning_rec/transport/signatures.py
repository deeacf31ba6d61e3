"""A collective's identity in one word (operation, dtype, bytes every rank gives), which the shared-memory
transport publishes so that ranks calling different collectives fail loudly instead of reading each other's
bytes; and the dtype an all-to-all of pieces travels in."""

from __future__ import annotations

import torch

# a collective's identity, one word: operation, dtype, and the bytes every rank must give (all-gather and
# all-reduce; 0 for all-to-alls, whose sizes differ by rank and are checked by the receivers). Pieces carry
# no dtype: a rank sending nothing has none to give
_OPS = ("all_to_all", "all_to_all_views", "all_to_all_pieces", "all_gather", "all_reduce_sum")
_DTYPES = (
    None,
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)


def signature(op: str, dtype: torch.dtype | None, nbytes: int = 0) -> int:
    code = _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)
    return (_OPS.index(op) << 56) | (code << 48) | nbytes


def describe(sig: int) -> str:
    """What :func:`signature` encoded, in words."""
    op, code, nbytes = sig >> 56, (sig >> 48) & 0xFF, sig & ((1 << 48) - 1)
    name = _OPS[op] if op < len(_OPS) else f"operation {op}"
    dtype = "" if code == 0 else f" of {_DTYPES[code]}" if code < len(_DTYPES) else " of another dtype"
    return name + dtype + (f", {nbytes} bytes" if nbytes else "")


def pieces_dtype(sends: list[list[torch.Tensor]]) -> torch.dtype:
    """The dtype of an all-to-all of pieces (int64 when this rank sends nothing)."""
    return next((t.dtype for lst in sends for t in lst), torch.int64)
