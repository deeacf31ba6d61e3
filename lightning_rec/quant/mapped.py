"""Files mapped read-only into this process, and the tensors over them that refuse writes.

Every process that maps the same file with ``mmap(PROT_READ, MAP_SHARED)`` reads the same page-cache pages: N
serving processes hold one copy of the tables, not N. Of the ways to map a file from Python (measured in
``benchmarks/results/quant_shared.md``): ``torch.from_file(shared=True)`` opens the file for writing and maps it
writable (a stray write changes the file under every other process), ``torch.load(mmap=True)`` maps it private and
writable (a write silently makes this process's copy differ from the file); a read-only shared mapping is what
``mmap.ACCESS_READ`` (and ``numpy.memmap(mode="r")``) give, and what :func:`map_read_only` makes.

A write through torch into such a table raises (:class:`MappedRows`, naming the table and the file); a write that
bypasses torch (``.numpy()``) hits a read-only page and ends the process with SIGSEGV rather than diverge.
"""

from __future__ import annotations

import mmap
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

_IN_PLACE_DUNDERS = frozenset(
    f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift")
) | {"__irshift__", "__imatmul__", "__setitem__"}


def map_read_only(path: str | os.PathLike) -> torch.Tensor:
    """The whole file as a 1-D uint8 tensor over a read-only shared mapping (pages shared with every process
    that maps the file; none of them can write)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise ValueError(f"{path} is empty: expected a quantized tables file (lightning_rec.quant.save_quantized)")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_RANDOM"):
        mm.madvise(mmap.MADV_RANDOM)  # lookups touch scattered rows: read-ahead would only fill the page cache
    with warnings.catch_warnings():
        # torch warns that it cannot mark a tensor read-only; MappedRows (and the page protection) take care of it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mm, dtype=torch.uint8)  # the tensor holds the mapping open


def plain_alias(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor over the same memory as ``t`` (for a :class:`MappedRows`: the kernels' view, without the
    per-op check)."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), t.shape, t.stride()
    )


def _mutated(func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> MappedRows | None:
    """The mapped tensor ``func`` would write into, if any: an in-place method's ``self`` or an ``out=``."""
    name = getattr(func, "__name__", "")
    in_place = (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS
    if in_place and args and isinstance(args[0], MappedRows):
        return args[0]
    out = kwargs.get("out")
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(t, MappedRows):
            return t
    return None


class MappedRows(torch.Tensor):
    """A table's stored rows mapped read-only from a file (:func:`lightning_rec.quant.load_quantized_tables`).

    Reads work as on any tensor (results are ordinary tensors, views stay mapped); in-place ops, ``out=`` and
    ``load_state_dict`` into it raise a ``RuntimeError`` naming the table and the file. Saved (``torch.save``,
    ``state_dict``) as an ordinary tensor.
    """

    table: str = "?"
    source: str = "?"

    @staticmethod
    def wrap(t: torch.Tensor, table: str, source: str) -> MappedRows:
        m = t.as_subclass(MappedRows)
        m.table, m.source = table, source
        return m

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        target = _mutated(func, args, kwargs)
        if target is not None:
            raise RuntimeError(
                f"table {target.table!r} is mapped read-only from {target.source} (shared by every process that "
                f"maps it): {getattr(func, '__name__', func)} would write into it. Load the file with mmap=False "
                "for a private, writable copy"
            )
        ret = super().__torch_function__(func, types, args, kwargs)
        mapped = [a for a in args if isinstance(a, MappedRows)]
        return _unwrap(ret, mapped[0] if mapped else None)

    def __reduce_ex__(self, proto: Any) -> Any:
        return plain_alias(self).__reduce_ex__(proto)


def _unwrap(ret: Any, source: MappedRows | None) -> Any:
    """Results that do not share the mapped memory become ordinary tensors; views of it stay :class:`MappedRows`."""
    if isinstance(ret, (tuple, list)):
        return type(ret)(_unwrap(r, source) for r in ret)
    if not isinstance(ret, MappedRows):
        return ret
    plain = plain_alias(ret)
    if source is not None and plain.untyped_storage().data_ptr() == plain_alias(source).untyped_storage().data_ptr():
        ret.table, ret.source = source.table, source.source
        return ret
    return plain
