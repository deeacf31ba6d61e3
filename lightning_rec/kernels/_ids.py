"""Input checks shared by every lookup path: an id outside its table, or broken offsets, raise one clear error.

fbgemm's bounds check lets -1 through and its CPU kernels read out of bounds for larger ids, and
``F.embedding_bag`` raises an index error that names no feature: so ids are checked here, before any kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_ids(
    values: torch.Tensor,
    lengths: Sequence[int],
    rows: torch.Tensor,
    feature_names: Sequence[object],  # names, or feature indices where the caller has no names
    table_of_feature: Sequence[str],
) -> None:
    """Raise a ValueError naming feature, table, value and range for the first id outside ``[0, rows)``.

    ``lengths[f]`` ids of feature ``f`` (sizes the host holds) follow each other in ``values``; ``rows[f]`` is
    its table's size.
    """
    if values.numel() == 0:
        return
    # each feature's extremes against its table's size: one pass over the ids, and reading the verdict is the one
    # host sync (a per-id comparison with each id's own bound cost 10x more on CPU)
    pieces = values.split(list(lengths))
    keep = [f for f, k in enumerate(lengths) if k]
    extremes = [pieces[f].aminmax() for f in keep]
    mins = torch.stack([m.min for m in extremes])
    maxs = torch.stack([m.max for m in extremes])
    bad = (mins < 0) | (maxs >= rows[keep])
    if not bool(bad.any()):
        return
    # an id is out of range: find it and say where (syncs are fine on the way to raise)
    f = keep[int(torch.nonzero(bad)[0])]
    r, piece = int(rows[f]), pieces[f]
    value = int(piece[int(torch.nonzero((piece < 0) | (piece >= r))[0])])
    hint = " (-1 is usually padding: filter it out before the lookup)" if value == -1 else ""
    raise ValueError(
        f"feature {feature_names[f]!r} (table {table_of_feature[f]!r}) has id {value}, "
        f"outside the valid range [0, {r - 1}] (num_embeddings={r}){hint}"
    )


def validate_ids(
    values: torch.Tensor,
    length_per_feature: Sequence[int],
    rows_per_feature: Sequence[int],
    feature_names: Sequence[str],
    table_of_feature: Sequence[str],
) -> None:
    """Raise a ValueError naming feature, table, value and range for the first out-of-range id."""
    if values.numel() == 0:
        return
    rows = torch.as_tensor(list(rows_per_feature), dtype=torch.long, device=values.device)
    check_ids(values, length_per_feature, rows, feature_names, table_of_feature)


def check_offsets(values: torch.Tensor, offsets: torch.Tensor, batch: int) -> list[int]:
    """Feature-major ``offsets`` (``features * batch + 1``) must start at 0, never decrease, end at ``len(values)``.
    Returns where each feature's ids start, and the end (``offsets[::batch]``), read in the same host sync (none
    for a batch of 0)."""
    n = values.numel()
    if batch == 0:
        if n or int(offsets[0]) != 0:
            raise ValueError(f"batch size 0 but {n} ids (offsets {offsets.tolist()})")
        return []
    *bounds, decreasing = torch.cat([offsets[::batch], (offsets.diff() < 0).any().view(1)]).tolist()  # one sync
    first, last = bounds[0], bounds[-1]
    if first != 0 or last != n or decreasing:
        raise ValueError(
            f"offsets must start at 0, never decrease and end at the number of ids ({n}); "
            f"got first {first}, last {last}"
        )
    return bounds
