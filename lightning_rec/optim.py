"""Fused (in-backward) embedding optimizers, exposed to Lightning as an ordinary ``torch.optim.Optimizer``.

A fused optimizer updates the embedding tables *inside* the lookup kernel's backward
(:class:`lightning_rec.kernels.FusedPooledKernel`): no gradient is ever materialised, which is the fastest
path on CPU and CUDA. :class:`FusedOptimizer` is the handle Lightning steps,
schedules and checkpoints:

- ``param_groups``: one group per kernel, holding that kernel's table parameters and its ``lr``. While a
  ``FusedOptimizer`` drives a kernel, the group's ``lr`` *is* the kernel's learning rate: the kernel reads it
  at every forward (fbgemm captures the learning rate at forward), so an LR scheduler, or a plain
  ``param_groups[i]["lr"] = x``, takes effect at the next lookup.
- ``step(closure)`` runs the closure (forward + backward: that is when the update happens), then marks the
  end of the training step, re-arming the kernels' accumulation guard.
- ``zero_grad`` does nothing: there are no gradients.
- ``state_dict`` / ``load_state_dict`` carry the optimizer state per table *name*, so a checkpoint loads into
  kernels that list (or group) the tables differently.

- ``accumulate``: off (default), the update happens inside backward and a second backward before the step
  raises; on, backward keeps each lookup's gradient and ``step`` applies one update from their sum (gradient
  accumulation, several losses per step: exactly the update of the summed gradient;
  ``lightning_rec.kernels._accumulate`` says what it keeps). ``RecShardedStrategy`` turns it on for
  ``accumulate_grad_batches > 1``.

What a fused update cannot do, it refuses loudly: outside accumulation mode, a second backward before the
step raises in backward (the kernel has already applied the first update), weight decay raises on CPU for
the kinds fbgemm's CPU kernels serve (they silently ignore it; the Adam family on CPU runs fbgemm's CUDA rule in
torch and applies it), a kind whose kernel
the installed fbgemm build lacks for the device raises at construction naming the package to install, and a
checkpoint whose tables or shapes differ raises naming the table.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from lightning_rec.fused_kinds import (
    ADAM_FAMILY,
    CPU_KINDS,
    FUSED_KINDS,
    KINDS,
    FusedKind,
    FusedOptimizerSpec,
    as_spec,
)
from lightning_rec.kernels import FusedPooledKernel

# the kind table and the spec live in the low layer ``fused_kinds``; re-exported here, where users look for them
__all__ = [
    "ADAM_FAMILY",
    "CPU_KINDS",
    "FUSED_KINDS",
    "KINDS",
    "CombinedOptimizer",
    "FusedKind",
    "FusedOptimizer",
    "FusedOptimizerSpec",
    "as_spec",
]


class FusedOptimizer(torch.optim.Optimizer):
    """The optimizer handle of one or more :class:`~lightning_rec.kernels.FusedPooledKernel`.

    The kernels update their tables inside backward; this object is what a training loop (or Lightning's
    ``configure_optimizers``) steps, schedules and checkpoints. It holds one ``param_group`` per kernel with
    the kernel's table parameters (views of the kernel's storage; their ``.grad`` stays None) and ``lr``.
    It starts from each kernel's current learning rate (the spec's ``lr`` unless changed).

    Building a ``FusedOptimizer`` over a kernel makes it the kernel's driver (a newer one takes over from an
    older one, whose ``step`` then raises).

    ``state_dict()`` is ``{"param_groups": [{"lr", "kind", "tables", ... (any scheduler keys such as
    ``initial_lr``), "iter" (Adam family)}], "tables": {table_name: {state_name: tensor}}}``; the state names
    are ``"sum"`` (Adagrad kinds; ``[rows, dim]`` or ``[rows]`` for rowwise), ``"exp_avg"`` /
    ``"exp_avg_sq"`` (Adam family) and none for SGD. The tensors alias the live kernel state, as a torch
    optimizer's do.
    """

    def __init__(
        self,
        kernels: FusedPooledKernel | Iterable[FusedPooledKernel],
        prefixes: Iterable[str] | None = None,
    ) -> None:
        if isinstance(kernels, FusedPooledKernel):
            kernels = [kernels]
        kernels = list(kernels)
        # state is keyed by "<prefix><table>": a module path as prefix tells apart same-named tables of two
        # collections
        prefixes = [""] * len(kernels) if prefixes is None else list(prefixes)
        if len(prefixes) != len(kernels):
            raise ValueError(f"FusedOptimizer got {len(prefixes)} prefixes for {len(kernels)} kernels")
        if not kernels:
            raise ValueError("FusedOptimizer needs at least one FusedPooledKernel")
        for k in kernels:
            if not isinstance(k, FusedPooledKernel):
                raise TypeError(f"FusedOptimizer takes FusedPooledKernel objects, got {type(k).__name__}")
        if len({id(k) for k in kernels}) != len(kernels):
            raise ValueError("FusedOptimizer got the same FusedPooledKernel twice")
        owner: dict[str, int] = {}
        for i, (k, prefix) in enumerate(zip(kernels, prefixes)):
            for name in k.table_names:
                if prefix + name in owner:
                    raise ValueError(
                        f"table {prefix + name!r} appears in kernels {owner[prefix + name]} and {i}; a FusedOptimizer "
                        "keys its state by table name, so table names must be unique across its kernels (give "
                        "kernels of different modules different prefixes)"
                    )
                owner[prefix + name] = i
        self._kernels = kernels
        self._prefixes = prefixes
        self._building = True
        groups = [{"params": k.tables(), "lr": k.get_learning_rate(), "kind": k.spec.kind} for k in kernels]
        super().__init__(groups, {"lr": groups[0]["lr"]})
        self._building = False
        self._attach_kernels()

    def _attach_kernels(self) -> None:
        ref = weakref.ref(self)
        self.state.clear()
        for i, k in enumerate(self._kernels):
            k._attach(ref, i)
            # views of the live kernel state, for introspection (the checkpoint goes through state_dict())
            for p, states in zip(k.tables(), k.optimizer_states().values()):
                self.state[p] = dict(states)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_kernels"] = self._kernels
        state["_prefixes"] = self._prefixes
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        kernels = state.pop("_kernels", [])
        prefixes = state.pop("_prefixes", [""] * len(kernels))
        super().__setstate__(state)
        self._kernels = kernels
        self._prefixes = prefixes
        self._building = False
        # a deep copy of the optimizer copies its kernels: drive the copies (the originals keep their driver)
        if all(k._owner is None for k in kernels):
            self._attach_kernels()

    @property
    def kernels(self) -> list[FusedPooledKernel]:
        return list(self._kernels)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_building", False):
            raise RuntimeError(
                "FusedOptimizer has exactly one param group per FusedPooledKernel and cannot take other "
                "parameters; optimize dense parameters with a separate torch optimizer"
            )
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op: a fused optimizer never materialises gradients (kept ones belong to the next step)."""

    @property
    def accumulate(self) -> bool:
        """Accumulation mode of every kernel: k backward passes, then :meth:`step`, make one update from the
        sum of their gradients (see ``FusedPooledKernel.accumulate``)."""
        return all(k.accumulate for k in self._kernels)

    @accumulate.setter
    def accumulate(self, on: bool) -> None:
        for k in self._kernels:
            k.accumulate = on

    def pending_bytes(self) -> int:
        """Bytes the kernels keep for the next step's update (accumulation mode)."""
        return sum(k.pending_bytes() for k in self._kernels)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run ``closure`` (forward + backward: the kernels update their tables there), then end the step.

        Ending the step pushes each group's ``lr`` into its kernel, applies the gradients kept since the last
        step (accumulation mode: one update from their sum, at this ``lr``) and re-arms the kernels' guard
        against a second backward before the next step.
        """
        for i, k in enumerate(self._kernels):
            if not k._owned_by(self, i):
                raise RuntimeError(
                    f"this FusedOptimizer no longer drives the kernel with tables {k.table_names}: a newer "
                    "FusedOptimizer was built over it; step that one"
                )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, k in zip(self.param_groups, self._kernels):
            k.set_learning_rate(group["lr"])
            k.finish_step()
        return loss

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        pending = sum(k.pending_lookups for k in self._kernels)
        if pending:
            # like a torch optimizer's state_dict, which never holds .grad: the kept gradients are not saved
            warnings.warn(
                f"FusedOptimizer.state_dict() between micro-batches: the gradients of {pending} lookups wait for "
                "the next step and are not part of the state; a checkpoint taken now resumes from the start of "
                "this step's accumulation (Lightning saves only at step boundaries)",
                stacklevel=2,
            )
        groups, tables = [], {}
        for i, (group, k) in enumerate(zip(self.param_groups, self._kernels)):
            entry = {key: v for key, v in group.items() if key != "params"}
            entry["kind"] = k.spec.kind
            entry["tables"] = self.table_names(i)
            step = k.optimizer_iter
            if step is not None:
                entry["iter"] = step
            groups.append(entry)
            tables.update({self._prefixes[i] + n: st for n, st in k.optimizer_states().items()})
        return {"param_groups": groups, "tables": tables}

    def table_names(self, i: int) -> list[str]:
        """Kernel ``i``'s table names as this optimizer's state keys them."""
        return [self._prefixes[i] + n for n in self._kernels[i].table_names]

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Load a :meth:`state_dict`, matching tables by name. Checks everything before changing anything."""
        if not isinstance(state_dict, Mapping) or "tables" not in state_dict or "param_groups" not in state_dict:
            keys = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__
            raise ValueError(f"not a FusedOptimizer state_dict (expected keys 'param_groups' and 'tables', got {keys})")
        saved_tables = state_dict["tables"]
        mine = {name: k for i, k in enumerate(self._kernels) for name in self.table_names(i)}
        missing = [n for n in mine if n not in saved_tables]
        unexpected = [n for n in saved_tables if n not in mine]
        if missing or unexpected:
            raise ValueError(
                f"fused optimizer state does not match the tables: missing from the checkpoint {missing}, "
                f"unexpected in the checkpoint {unexpected}"
            )
        group_of: dict[str, Mapping[str, Any]] = {}
        for g in state_dict["param_groups"]:
            for name in g.get("tables", []):
                group_of[name] = g
        for name, k in mine.items():
            g = group_of.get(name)
            if g is None:
                raise ValueError(f"fused optimizer state: table {name!r} is in no saved param group")
            if g.get("kind", k.spec.kind) != k.spec.kind:
                raise ValueError(
                    f"table {name!r}: the checkpoint's fused optimizer is {g.get('kind')!r} but this one is "
                    f"{k.spec.kind!r}"
                )

        def local(i: int) -> dict[str, Any]:
            return {n: saved_tables[q] for n, q in zip(self._kernels[i].table_names, self.table_names(i))}

        for i in range(len(self._kernels)):
            self._kernels[i]._check_optimizer_states(local(i))
        # everything checked: apply
        for i, (group, k) in enumerate(zip(self.param_groups, self._kernels)):
            k.load_optimizer_states(local(i))
            saved = group_of[self.table_names(i)[0]]
            for key, v in saved.items():
                if key not in ("params", "tables", "kind", "iter"):
                    group[key] = v
            if "iter" in saved and k.optimizer_iter is not None:
                k.optimizer_iter = int(saved["iter"])
            k.set_learning_rate(group["lr"])


class CombinedOptimizer(torch.optim.Optimizer):
    """Several optimizers stepped, zeroed, scheduled and checkpointed as one.

    Lightning's automatic optimization steps one optimizer per training step, so a dense optimizer and a
    :class:`FusedOptimizer` are combined: ``param_groups`` is the concatenation of the children's group
    dicts (the same objects), so an LR scheduler built on the combined optimizer changes every child's
    learning rate, the fused kernels' included.

    Example::

        def configure_optimizers(self):
            opt = CombinedOptimizer([torch.optim.Adam(self.head.parameters()), self.fused_optimizer()])
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 10)}
    """

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer | None]) -> None:
        self.optimizers = [o for o in optimizers if o is not None]
        if not self.optimizers:
            raise ValueError("CombinedOptimizer needs at least one optimizer")
        self.defaults: dict[str, Any] = {}
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}

    @property  # type: ignore[override]  # torch declares state a plain attribute
    def state(self) -> dict:
        merged: dict = {}
        for o in self.optimizers:
            merged.update(o.state)
        return merged

    @state.setter
    def state(self, value: dict) -> None:  # torch's Optimizer machinery may assign; the children own state
        pass

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError("add param groups to the child optimizers before combining them")

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.optimizers:
            o.step()
        return loss

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        states = state_dict.get("optimizers")
        if states is None or len(states) != len(self.optimizers):
            raise ValueError(
                f"CombinedOptimizer state holds {None if states is None else len(states)} optimizers, "
                f"this one combines {len(self.optimizers)}"
            )
        for o, s in zip(self.optimizers, states):
            o.load_state_dict(s)
