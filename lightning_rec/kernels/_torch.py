"""The torch lookup path: ``F.embedding_bag`` / ``F.embedding`` per run of features sharing a table.

It is the reference every other kernel must match, and the fallback wherever fbgemm has no kernel (sparse
gradients, bfloat16, a device the installed fbgemm build lacks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from lightning_rec.kernels._tables import promoted_dtype


def _table_runs(feature_table: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(table, first feature, end feature)`` for each run of consecutive features on the same table."""
    runs: list[tuple[int, int, int]] = []
    for f, t in enumerate(feature_table):
        if runs and runs[-1][0] == t:
            runs[-1] = (t, runs[-1][1], f + 1)
        else:
            runs.append((t, f, f + 1))
    return runs


def torch_pooled(
    tables: Sequence[torch.Tensor],
    feature_table: Sequence[int],
    values: torch.Tensor,
    offsets: torch.Tensor,
    batch_size: int,
    per_sample_weights: torch.Tensor | None,
    sparse_grad: bool,
    bounds: Sequence[int] | None = None,
) -> torch.Tensor:
    """SUM-pooled ``[batch_size, sum of feature dims]`` from feature-major ``values`` / ``offsets``.
    ``bounds``: where each feature's ids start in ``values`` (and the end), where the caller knows them on the
    host; read from ``offsets`` otherwise (a host sync on a GPU)."""
    b = batch_size
    if not feature_table:
        return torch.zeros(b, 0, dtype=promoted_dtype([t.dtype for t in tables]), device=values.device)
    # An empty batch still goes through F.embedding_bag so that the [0, D] output stays in the autograd
    # graph: backward through it must work (and give zero gradients) on a rank that got no samples.
    if bounds is None:
        bounds = offsets[::b].tolist() if b else [0] * (len(feature_table) + 1)
    outs = []
    # One lookup per run of consecutive features that share a table: a table then gets one gradient
    # instead of a sum of several, which torch cannot add when they are sparse fp16 / bf16 on CPU.
    for t, f0, f1 in _table_runs(feature_table):
        w = tables[t]
        lo, hi = bounds[f0], bounds[f1]
        seg_off = offsets[f0 * b : f1 * b + 1] - lo
        psw = None if per_sample_weights is None else per_sample_weights[lo:hi].to(w.dtype)
        out = F.embedding_bag(
            values[lo:hi].long(),
            w,
            seg_off.long(),
            mode="sum",
            per_sample_weights=psw,
            include_last_offset=True,
            sparse=sparse_grad,
        )
        if f1 - f0 > 1:  # [features * batch, D] -> [batch, features * D]
            out = out.view(f1 - f0, b, w.shape[1]).transpose(0, 1).reshape(b, (f1 - f0) * w.shape[1])
        outs.append(out)
    return torch.cat(outs, dim=1)


def torch_sequence(
    tables: Sequence[torch.Tensor],
    feature_table: Sequence[int],
    values: torch.Tensor,
    length_per_feature: Sequence[int],
    sparse_grad: bool,
) -> list[torch.Tensor]:
    """One ``[ids of feature, dim]`` tensor per feature (one lookup per run of features sharing a table)."""
    outs: list[torch.Tensor] = []
    start = 0
    for t, f0, f1 in _table_runs(feature_table):
        lens = list(length_per_feature[f0:f1])
        n = sum(lens)
        emb = F.embedding(values[start : start + n].long(), tables[t], sparse=sparse_grad)
        outs.extend(torch.split(emb, lens) if f1 - f0 > 1 else [emb])
        start += n
    return outs


def mean_divisor(
    lengths: torch.Tensor, dims: Sequence[int], is_mean: Sequence[bool], batch_size: int
) -> torch.Tensor | None:
    """``[batch, sum dims]`` divisor: the full bag length for MEAN features (at least 1), 1 for SUM ones."""
    if not any(is_mean):
        return None
    n = len(dims)
    lens = lengths.view(n, batch_size).to(torch.float32).clamp_min(1.0)
    mask = torch.tensor(is_mean, device=lengths.device).view(n, 1)
    lens = torch.where(mask, lens, torch.ones_like(lens))
    return torch.repeat_interleave(lens.t(), torch.tensor(list(dims), device=lengths.device), dim=1)
