"""The Adam family's fused update on CPU, in torch: fbgemm's CUDA rule where its CPU build has no kernel.

fbgemm's CPU build has no Adam / LAMB kernels (docs/ARCHITECTURE.md F1). :class:`TorchAdamTBE` stands in for
its split table-batched module (``SplitTableBatchedEmbeddingBagsCodegen``) on CPU for those kinds, with the part
of its interface :class:`~lightning_rec.kernels.FusedPooledKernel` uses: a call with values / offsets /
per-sample weights, ``split_embedding_weights()``, ``split_optimizer_states()`` (fbgemm's order: ``exp_avg``,
then ``exp_avg_sq`` per value, or per row for the partial row-wise kinds), ``set_learning_rate``, the step
counter ``iter`` and the flat ``weights_host``. Its backward updates only the rows the batch touched, with the
update fbgemm's CUDA kernels apply (``fbgemm_gpu/codegen/genscript/optimizers.py``: ``adam``,
``partial_rowwise_adam``, ``lamb``, ``partial_rowwise_lamb``), so optimizer state moves between CPU and CUDA
runs through a checkpoint. Per table and step ``t`` (fbgemm's ``iter``, counted at every forward and read
by that forward's backward), with ``g`` the gradient of a row summed over every occurrence in the batch
(per-sample weights applied first; fbgemm's backward sorts and aggregates per unique row) and ``w`` the
row before the update::

    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g**2            (partial row-wise: one v per row, from mean(g**2) over the row)
    r = (m / (1 - b1**t)) / (sqrt(v / (1 - b2**t)) + eps) + weight_decay * w
    adam:  w -= lr * r                       lamb: w -= lr * (||w|| / ||r||) * r   (norms over the row)

fbgemm divides by ``||r||`` unguarded (a row whose ``r`` is zero becomes NaN); here that row does not move,
as its ``r`` says. Tables are float32. ``pooling="none"`` (one output row per id, for sequence lookups) needs one
width for all tables and takes no per-sample weights.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from lightning_rec.fused_kinds import FUSED_KINDS, PER_ROW, TORCH_CPU_KINDS, FusedOptimizerSpec
from lightning_rec.kernels._guards import POOLINGS

_TRUST_RATIO = ("lamb", "partial_rowwise_lamb")


def _f32(x: float) -> float:
    # fbgemm takes its hyper-parameters as C++ floats
    return float(torch.tensor(x, dtype=torch.float32))


class _Block:
    """Consecutive tables of one width, read as one ``[rows, dim]`` matrix over the flat storage, and the
    consecutive features that read them (fbgemm's ``feature_table_map`` is non-decreasing: F2)."""

    __slots__ = ("col", "dim", "feature_base", "features", "row_span", "value_span")

    def __init__(
        self, tables: range, features: range, rows: list[int], dims: list[int], feature_table: list[int], col: int
    ) -> None:
        self.dim = dims[tables.start]
        self.features = features
        self.col = col
        first_row = sum(rows[: tables.start])
        self.row_span = (first_row, first_row + sum(rows[t] for t in tables))
        first_value = sum(r * d for r, d in zip(rows[: tables.start], dims))
        self.value_span = (first_value, first_value + sum(rows[t] * dims[t] for t in tables))
        # each feature's table starts at this row of the block's matrix
        self.feature_base = torch.tensor(
            [sum(rows[tables.start : feature_table[f]]) for f in features], dtype=torch.long
        )


class TorchAdamTBE:
    """fbgemm's split TBE for the Adam family on CPU, in torch: lookups, state, and the update in backward.

    Args:
        rows, dims: per table.
        feature_table: the table of each feature, non-decreasing.
        spec: the fused optimizer (its kind one of ``fused_kinds.TORCH_CPU_KINDS``).
        pooling: ``"sum"`` (``[batch, sum of feature dims]``, features' columns in order) or ``"none"``
            (``[ids, dim]``, one row per id).
    """

    def __init__(
        self,
        rows: Sequence[int],
        dims: Sequence[int],
        feature_table: Sequence[int],
        spec: FusedOptimizerSpec,
        pooling: str = "sum",
    ) -> None:
        if spec.kind not in TORCH_CPU_KINDS:
            raise ValueError(f"TorchAdamTBE applies {list(TORCH_CPU_KINDS)}, not {spec.kind!r}")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {list(POOLINGS)}, got {pooling!r}")
        self.rows, self.dims = [int(r) for r in rows], [int(d) for d in dims]
        self.feature_table = [int(t) for t in feature_table]
        if any(b < a for a, b in itertools.pairwise(self.feature_table)):
            raise ValueError(f"feature_table must be non-decreasing, got {self.feature_table}")
        if pooling == "none" and len(set(self.dims)) > 1:
            raise ValueError(f"pooling='none' needs one width for all tables, got {self.dims}")
        self.kind, self.pooling = spec.kind, pooling
        beta1, beta2 = spec.betas if spec.betas is not None else (0.9, 0.999)  # fbgemm's defaults
        self.beta1, self.beta2 = _f32(beta1), _f32(beta2)
        self.eps, self.weight_decay = _f32(spec.eps), _f32(spec.weight_decay)
        self.learning_rate = _f32(spec.lr)
        self.row_state = dict(FUSED_KINDS[spec.kind].states)["exp_avg_sq"] == PER_ROW
        values = sum(r * d for r, d in zip(self.rows, self.dims))
        self.weights_host = torch.zeros(values)
        self.momentum1_host = torch.zeros(values)
        self.momentum2_host = torch.zeros(sum(self.rows) if self.row_state else values)
        self.iter = torch.zeros(1, dtype=torch.long)
        # the output joins the graph through this input (the tables themselves take no gradient)
        self.anchor = torch.zeros(0, requires_grad=True)
        self.blocks: list[_Block] = []
        col, t0 = 0, 0
        for t in range(1, len(self.rows) + 1):
            if t == len(self.rows) or self.dims[t] != self.dims[t0]:
                feats = [f for f, ft in enumerate(self.feature_table) if t0 <= ft < t]
                features = range(feats[0], feats[-1] + 1) if feats else range(0)
                self.blocks.append(_Block(range(t0, t), features, self.rows, self.dims, self.feature_table, col))
                col += self.dims[t0] * len(features)
                t0 = t
        self.total_dim = col

    # -- fbgemm's interface ---------------------------------------------------------------------------------

    @property
    def iter_cpu(self) -> torch.Tensor:
        """fbgemm keeps a host copy of ``iter``; here it is the same tensor."""
        return self.iter

    def set_learning_rate(self, lr: float) -> None:
        self.learning_rate = _f32(lr)

    def get_learning_rate(self) -> float:
        return self.learning_rate

    def split_embedding_weights(self) -> list[torch.Tensor]:
        """One ``[rows, dim]`` view of the storage per table."""
        ends = list(itertools.accumulate((r * d for r, d in zip(self.rows, self.dims)), initial=0))
        return [self.weights_host[a:b].view(r, d) for a, b, r, d in zip(ends, ends[1:], self.rows, self.dims)]

    def split_optimizer_states(self) -> list[list[torch.Tensor]]:
        """``[exp_avg, exp_avg_sq]`` per table, views of the live state (fbgemm's order)."""
        value_ends = list(itertools.accumulate((r * d for r, d in zip(self.rows, self.dims)), initial=0))
        row_ends = list(itertools.accumulate(self.rows, initial=0))
        out = []
        for t, (r, d) in enumerate(zip(self.rows, self.dims)):
            m1 = self.momentum1_host[value_ends[t] : value_ends[t + 1]].view(r, d)
            if self.row_state:
                m2 = self.momentum2_host[row_ends[t] : row_ends[t + 1]]
            else:
                m2 = self.momentum2_host[value_ends[t] : value_ends[t + 1]].view(r, d)
            out.append([m1, m2])
        return out

    def __call__(
        self, values: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The lookup (feature-major ``offsets``: ``features * batch + 1`` entries). Counts a step, as fbgemm's
        forward does; backward through the output updates the rows it read."""
        if self.pooling == "none" and per_sample_weights is not None:
            raise ValueError("pooling='none' takes no per_sample_weights (fbgemm drops them: F3)")
        step = int(self.iter.add_(1).item())
        out: torch.Tensor = _Lookup.apply(self.anchor, per_sample_weights, self, values, offsets, step)
        return out

    # -- lookup and update ----------------------------------------------------------------------------------

    def _matrix(self, block: _Block, flat: torch.Tensor, per_row: bool = False) -> torch.Tensor:
        if per_row:
            return flat[block.row_span[0] : block.row_span[1]]
        return flat[block.value_span[0] : block.value_span[1]].view(-1, block.dim)

    def _rows(self, block: _Block, values: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        """The block-matrix row of every id of the block's features."""
        f = block.features
        counts = torch.tensor([bounds[i + 1] - bounds[i] for i in f], dtype=torch.long)
        n = bounds[f.stop] - bounds[f.start]
        base = block.feature_base.repeat_interleave(counts, output_size=n)
        return values[bounds[f.start] : bounds[f.stop]] + base

    def lookup(
        self, values: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
        """``(output, rows per block, id bounds per feature)``."""
        n_features = len(self.feature_table)
        batch = (offsets.numel() - 1) // n_features
        bounds = offsets[::batch].tolist() if batch else [0] * (n_features + 1)
        rows = [self._rows(b, values, bounds) for b in self.blocks]
        if self.pooling == "none":
            return self._matrix(self.blocks[0], self.weights_host).index_select(0, rows[0]), rows, bounds
        outs = []
        for block, r in zip(self.blocks, rows):
            f, lo = block.features, bounds[block.features.start]
            pooled = F.embedding_bag(
                r,
                self._matrix(block, self.weights_host),
                offsets[f.start * batch : f.stop * batch + 1] - lo,
                mode="sum",
                per_sample_weights=None if weights is None else weights[lo : bounds[f.stop]],
                include_last_offset=True,
            )
            outs.append(pooled.view(len(f), batch, block.dim).transpose(0, 1).reshape(batch, len(f) * block.dim))
        return (outs[0] if len(outs) == 1 else torch.cat(outs, 1)), rows, bounds

    def backward(
        self,
        grad: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        rows: list[torch.Tensor],
        bounds: list[int],
        step: int,
        weights_grad: bool,
    ) -> torch.Tensor | None:
        """Update the rows the lookup read; return the per-sample weights' gradient if asked (from the rows
        before the update, as fbgemm's backward computes it first)."""
        grad = grad.float()
        batch = (offsets.numel() - 1) // len(self.feature_table)
        w_grad = torch.zeros_like(weights) if weights_grad and weights is not None else None
        for block, r in zip(self.blocks, rows):
            f, lo, hi = block.features, bounds[block.features.start], bounds[block.features.stop]
            if hi == lo:
                continue
            if self.pooling == "none":
                per_id = grad[lo:hi]
            else:
                # the block's columns, bag-major (feature, sample) as its offsets count bags
                g = grad[:, block.col : block.col + len(f) * block.dim]
                g = g.reshape(batch, len(f), block.dim).transpose(0, 1).reshape(-1, block.dim)
                lengths = offsets[f.start * batch : f.stop * batch + 1].diff()
                bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths, output_size=hi - lo)
                per_id = g.index_select(0, bag)
                if w_grad is not None:
                    w = self._matrix(block, self.weights_host).index_select(0, r)
                    w_grad[lo:hi] = (w * per_id).sum(1)
                if weights is not None:
                    per_id = per_id * weights[lo:hi, None].float()
            unique, inverse = torch.unique(r, return_inverse=True)
            summed = torch.zeros(unique.numel(), block.dim).index_add_(0, inverse, per_id)
            self._update(block, unique, summed, step)
        return w_grad

    @torch.no_grad()
    def _update(self, block: _Block, idx: torch.Tensor, g: torch.Tensor, step: int) -> None:
        weights = self._matrix(block, self.weights_host)
        exp_avg = self._matrix(block, self.momentum1_host)
        exp_avg_sq = self._matrix(block, self.momentum2_host, per_row=self.row_state)
        b1, b2, lr = self.beta1, self.beta2, self.learning_rate
        w = weights.index_select(0, idx)
        m = exp_avg.index_select(0, idx).mul_(b1).add_(g, alpha=1.0 - b1)
        bias1, bias2 = 1.0 - b1**step, 1.0 - b2**step
        if self.row_state:
            v = exp_avg_sq.index_select(0, idx).mul_(b2).add_(g.square().mean(1), alpha=1.0 - b2)
            denom = (v / bias2).sqrt_().add_(self.eps)[:, None]
            # as fbgemm: partial row-wise lamb multiplies by the reciprocal, partial row-wise adam divides
            r = (m / bias1) * denom.reciprocal() if self.kind in _TRUST_RATIO else (m / bias1) / denom
        else:
            v = exp_avg_sq.index_select(0, idx).mul_(b2).addcmul_(g, g, value=1.0 - b2)
            r = (m / bias1) / ((v / bias2).sqrt_().add_(self.eps))
        if self.weight_decay:
            r.add_(w, alpha=self.weight_decay)
        if self.kind in _TRUST_RATIO:
            r_norm = r.norm(dim=1, keepdim=True)
            ratio = torch.where(r_norm > 0, w.norm(dim=1, keepdim=True) / r_norm, torch.zeros_like(r_norm))
            w.sub_(r * ratio * lr)
        else:
            w.sub_(r, alpha=lr)
        weights.index_copy_(0, idx, w)
        exp_avg.index_copy_(0, idx, m)
        exp_avg_sq.index_copy_(0, idx, v)


class _Lookup(torch.autograd.Function):
    """The lookup; its backward applies the update and returns the per-sample weights' gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        anchor: torch.Tensor,
        weights: torch.Tensor | None,
        tbe: TorchAdamTBE,
        values: torch.Tensor,
        offsets: torch.Tensor,
        step: int,
    ) -> torch.Tensor:
        kept = None if weights is None else weights.detach()
        out, rows, bounds = tbe.lookup(values, offsets, kept)
        ctx.tbe, ctx.offsets, ctx.weights, ctx.rows, ctx.bounds, ctx.step = tbe, offsets, kept, rows, bounds, step
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor | None, None, None, None, None]:  # type: ignore[override]
        w_grad = ctx.tbe.backward(
            grad, ctx.offsets, ctx.weights, ctx.rows, ctx.bounds, ctx.step, bool(ctx.needs_input_grad[1])
        )
        return None, w_grad, None, None, None, None
