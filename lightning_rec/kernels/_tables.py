"""Containers that register tables under their own names, so state_dict keys read ``<collection>.<table>.weight``.

Table names are user data (``"user.id"``, spaces), so these are ``ModuleDict``s without its key rules, and
they check unexpected ``load_state_dict`` keys against the tables' own keys: ``nn.Module`` splits keys at the
first ``.`` to find a child, which would misreport the key of a table named ``"user.id"``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, cast

import torch

from lightning_rec import _compat


class TableKernel(Protocol):
    """What :class:`FusedTables` needs of each kernel it holds (an nn.Module whose children are its table modules,
    by name): the names, and its refusal of conversions. :class:`~lightning_rec.kernels._fused_tbe.FusedPooledKernel`
    is one; it imports this module, so naming it here would make the two modules need each other."""

    @property
    def table_names(self) -> list[str]: ...

    def _refuse_conversion(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None: ...


def unexpected_table_keys(state_dict: Mapping[str, object], prefix: str, own: Iterable[str]) -> list[str]:
    """Keys under ``prefix`` that are none of ``own`` (full keys)."""
    own = set(own)
    return [k for k in state_dict if k.startswith(prefix) and k not in own]


class TableContainer(torch.nn.Module):
    """``ModuleDict`` without its key rules: table names are user data, so ``.`` or spaces are allowed."""

    def add(self, name: str, module: torch.nn.Module) -> None:
        _compat.child_modules(self)[name] = module

    def __getitem__(self, name: str) -> torch.nn.Module:
        return _compat.child_modules(self)[name]

    def __iter__(self) -> Iterator[str]:
        return iter(_compat.child_modules(self))

    def __len__(self) -> int:
        return len(_compat.child_modules(self))

    def _load_from_state_dict(  # type: ignore[override]
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, False, missing_keys, unexpected_keys, error_msgs
        )
        if strict:
            own = [f"{prefix}{name}.{k}" for name, m in self.named_children() for k in m.state_dict(keep_vars=True)]
            unexpected_keys.extend(unexpected_table_keys(state_dict, prefix, own))


class FusedTable(torch.nn.Module):
    """Holds one table's ``weight`` (a view of the fused kernel's storage): state_dict keys read ``<table>.weight``."""

    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def _load_from_state_dict(  # type: ignore[override]
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # Always copy into the kernel's storage: load_state_dict(assign=True) would swap in a tensor the kernel
        # never sees. Unexpected keys are checked by the container (a key of table "a.b" starts with "a.").
        local_metadata = {**local_metadata, "assign_to_params_buffers": False}
        n = len(unexpected_keys)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        del unexpected_keys[n:]


class FusedTables(TableContainer):
    """The tables of several fused kernels under one module: ``<table name>.weight`` each, in ``order``.

    A sharded collection holds up to two kernels (its shards; its data-parallel tables) but one
    ``embedding_bags`` attribute, so state_dict keys stay those of the unsharded module. The kernels are not
    submodules (their tables would be registered twice); conversions are refused as each kernel refuses them.
    """

    _kernels: list[Any]  # set past nn.Module's registry

    def __init__(self, fused: Sequence[TableKernel], order: Sequence[str]) -> None:
        super().__init__()
        object.__setattr__(self, "_kernels", list(fused))
        # a kernel is an nn.Module whose child modules are its tables, by name
        held = {name: _compat.child_modules(cast(torch.nn.Module, k))[name] for k in fused for name in k.table_names}
        for name in [n for n in order if n in held] + [n for n in held if n not in set(order)]:
            self.add(name, held[name])

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> FusedTables:  # type: ignore[override]
        for k in self._kernels:
            k._refuse_conversion(fn)
        return super()._apply(fn, recurse)
