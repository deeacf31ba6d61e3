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
(which needs the dense norm) and loss scaling also keep the tables dense.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # the collection's types; importing them at run time would be a cycle
    from lightning_rec.embedding_modules import FeatureLayout
    from lightning_rec.fused_kinds import FusedOptimizerSpec
    from lightning_rec.pipeline.routing import RoutingTable

__all__ = ["DataParallelGradMode", "sparse_grad_blocker", "use_sparse_grads_where_possible"]


class DataParallelGradMode:
    """The gradient mode of a ``ShardedCollection``'s data-parallel tables (a mixin of that class only).

    Reads the collection's own state: ``sparse_grad``, ``_dp_sparse_auto`` / ``_dp_sparse`` (set in its
    ``__init__``), its routing, fused spec and requested kernels.
    """

    # set by ShardedCollection
    sparse_grad: bool
    _dp_sparse_auto: bool
    _dp_sparse: bool
    _routing: RoutingTable
    _fused_spec: FusedOptimizerSpec | None
    _layout: FeatureLayout
    _requested_kernels: list[str]
    _table_kernels: list[str]
    _table_dtypes: list[torch.dtype]
    _device: torch.device
    _table_param: Callable[[int], torch.Tensor]
    _resolve_kernels: Callable[[list[torch.dtype], torch.device], list[str]]
    _build_lookups: Callable[[], None]

    @property
    def _dp_sparse_grad(self) -> bool:
        """Whether the data-parallel tables' lookups make sparse gradients now."""
        return self.sparse_grad or self._dp_sparse

    def data_parallel_sparse_grad_allowed(self) -> str | None:
        """Why the data-parallel tables here cannot switch to sparse gradients by themselves (None: they can)."""
        if not self._routing.dp_tables:
            return "no data-parallel table"
        if self._fused_spec is not None:
            return "fused: updated inside backward"
        if not self._dp_sparse_auto:
            return f"sparse_grad={self.sparse_grad} was given explicitly"
        explicit = [
            self._layout.tables[ti].name for ti in self._routing.dp_tables if self._requested_kernels[ti] == "fbgemm"
        ]
        if explicit:
            return f"tables {explicit} ask for compute_kernel='fbgemm', which makes dense gradients"
        return None

    def data_parallel_weights(self) -> dict[str, torch.Tensor]:
        """``{table: weight}`` of the data-parallel (replicated) tables held as plain parameters."""
        if self._fused_spec is not None:
            return {}
        return {self._layout.tables[ti].name: self._table_param(ti) for ti in self._routing.dp_tables}

    def set_data_parallel_sparse_grad(self, sparse: bool) -> None:
        """Make the data-parallel tables' lookups produce sparse (or dense) gradients from the next forward.

        Only for a collection whose ``sparse_grad`` was left at ``None`` (auto); see
        ``lightning_rec.sharding.use_sparse_grads_where_possible``, which decides it from the optimizers.
        """
        reason = self.data_parallel_sparse_grad_allowed()
        if sparse and reason is not None:
            raise ValueError(f"cannot switch the data-parallel tables to sparse gradients: {reason}")
        if sparse == self._dp_sparse:
            return
        self._dp_sparse = sparse
        if self._fused_spec is None:
            self._table_kernels = self._resolve_kernels(self._table_dtypes, self._device)
            self._build_lookups()


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
    for path, m in model.named_modules():
        if not isinstance(m, DataParallelGradMode):
            continue
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
