"""Deferred updates of the fused kernel: gradient accumulation and several backward passes per step, exact.

A fused kernel applies its optimizer inside backward, so k backward passes would make k updates. In
accumulation mode (``FusedPooledKernel.accumulate = True``) the lookup runs without fbgemm's autograd and
its backward only keeps what the update needs: each micro-batch's ids, offsets, per-sample weights and the
(scaled) gradient of its output (pooled: ``[batch, width]``; without pooling: ``[ids, dim]``, a row per id).
``finish_step`` (``FusedOptimizer.step``) then runs fbgemm's forward and fused backward once over the union of
the kept micro-batches. fbgemm's exact optimizers sum every occurrence of a row before updating it once (pooled
or not: measured for the no-bag mode too, docs/ARCHITECTURE.md F18), so the union gives the update of the summed
gradient: the tables do not move between micro-batches, and the step is one update, as a torch optimizer's step
on accumulated ``.grad`` (docs/ARCHITECTURE.md, "Fused optimizers and the union-batch rule").

Cost per kept micro-batch (bytes): ``8 * ids + 8 * (features * batch + 1)`` (+ ``4 * ids`` weighted)
``+ itemsize * batch * width`` (the pooled gradient; without pooling ``itemsize * ids * dim``); under the
union-batch rule these are the union's (copies x the local batch). The step concatenates them once more, and
re-runs the forward over the union.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class MicroBatch:
    """One lookup's inputs, kept until the step, and the gradient its backward passes brought (summed)."""

    __slots__ = ("batch", "grad", "keep", "offsets", "per_id", "values", "weights")

    def __init__(
        self,
        values: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        batch: int,
        per_id: bool = False,
    ) -> None:
        self.values, self.offsets, self.weights, self.batch = values, offsets, weights, batch
        #: the gradient has a row per id (no pooling), not per sample
        self.per_id = per_id
        self.grad: torch.Tensor | None = None
        #: per-id gradients: which of the lookup's ids are still kept after drop_rows (None: all)
        self.keep: torch.Tensor | None = None

    def drop_rows(self, features: list[int], rows: torch.Tensor) -> None:
        """Forget every occurrence of ``rows`` in the bags of ``features``: those rows were given to other ids
        since (managed collision), so this micro-batch's gradient no longer belongs to them. The pooled gradient
        of each bag stays: the bag's other rows get what they got. Without pooling each dropped id's gradient row
        goes with it."""
        lengths = self.offsets.diff()
        bagged = int(self.offsets[-1])  # ids past the last bag belong to no bag: dropped too
        bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths, output_size=bagged)
        ids = self.values[:bagged]
        feature = torch.div(bag, max(self.batch, 1), rounding_mode="floor")
        drop = torch.isin(feature, torch.tensor(features, device=feature.device)) & torch.isin(
            ids, rows.to(ids.device, ids.dtype)
        )
        if not bool(drop.any()):
            return
        keep = ~drop
        kept = torch.bincount(bag[keep], minlength=lengths.numel()).to(self.offsets.dtype)
        self.values = ids[keep]
        self.weights = None if self.weights is None else self.weights[:bagged][keep]
        if self.per_id:
            # a later backward through this lookup (another loss) brings a row per original id: keep its map
            at = torch.nonzero(keep).squeeze(1)
            self.keep = at if self.keep is None else self.keep.index_select(0, at)
            if self.grad is not None:
                self.grad = self.grad[:bagged][keep]
        self.offsets = torch.cat([self.offsets.new_zeros(1), torch.cumsum(kept, 0)])

    def nbytes(self) -> int:
        """Bytes this micro-batch keeps until the step (its inputs and its gradient)."""
        kept = [self.values, self.offsets, self.weights, self.grad, self.keep]
        return sum(t.numel() * t.element_size() for t in kept if t is not None)


class DeferringKernel(Protocol):
    """What a deferred lookup needs of its kernel: fbgemm's module and the step count it keeps, the feature
    layout and tables (for the weights' gradient), the micro-batches waiting for the step, and an input that
    joins the output to the graph. :class:`~lightning_rec.kernels._fused_tbe.FusedPooledKernel` is one; it
    imports this module, so naming it here would make the two modules need each other."""

    @property
    def _tbe(self) -> Any: ...

    @property
    def optimizer_iter(self) -> int | None: ...

    @optimizer_iter.setter
    def optimizer_iter(self, step: int) -> None: ...

    @property
    def feature_table(self) -> list[int]: ...

    @property
    def feature_dims(self) -> list[int]: ...

    @property
    def pooling(self) -> str: ...

    @property
    def _pending(self) -> list[MicroBatch]: ...

    @property
    def _anchor(self) -> torch.Tensor: ...

    def tables(self) -> list[torch.nn.Parameter]: ...


def drop_kept_rows(kernel: DeferringKernel, table: int, rows: torch.Tensor) -> None:
    """Forget the kept gradient (accumulation) of ``rows`` of the kernel's table ``table`` in every waiting
    micro-batch: managed collision gave those rows to new ids since those lookups."""
    features = [f for f, t in enumerate(kernel.feature_table) if t == table]
    for mb in kernel._pending:
        mb.drop_rows(features, rows)


class _DeferredLookup(torch.autograd.Function):
    """The kernel's output; backward keeps the gradient for the step instead of updating."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        anchor: torch.Tensor,
        weights: torch.Tensor | None,
        kernel: DeferringKernel,
        mb: MicroBatch,
        grad_scale: float,
    ) -> torch.Tensor:
        ctx.kernel, ctx.mb, ctx.grad_scale = kernel, mb, grad_scale
        step = kernel.optimizer_iter
        with torch.no_grad():
            out = kernel._tbe(mb.values, mb.offsets, per_sample_weights=mb.weights)
        if step is not None:  # fbgemm counts every forward; the Adam family's bias correction counts steps
            kernel.optimizer_iter = step
        return out

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad: torch.Tensor
    ) -> tuple[None, torch.Tensor | None, None, None, None]:
        kernel, mb = ctx.kernel, ctx.mb
        w_grad = weights_grad(kernel, mb, grad) if ctx.needs_input_grad[1] else None
        scaled = grad * ctx.grad_scale if ctx.grad_scale != 1.0 else grad.contiguous()
        if mb.keep is not None:
            scaled = scaled.index_select(0, mb.keep)
        if mb.grad is None:  # first backward through this lookup since the last step
            mb.grad = scaled
            kernel._pending.append(mb)
        else:  # another loss through the same lookup (retain_graph): gradients add, as .grad would
            mb.grad = mb.grad + scaled
        return None, w_grad, None, None, None


def deferred_lookup(
    kernel: DeferringKernel,
    values: torch.Tensor,
    offsets: torch.Tensor,
    weights: torch.Tensor | None,
    batch: int,
    grad_scale: float,
) -> torch.Tensor:
    """The output of ``kernel`` whose backward defers the update to ``kernel.finish_step()``."""
    kept = None if weights is None else weights.detach()
    mb = MicroBatch(values, offsets, kept, batch, per_id=kernel.pooling == "none")
    return _DeferredLookup.apply(kernel._anchor, weights, kernel, mb, grad_scale)


def weights_grad(kernel: DeferringKernel, mb: MicroBatch, grad: torch.Tensor) -> torch.Tensor:
    """Gradient of the per-sample weights: each id's row dotted with its bag's output gradient.

    The tables have not moved since the lookup (updates wait for the step), so this is the gradient fbgemm's
    backward would have given."""
    out = torch.zeros(mb.values.numel(), dtype=torch.float32, device=mb.values.device)
    b = mb.batch
    if not b or not mb.values.numel():
        return out
    bounds = mb.offsets[::b].tolist()
    lengths = mb.offsets.diff()
    tables, col = kernel.tables(), 0
    bags = torch.arange(b, device=mb.values.device)
    for f, (t, d) in enumerate(zip(kernel.feature_table, kernel.feature_dims)):
        lo, hi = bounds[f], bounds[f + 1]
        if hi > lo:
            bag = bags.repeat_interleave(lengths[f * b : (f + 1) * b])
            rows = tables[t].detach().index_select(0, mb.values[lo:hi]).float()
            out[lo:hi] = (rows * grad[bag, col : col + d].float()).sum(1)
        col += d
    return out


def union_of(
    batches: list[MicroBatch], n_features: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
    """``(values, offsets, weights, grad)`` of one feature-major batch holding every micro-batch's bags (None
    when none has a sample).

    Feature ``f``'s bags are micro-batch 0's, then 1's, ...; the gradient's rows follow (micro-batch 0's
    samples first), so the union's bag ``(f, j)`` meets the gradient of the sample it came from. Gradients with
    a row per id (no pooling) are regrouped as the ids are, so every id meets its own row."""
    batches = [mb for mb in batches if mb.batch]
    if not batches:
        return None
    if len(batches) == 1:
        mb = batches[0]
        assert mb.grad is not None
        return mb.values, mb.offsets, mb.weights, mb.grad
    weighted = any(mb.weights is not None for mb in batches)
    per_id = batches[0].per_id
    lengths, values, weights, id_grads = [], [], [], []
    for mb in batches:
        mb_lengths = mb.offsets.diff()
        bounds = mb.offsets[:: mb.batch].tolist()
        for f in range(n_features):
            lengths.append((f, mb_lengths[f * mb.batch : (f + 1) * mb.batch]))
            values.append((f, mb.values[bounds[f] : bounds[f + 1]]))
            if per_id:
                assert mb.grad is not None
                id_grads.append((f, mb.grad[bounds[f] : bounds[f + 1]]))
            if weighted:
                w = mb.weights if mb.weights is not None else torch.ones_like(mb.values, dtype=torch.float32)
                weights.append((f, w[bounds[f] : bounds[f + 1]]))

    def feature_major(pieces: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        return torch.cat([p for _, p in sorted(pieces, key=lambda fp: fp[0])])  # stable: micro-batch order kept

    union_lengths = feature_major(lengths)
    offsets = torch.zeros(union_lengths.numel() + 1, dtype=torch.long, device=union_lengths.device)
    torch.cumsum(union_lengths, 0, out=offsets[1:])
    if per_id:
        grad = feature_major(id_grads)
    else:
        grads = [mb.grad for mb in batches]
        assert all(g is not None for g in grads)
        grad = torch.cat(grads, 0)  # type: ignore[arg-type]
    return feature_major(values), offsets, feature_major(weights) if weighted else None, grad
