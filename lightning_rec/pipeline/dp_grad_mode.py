"""The gradient mode of a sharded collection's data-parallel tables: dense, sparse, or switched to sparse later.

A collection owns one :class:`DataParallelGradMode`. It holds the mode and decides whether a switch is allowed
from what the collection tells it (its data-parallel tables, whether it is fused, which tables asked for
fbgemm's kernel); it never reads the collection. ``dp_sparse_grad.use_sparse_grads_where_possible`` decides
the switch from the optimizers.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

__all__ = ["DataParallelGradMode"]


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
