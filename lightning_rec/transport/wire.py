"""The transport's wire format: how a collective and its pieces are described, and how tensors are copied
into and out of byte buffers.

A collective's identity is one word (operation, dtype, bytes every rank gives), which the shared-memory
transport publishes so that ranks calling different collectives fail loudly instead of reading each other's
bytes; an all-to-all of pieces travels in one dtype. A tensor of any layout (a strided view into a larger
tensor included) goes into a byte range in row-major order with one copy, and comes out of one the same way,
so that the transport needs no contiguous intermediate on either side.
"""

from __future__ import annotations

import itertools
import math

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


def write_back_to_back(out: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """The byte tensors ``parts``, one after the other, into ``out``."""
    into = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    flat, at = as_bytes(into), 0
    for part in parts:
        flat[at : at + part.numel()].copy_(part)
        at += part.numel()
    if into is not out:
        out.copy_(into)


def nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


def put(dst: torch.Tensor, t: torch.Tensor) -> None:
    """The elements of ``t`` (any layout), in row-major order, into the byte tensor ``dst``."""
    if t.is_contiguous() or dst.storage_offset() % t.element_size():
        dst.copy_(as_bytes(t))
    else:  # one strided copy straight into place
        dst.view(t.dtype).view(t.shape).copy_(t)


def put_all(dst: torch.Tensor, ts: list[torch.Tensor]) -> None:
    """The elements of every tensor of ``ts`` (any layout), one tensor after the other, into the byte tensor
    ``dst``: each copied once, straight into its place."""
    at = 0
    for t in ts:
        n = nbytes(t)
        put(dst[at : at + n], t)
        at += n


def spanning(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """A 1-D byte view of the tensors when they already lie back to back in one storage (contiguous, each
    starting where the one before ends: pieces ``torch.split`` cut from one buffer), else None."""
    ts = [t for t in ts if t.numel()]
    if not ts or not all(t.is_contiguous() and t.device == ts[0].device for t in ts):
        return None
    storage = ts[0].untyped_storage().data_ptr()
    for a, b in itertools.pairwise(ts):
        if b.untyped_storage().data_ptr() != storage or a.data_ptr() + nbytes(a) != b.data_ptr():
            return None
    first = ts[0].view(-1)
    n = sum(nbytes(t) for t in ts)
    if n % first.element_size():
        return None
    return first.as_strided((n // first.element_size(),), (1,)).view(torch.uint8)


def gather(ts: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' elements back to back, as bytes (a view, without a copy, where they already are)."""
    whole = spanning(ts)
    if whole is not None:
        return whole
    if not ts:
        return torch.empty(0, dtype=torch.uint8, device="cpu")
    out = torch.empty(sum(nbytes(t) for t in ts), dtype=torch.uint8, device=ts[0].device)
    put_all(out, ts)  # a strided view is not made contiguous first
    return out


def copy_own(srcs: list[torch.Tensor], dsts: list[torch.Tensor], rank: int) -> None:
    """What a rank sends itself: one copy when one tensor goes to one tensor and either side is contiguous."""
    if len(srcs) == len(dsts) == 1 and srcs[0].dtype == dsts[0].dtype and srcs[0].numel() == dsts[0].numel():
        src, dst = srcs[0], dsts[0]
        if src.is_contiguous():
            dst.copy_(src.view(dst.shape))
            return
        if dst.is_contiguous():
            dst.view(src.shape).copy_(src)
            return
    scatter(gather(srcs), dsts, rank, rank)


def scatter(src: torch.Tensor, dsts: list[torch.Tensor], sender: int, receiver: int) -> None:
    """The byte tensor ``src`` into ``dsts`` (any layout, row-major order), one after the other."""
    want = sum(nbytes(t) for t in dsts)
    if src.numel() != want:
        raise RuntimeError(
            f"all_to_all: rank {receiver} expected {want} bytes from rank {sender}, which sent {src.numel()}"
        )
    at = 0
    for t in dsts:
        n = nbytes(t)
        part = src[at : at + n]
        if part.storage_offset() % t.element_size():
            part = part.clone()
        t.copy_(part.view(t.dtype).view(t.shape))
        at += n


def row_bytes(x: torch.Tensor) -> int:
    """Bytes of one index of ``x``'s first dimension."""
    return x.element_size() * math.prod(x.shape[1:])


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """``x``'s elements in row-major order as a 1-D byte tensor (a view when ``x`` is contiguous)."""
    if not x.numel():
        return torch.empty(0, dtype=torch.uint8, device="cpu")
    x = x.contiguous().view(-1)
    if x.numel() == 1:  # a view of one element counts as contiguous whatever its stride
        x = x.as_strided((1,), (1,))
    return x.view(torch.uint8)
