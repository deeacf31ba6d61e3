"""Placing blocks of pooled rows into their columns of the output, and gathering their gradients back.

A block's columns land as :class:`~lightning_rec.pipeline.routing.ColumnGroup` s (runs of adjacent columns a
fixed step apart): each group is one strided copy, or add where an earlier block wrote those columns. Shared
by the flat output dist (``output_dist.py``) and the hierarchical one (``host_output_dist.py``), which also
places rows into a host's block with them.
"""

from __future__ import annotations

import torch

from lightning_rec.pipeline.routing import ColumnGroup


def _group_view(t: torch.Tensor, first: int, n: int, count: int, step: int) -> torch.Tensor:
    """``[rows, count, n]`` view of ``count`` runs of ``n`` columns of the 2-D ``t``, ``step`` columns apart."""
    s0, s1 = t.stride()
    return t.as_strided((t.shape[0], count, n), (s0, step * s1, s1), t.storage_offset() + first * s1)


def _put(out: torch.Tensor, blocks: list[tuple[torch.Tensor, tuple[ColumnGroup, ...], tuple[bool, ...]]]) -> None:
    """Each ``(block, groups, adds)``'s column groups copied (or added) into ``out``, in order. A copy that the
    next group adds onto (the same columns: row blocks of a table) is one ``add`` of the two, one pass fewer
    over those columns, with the same bits (where the blocks already have ``out``'s dtype: a quantized block is
    widened by the copy, then added in ``out``'s dtype)."""
    ops = [
        (geom, _group_view(block, geom[0], geom[2], geom[3], geom[2]), add)
        for block, groups, adds in blocks
        for geom, add in zip(groups, adds)
    ]
    i = 0
    while i < len(ops):
        (_, dst, n, count, step), piece, add = ops[i]
        place = _group_view(out, dst, n, count, step)
        if (
            not add
            and i + 1 < len(ops)
            and ops[i + 1][2]
            and ops[i + 1][0][1:] == ops[i][0][1:]
            and piece.dtype == ops[i + 1][1].dtype == out.dtype
        ):
            torch.add(piece, ops[i + 1][1], out=place)
            i += 2
            continue
        if add:
            place += piece
        else:
            place.copy_(piece)
        i += 1


def _take(block: torch.Tensor, grad: torch.Tensor, groups: tuple[ColumnGroup, ...]) -> None:
    """The gradient of ``block``'s column groups, gathered from the output's gradient."""
    for src, dst, n, count, step in groups:
        _group_view(block, src, n, count, n).copy_(_group_view(grad, dst, n, count, step))


def gathered(grad: torch.Tensor, groups: tuple[ColumnGroup, ...], width: int) -> torch.Tensor:
    """The ``[rows, width]`` gradient of a block whose columns are ``groups`` of ``grad``: a strided view of
    ``grad`` where the block is one group in its own column order (no copy), else gathered into a new block."""
    if len(groups) == 1 and groups[0].src == 0 and groups[0].n * groups[0].runs == width:
        _, dst, n, count, step = groups[0]
        return _group_view(grad, dst, n, count, step)
    block = torch.empty(grad.shape[0], width, dtype=grad.dtype, device=grad.device)
    _take(block, grad, groups)
    return block
