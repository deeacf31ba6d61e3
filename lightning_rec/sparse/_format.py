"""TorchRec's ``str()`` layout of the sparse types: bags as nested lists, so printed batches read alike."""

from __future__ import annotations

import torch


def bags(values: torch.Tensor, offsets: torch.Tensor, lo: int = 0, hi: int | None = None) -> str:
    """``[[bag 0], [bag 1], ...]`` for the bags ``lo .. hi`` (1-D or 2-D values)."""
    if values.dim() > 2:
        raise ValueError(f"cannot print jagged values with {values.dim()} dimensions (1 or 2 supported)")
    off = offsets.tolist()
    hi = len(off) - 1 if hi is None else hi
    return str([values[off[i] : off[i + 1]].tolist() for i in range(lo, hi)])


def jagged(name: str, values: torch.Tensor, weights: torch.Tensor | None, offsets: torch.Tensor) -> str:
    if weights is None:
        return f"{name}({{\n    {bags(values, offsets)}\n}})\n"
    return f'{name}({{\n    "values": {bags(values, offsets)},\n    "weights": {bags(weights, offsets)}\n}})\n'


def keyed_jagged(
    keys: list[str], values: torch.Tensor, weights: torch.Tensor | None, offsets: torch.Tensor, bag_bounds: list[int]
) -> str:
    if not keys:
        return "KeyedJaggedTensor()\n"
    parts = []
    for i, k in enumerate(keys):
        lo, hi = bag_bounds[i], bag_bounds[i + 1]
        if weights is None:
            parts.append(f'    "{k}": {bags(values, offsets, lo, hi)}')
        else:
            parts.append(
                f'    "{k}": {{\n        "values": {bags(values, offsets, lo, hi)},\n'
                f'        "weights": {bags(weights, offsets, lo, hi)}\n    }}'
            )
    return "KeyedJaggedTensor({\n" + ",\n".join(parts) + "\n})\n"


def keyed_jagged_repr(
    keys: list[str], spk: list[int], lengths: torch.Tensor, values: torch.Tensor, weights: torch.Tensor | None
) -> str:
    w = "" if weights is None else f", weights={weights.tolist()}"
    return (
        f"KeyedJaggedTensor(keys={keys}, stride_per_key={spk}, lengths={lengths.tolist()}, values={values.tolist()}{w})"
    )


def keyed(blocks: dict[str, torch.Tensor]) -> str:
    if not blocks:
        return "KeyedTensor()\n"
    return "KeyedTensor({\n" + ",\n".join(f'    "{k}": {v.tolist()}' for k, v in blocks.items()) + "\n})\n"
