"""What converting a sharded collection (``.to()``, ``.half()``, a precision plugin) makes of its tables.

``nn.Module._apply`` converts the tensors a module holds. A sharded collection also keeps, per table, the dtype
the wire carries (ranks without a piece of a table need it too) and the device its pipeline makes tensors on.
:func:`table_conversion` says what both become before anything is converted, so that the lookup kernels for
the result are resolved (and may refuse it) while the module is still as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from lightning_rec import _compat

__all__ = ["TableConversion", "table_conversion"]


class TableConversion(NamedTuple):
    fn: Callable[[torch.Tensor], torch.Tensor]  # what to apply to the collection's tensors
    dtypes: list[torch.dtype]  # every table's dtype afterwards, in config order
    device: torch.device  # with its index


def table_conversion(
    fn: Callable[[torch.Tensor], torch.Tensor], dtypes: list[torch.dtype], device: torch.device, keep_dtypes: bool
) -> TableConversion:
    """``fn`` applied to tables of ``dtypes`` on ``device``; ``keep_dtypes``: only move them (``keep_table_dtypes``)."""
    if keep_dtypes:
        # a precision plugin converting the model moves tables but keeps the dtype their config fixed
        convert = fn
        fn = lambda t: t.to(convert(torch.empty(0, dtype=t.dtype, device=t.device)).device)  # noqa: E731
    new_dtypes = [fn(torch.empty(0, dtype=d, device=device)).dtype for d in dtypes]
    return TableConversion(fn, new_dtypes, _compat.indexed_device(fn(torch.empty(0, device=device)).device))
