"""Regrouping the key blocks of several KeyedTensors into new tensors, one per group of keys.

Two forms of the same plan: ``regroup_values`` cuts and joins the tensors (what ``KeyedTensor.regroup`` runs),
``kt_regroup_arguments`` writes the plan as the argument tensors of fbgemm's ``permute_multi_embedding`` op
(TorchRec's ``_kt_regroup_arguments``), for code that calls that op directly.

A key held by several inputs is read from the last one, as TorchRec's ``KeyedTensor.regroup`` does; a key may
appear in several groups (its gradient is the sum over its uses). ``KeyedTensor.regroup`` runs in plain torch
rather than through fbgemm's op: it then needs no fbgemm, scripts, runs on the meta device, and gives unread
keys a zero gradient (fbgemm-gpu 1.8.0's CPU backward leaves theirs uninitialized).
"""

# no ``from __future__ import annotations``: TorchScript compiles ``regroup_values`` from its annotations
import torch


def _where(keys: list[list[str]], key_lengths: list[list[int]]) -> dict[str, tuple[int, int, int]]:
    """key -> (input index, index of the key in that input, start column); the last input holding a key wins."""
    if len(keys) != len(key_lengths):
        raise ValueError("regroup: " + str(len(keys)) + " key lists but " + str(len(key_lengths)) + " length lists")
    where: dict[str, tuple[int, int, int]] = {}
    for t in range(len(keys)):
        if len(keys[t]) != len(key_lengths[t]):
            raise ValueError(
                "regroup: input "
                + str(t)
                + " has "
                + str(len(keys[t]))
                + " keys but "
                + str(len(key_lengths[t]))
                + " lengths"
            )
        start = 0
        for i in range(len(keys[t])):
            where[keys[t][i]] = (t, i, start)
            start += key_lengths[t][i]
    return where


def _lookup(where: dict[str, tuple[int, int, int]], key: str, g: int) -> tuple[int, int, int]:
    if key not in where:
        raise KeyError(
            "regroup: key '"
            + key
            + "' of group "
            + str(g)
            + " is in no input (available: "
            + ", ".join(list(where.keys()))
            + ")"
        )
    return where[key]


def regroup_values(
    values: list[torch.Tensor],
    keys: list[list[str]],
    key_lengths: list[list[int]],
    groups: list[list[str]],
    key_dim: int = 1,
) -> list[torch.Tensor]:
    """One tensor per group: the blocks of the group's keys, side by side along ``key_dim``.

    ``values[t]`` holds the blocks of ``keys[t]`` (widths ``key_lengths[t]``) along ``key_dim``. Each input is
    cut by one ``split``, whose backward writes every block's gradient into the input's in one pass (no
    zero-filled copy of the input per block, as slicing block by block would make).
    """
    if len(values) != len(keys):
        raise ValueError("regroup: " + str(len(values)) + " tensors but " + str(len(keys)) + " key lists")
    where = _where(keys, key_lengths)
    pieces: dict[int, list[torch.Tensor]] = {}
    out: list[torch.Tensor] = []
    for g in range(len(groups)):
        blocks: list[torch.Tensor] = []
        for key in groups[g]:
            t, i, _start = _lookup(where, key, g)
            if t not in pieces:  # cut only the inputs some group reads
                pieces[t] = list(values[t].split(key_lengths[t], dim=key_dim))
            blocks.append(pieces[t][i])
        if len(blocks) == 0:  # an empty group: a zero-width tensor with the inputs' other sizes
            blocks.append(values[0].narrow(key_dim, 0, 0))
        out.append(torch.cat(blocks, dim=key_dim))
    return out


def kt_regroup_arguments(
    value: torch.Tensor, keys: list[list[str]], key_lengths: list[list[int]], groups: list[list[str]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """The regroup plan as fbgemm's ``permute_multi_embedding`` takes it (TorchRec's ``_kt_regroup_arguments``).

    Returns ``permutes``, ``in_shapes``, ``out_shapes`` (int32, on ``value``'s device) and ``out_lengths``.
    ``permutes`` has one row per (group, key) in group order: ``[input, output, input start, output start,
    width, jump]``. ``jump`` chains the uses of a key that appears more than once, so a backward kernel can sum
    their gradients: the first use holds the row of the second, every later use minus the row of the next,
    and the last one minus the number of rows; a key used once has 0. ``in_shapes`` / ``out_shapes`` are the
    total widths of each input and each group; ``out_lengths`` the latter as a list.
    """
    where = _where(keys, key_lengths)
    rows: list[list[int]] = []
    uses: dict[str, list[int]] = {}  # key -> its rows, in order
    out_lengths: list[int] = []
    for g, group in enumerate(groups):
        out_start = 0
        for key in group:
            t, i, in_start = _lookup(where, key, g)
            width = key_lengths[t][i]
            uses.setdefault(key, []).append(len(rows))
            rows.append([t, g, in_start, out_start, width, 0])
            out_start += width
        out_lengths.append(out_start)
    for chain in uses.values():
        if len(chain) > 1:
            rows[chain[0]][5] = chain[1]
            for here, nxt in zip(chain[1:], [*chain[2:], len(rows)]):
                rows[here][5] = -nxt
    # built on the host, then moved: a meta ``value`` gets meta tensors of the right shapes
    device = value.device
    permutes = torch.tensor(rows, dtype=torch.int32).reshape(len(rows), 6).to(device)
    in_shapes = torch.tensor([sum(lens) for lens in key_lengths], dtype=torch.int32).to(device)
    out_shapes = torch.tensor(out_lengths, dtype=torch.int32).to(device)
    return permutes, in_shapes, out_shapes, out_lengths
