"""How a sharded collection's data-parallel tables get their gradients: dense, sparse, or switched to sparse
where the optimizers make that exact (docs/ARCHITECTURE.md, data-parallel).

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

A collection owns one :class:`DataParallelGradMode`, which holds the mode and decides whether a switch is
allowed from what the collection tells it; it never reads the collection. :func:`sparse_grad_blocker` holds
the optimizers' rules. ``shard_modules.use_sparse_grads_where_possible`` applies both to a model's
collections: it finds them through ``sharded_collections``, so it lives above the collection, and this module
below it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence

import torch

__all__ = ["DataParallelGradMode", "leaf_optimizers", "sparse_grad_blocker"]


class DataParallelGradMode:
    """``given``: the collection's ``sparse_grad`` (its argument, else the unsharded module's); ``auto``: that
    argument was left at ``None`` on a module that left its own at ``None`` too, so the data-parallel tables may
    switch to sparse gradients by themselves; ``switched``: they did.
    """

    def __init__(self, given: bool, auto: bool) -> None:
        self.given = given
        self.auto = auto
        self.switched = False

    @property
    def sparse(self) -> bool:
        """Whether the data-parallel tables' lookups make sparse gradients now."""
        return self.given or self.switched

    def blocker(self, dp_tables: Sequence[str], fused: bool, fbgemm_tables: Collection[str]) -> str | None:
        """Why the data-parallel tables ``dp_tables`` cannot switch to sparse gradients by themselves (None: they can).

        ``fused``: the collection updates its tables inside backward; ``fbgemm_tables``: the tables (of any kind)
        whose plan asked for fbgemm's kernel, which makes dense gradients only.
        """
        if not dp_tables:
            return "no data-parallel table"
        if fused:
            return "fused: updated inside backward"
        if not self.auto:
            return f"sparse_grad={self.given} was given explicitly"
        explicit = [t for t in dp_tables if t in fbgemm_tables]
        if explicit:
            return f"tables {explicit} ask for compute_kernel='fbgemm', which makes dense gradients"
        return None

    def switch(self, sparse: bool, dp_tables: Sequence[str], fused: bool, fbgemm_tables: Collection[str]) -> bool:
        """Switch to sparse (or back to dense) gradients; returns whether the mode changed (the collection's
        lookups then need building again). A switch to sparse that :meth:`blocker` forbids raises ``ValueError``.
        """
        reason = self.blocker(dp_tables, fused, fbgemm_tables)
        if sparse and reason is not None:
            raise ValueError(f"cannot switch the data-parallel tables to sparse gradients: {reason}")
        if sparse == self.switched:
            return False
        self.switched = sparse
        return True


def leaf_optimizers(optimizers: Iterable[torch.optim.Optimizer]) -> Iterator[torch.optim.Optimizer]:
    """The optimizers that hold param groups: each of ``optimizers``, or the children of a ``CombinedOptimizer``."""
    for opt in optimizers:
        inner = getattr(opt, "optimizers", None)  # CombinedOptimizer: its children own the groups
        if isinstance(inner, (list, tuple)) and inner and all(isinstance(o, torch.optim.Optimizer) for o in inner):
            yield from leaf_optimizers(inner)
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
