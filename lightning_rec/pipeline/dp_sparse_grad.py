"""Sparse gradients for data-parallel tables where the optimizer allows it (docs/ARCHITECTURE.md, data-parallel).

A data-parallel table with dense gradients costs a whole-table optimizer step and ``zero_grad`` on every
rank, every step. With a sparse gradient only the rows some rank touched are summed, stepped and zeroed.
That is exact only for optimizers whose update of a row with zero gradient is nothing at all:

* ``torch.optim.SGD`` without momentum or weight decay (``p -= lr * g``);
* ``torch.optim.Adagrad`` without weight decay (a zero gradient changes neither the sum of squares nor
  the row);
* ``torch.optim.SparseAdam`` (made for sparse gradients).

Everything else stays dense: weight decay and Adam-like moments move untouched rows too, and SGD's sparse
momentum buffer grows to every row ever touched (same result, no faster than dense). Gradient clipping
(which needs the dense norm) and loss scaling also keep the tables dense. Each collection holds its tables'
mode in a ``dp_grad_mode.DataParallelGradMode``; this module only decides the switch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from lightning_rec.pipeline.shard_modules import sharded_collections

__all__ = ["sparse_grad_blocker", "use_sparse_grads_where_possible"]


def _leaf_optimizers(optimizers: Iterable[torch.optim.Optimizer]) -> Iterator[torch.optim.Optimizer]:
    for opt in optimizers:
        inner = getattr(opt, "optimizers", None)  # CombinedOptimizer: its children own the groups
        if isinstance(inner, (list, tuple)) and inner and all(isinstance(o, torch.optim.Optimizer) for o in inner):
            yield from _leaf_optimizers(inner)
        else:
            yield opt


def sparse_grad_blocker(opt: torch.optim.Optimizer, group: dict) -> str | None:
    """Why ``group`` of ``opt`` cannot take sparse gradients with the dense result (None: it can)."""
    kind = type(opt)  # exact types: a subclass may override step()
    if group.get("fused") or group.get("capturable"):
        return f"{kind.__name__}(fused/capturable) has no sparse path"
    if kind is torch.optim.SparseAdam:
        return None
    if kind is torch.optim.SGD:
        if group.get("weight_decay", 0) != 0:
            return "SGD with weight_decay updates every row"
        if group.get("momentum", 0) != 0:
            return "SGD with momentum keeps moving untouched rows (its sparse buffer grows to every row touched)"
        return None
    if kind is torch.optim.Adagrad:
        if group.get("weight_decay", 0) != 0:
            return "Adagrad with weight_decay updates every row"
        return None
    return f"{kind.__name__} is not known to be exact with sparse gradients"


def use_sparse_grads_where_possible(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    gradient_clipping: bool = False,
    grad_scaler: object | None = None,
) -> dict[str, str | None]:
    """Switch the data-parallel tables of every sharded collection in ``model`` to sparse gradients where exact.

    Call it once after ``shard_modules`` and after building the optimizers (``RecShardedStrategy`` does it
    itself when fitting). A collection switches only if its ``sparse_grad`` was left at ``None`` and every
    optimizer param group holding one of its data-parallel tables allows it (see the module docstring); a
    table in no optimizer keeps it dense. ``gradient_clipping=True`` or a ``grad_scaler`` keep every table
    dense. Returns ``{collection path: None if now sparse, else why it stays dense}``.
    """
    opts = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
    groups = {id(p): (opt, g) for opt in _leaf_optimizers(opts) for g in opt.param_groups for p in g["params"]}
    decided: dict[str, str | None] = {}
    for path, m in sharded_collections(model):
        reason = m.data_parallel_sparse_grad_allowed()
        if reason is None and gradient_clipping:
            reason = "gradient clipping needs dense gradients"
        if reason is None and grad_scaler is not None:
            reason = "a GradScaler scales the loss"
        if reason is None:
            for name, w in m.data_parallel_weights().items():
                found = groups.get(id(w))
                reason = f"table {name!r} is in no optimizer" if found is None else sparse_grad_blocker(*found)
                if reason is not None:
                    break
        if m.data_parallel_sparse_grad_allowed() is None:
            m.set_data_parallel_sparse_grad(reason is None)
        decided[path] = reason
    return decided
