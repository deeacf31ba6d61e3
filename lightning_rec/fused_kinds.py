"""The fused-optimizer kinds, and which kind each embedding table trains with.

A fused optimizer updates the embedding tables inside the lookup kernel's backward (fbgemm's split
table-batched embedding; on CPU, for the kinds fbgemm's CPU build has no kernel for, the same update written in
torch: ``kernels/_torch_adam.py``). Everything the rest of the library needs to know about a kind is in
:data:`FUSED_KINDS`: the kernels (state names and shapes), the optimizer (betas, step counter, weight
decay), the planner (state bytes per row) and the callbacks. :class:`FusedOptimizerSpec` says which kind
and hyper-parameters a kernel applies.

Which spec each table trains with is one spec for every table, or a spec per table with a default
(:class:`PerTableOptimizers`): TorchRec users pick the embedding optimizer per table (row-wise Adagrad for the
huge id tables, SGD or Adam for small ones), the strategies say it with
``RecShardedStrategy(embedding_optimizer=PerTableOptimizers(default=..., tables={...}))`` (or in YAML
``{default: {kind: sgd, lr: 0.1}, tables: {big_ids: {kind: rowwise_adagrad, lr: 0.05}}}``), in-backward marks
and a sharder's ``fused_params`` per parameter / per module type. Tables sharing a spec share a kernel.

This module is a low layer: it imports nothing from ``lightning_rec`` (so ``kernels``, ``optim``,
``sharding`` and the planner can all import it without cycles).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

#: the shape of one state tensor: one value per weight value (``[rows, dim]``) or one per row (``[rows]``)
PER_VALUE = "value"
PER_ROW = "row"


@dataclass(frozen=True)
class FusedKind:
    """What one fused-optimizer kind keeps, where it runs, and who computes its update there.

    Attributes:
        name: the kind's name in :class:`FusedOptimizerSpec` (``"rowwise_adagrad"``).
        optim_type: the name of fbgemm's ``OptimType`` member (``"EXACT_ROWWISE_ADAGRAD"``).
        states: ``(state name, PER_VALUE or PER_ROW)`` in the order fbgemm's ``split_optimizer_states()``
            returns them.
        devices: device types the kind runs on.
        cpu_kernel: who applies the update on CPU: ``"fbgemm"`` (its CPU kernel: SGD and the Adagrads) or
            ``"torch"`` (fbgemm's CPU build has none: the rule of its CUDA kernel, written in torch).
        adam_family: uses ``betas`` and a global step counter (bias correction).
        weight_decay: the kind applies ``weight_decay`` (on CUDA; on CPU only where ``cpu_kernel`` is
            ``"torch"``: fbgemm's CPU kernels silently ignore it).
    """

    name: str
    optim_type: str
    states: tuple[tuple[str, str], ...]
    devices: tuple[str, ...]
    cpu_kernel: str = "fbgemm"
    adam_family: bool = False
    weight_decay: bool = False

    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.states)

    @property
    def state_per_value(self) -> int:
        """fp32 state values per weight value (the planner's memory model)."""
        return sum(1 for _, s in self.states if s == PER_VALUE)

    @property
    def state_per_row(self) -> int:
        """fp32 state values per row."""
        return sum(1 for _, s in self.states if s == PER_ROW)

    def state_shapes(self, rows: int, dim: int) -> dict[str, tuple[int, ...]]:
        """``{state name: shape}`` for a ``[rows, dim]`` table."""
        return {n: (rows, dim) if s == PER_VALUE else (rows,) for n, s in self.states}


_ADAM = (("exp_avg", PER_VALUE), ("exp_avg_sq", PER_VALUE))
_PARTIAL = (("exp_avg", PER_VALUE), ("exp_avg_sq", PER_ROW))
_BOTH = ("cpu", "cuda")


def _adam_family(name: str, optim_type: str, states: tuple[tuple[str, str], ...]) -> FusedKind:
    return FusedKind(name, optim_type, states, _BOTH, cpu_kernel="torch", adam_family=True, weight_decay=True)


FUSED_KINDS: dict[str, FusedKind] = {
    k.name: k
    for k in (
        FusedKind("sgd", "EXACT_SGD", (), _BOTH),
        FusedKind("adagrad", "EXACT_ADAGRAD", (("sum", PER_VALUE),), _BOTH),
        FusedKind("rowwise_adagrad", "EXACT_ROWWISE_ADAGRAD", (("sum", PER_ROW),), _BOTH, weight_decay=True),
        # fbgemm 1.9 has no CPU kernel for these (F1), and no OptimType for a (full) row-wise Adam
        _adam_family("adam", "ADAM", _ADAM),
        _adam_family("partial_rowwise_adam", "PARTIAL_ROWWISE_ADAM", _PARTIAL),
        _adam_family("lamb", "LAMB", _ADAM),
        _adam_family("partial_rowwise_lamb", "PARTIAL_ROWWISE_LAMB", _PARTIAL),
    )
}
KINDS = tuple(FUSED_KINDS)
#: kinds that run on CPU (every kind)
CPU_KINDS = tuple(k for k, v in FUSED_KINDS.items() if "cpu" in v.devices)
#: kinds whose CPU update is fbgemm's CPU kernel
FBGEMM_CPU_KINDS = tuple(k for k in CPU_KINDS if FUSED_KINDS[k].cpu_kernel == "fbgemm")
#: kinds whose CPU update is fbgemm's CUDA rule written in torch (``kernels/_torch_adam.py``): no fbgemm needed
TORCH_CPU_KINDS = tuple(k for k in CPU_KINDS if FUSED_KINDS[k].cpu_kernel == "torch")
#: kinds that use ``betas`` (and a global step counter for bias correction)
ADAM_FAMILY = tuple(k for k, v in FUSED_KINDS.items() if v.adam_family)
#: kinds that apply ``weight_decay`` (on CUDA; on CPU those of :data:`TORCH_CPU_KINDS`)
WEIGHT_DECAY_KINDS = tuple(k for k, v in FUSED_KINDS.items() if v.weight_decay)


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@dataclass(frozen=True)
class FusedOptimizerSpec:
    """Which fused optimizer a :class:`~lightning_rec.kernels.FusedPooledKernel` applies in its backward.

    Args:
        kind: ``"sgd"``, ``"adagrad"``, ``"rowwise_adagrad"`` (fbgemm's kernels on CPU and CUDA); ``"adam"``,
            ``"partial_rowwise_adam"``, ``"lamb"`` or ``"partial_rowwise_lamb"`` (fbgemm's kernel on CUDA; on CPU
            its rule in torch, touched rows only, same state: ``kernels/_torch_adam.py``).
            ``"adagrad"`` equals ``torch.optim.Adagrad(lr, eps=eps, initial_accumulator_value=0)``;
            ``"rowwise_adagrad"`` keeps one accumulator per row: ``m[r] += mean_d(g[r]**2)``,
            ``w[r] -= lr * g[r] / (sqrt(m[r]) + eps)``.
        lr: initial learning rate (a :class:`FusedOptimizer`'s ``param_groups`` then own it).
        eps: fbgemm's default ``1e-8`` (``torch.optim.Adagrad`` defaults to ``1e-10``).
        betas: Adam-family only.
        weight_decay: ``rowwise_adagrad`` applies it as L2 (added to the gradient, like
            ``torch.optim.Adagrad``), on CUDA only (fbgemm's CPU kernel silently ignores it, so it is refused
            there); the Adam family on CPU and CUDA: ``adam`` decouples it (``w -= lr * (update + wd * w)``,
            AdamW-style); ``lamb`` adds it to the update the trust ratio scales.
        stochastic_rounding: fp16 tables only: round updates stochastically (fbgemm's and TorchRec's
            default) instead of to nearest.
    """

    kind: str
    lr: float
    eps: float = 1e-8
    betas: tuple[float, float] | None = None
    weight_decay: float = 0.0
    stochastic_rounding: bool = True

    def __post_init__(self) -> None:
        if self.kind not in FUSED_KINDS:
            raise ValueError(f"unknown fused optimizer kind {self.kind!r}; expected one of {list(KINDS)}")
        if not (_number(self.lr) and self.lr >= 0):
            raise ValueError(f"fused optimizer {self.kind!r}: lr must be a finite number >= 0, got {self.lr!r}")
        if not (_number(self.eps) and self.eps > 0):
            raise ValueError(f"fused optimizer {self.kind!r}: eps must be a finite number > 0, got {self.eps!r}")
        if not (_number(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(
                f"fused optimizer {self.kind!r}: weight_decay must be a finite number >= 0, got {self.weight_decay!r}"
            )
        if self.betas is not None:
            if self.kind not in ADAM_FAMILY:
                raise ValueError(
                    f"fused optimizer {self.kind!r} has no betas (they apply to {list(ADAM_FAMILY)}); "
                    f"got betas={self.betas!r}"
                )
            betas = tuple(self.betas)
            if len(betas) != 2 or not all(_number(b) and 0 <= b < 1 for b in betas):
                raise ValueError(
                    f"fused optimizer {self.kind!r}: betas must be two numbers in [0, 1), got {self.betas!r}"
                )
            object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        if self.weight_decay and self.kind not in WEIGHT_DECAY_KINDS:
            raise ValueError(
                f"fused optimizer {self.kind!r} does not support weight_decay (fbgemm's {self.kind} kernel has none; "
                f"kinds with weight decay: {list(WEIGHT_DECAY_KINDS)}); got weight_decay={self.weight_decay}"
            )

    @property
    def info(self) -> FusedKind:
        """This spec's row of :data:`FUSED_KINDS`."""
        return FUSED_KINDS[self.kind]

    def check_device(self, device: torch.device | str | None) -> torch.device:
        """Raise a ValueError naming the kind, the device and what that device supports; return the device."""
        dev = torch.device("cpu" if device is None else device)
        if dev.type not in self.info.devices:
            raise ValueError(
                f"fused optimizer {self.kind!r} cannot run on device {dev}: fused kernels exist for cpu "
                f"({list(CPU_KINDS)}) and cuda ({list(KINDS)})"
            )
        if dev.type == "cpu" and self.weight_decay and self.kind in FBGEMM_CPU_KINDS:
            raise ValueError(
                f"fused optimizer {self.kind!r}: weight_decay={self.weight_decay} is not supported on device "
                f"{dev}: fbgemm's CPU kernels silently ignore weight decay. Use weight_decay=0 with {self.kind!r} "
                f"on CPU, or a kind whose CPU update applies it: {list(TORCH_CPU_KINDS)}"
            )
        return dev

    def validate(self, device: torch.device | str | None) -> Any:
        """Check this spec can run on ``device``; return fbgemm's ``OptimType`` for it.

        Raises a ValueError naming the kind, the device and the kinds that device supports.
        """
        # fbgemm takes seconds to import and only fused kernels need it: import it when one is built
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType  # noqa: PLC0415

        self.check_device(device)
        return getattr(OptimType, self.info.optim_type)


def as_spec(x: FusedOptimizerSpec | Mapping[str, Any] | None) -> FusedOptimizerSpec | None:
    """Accept a spec, a dict such as ``{"kind": "rowwise_adagrad", "lr": 0.1}``, or None (no fused optimizer)."""
    if x is None or isinstance(x, FusedOptimizerSpec):
        return x
    if isinstance(x, Mapping):
        names = [f.name for f in fields(FusedOptimizerSpec)]
        unknown = sorted(str(k) for k in x if k not in names)
        if unknown:
            raise ValueError(f"unknown fused optimizer options {unknown}; expected some of {names}")
        missing = [k for k in ("kind", "lr") if k not in x]
        if missing:
            raise ValueError(f"fused optimizer options need {missing}; got {dict(x)}")
        return FusedOptimizerSpec(**x)
    raise TypeError(f"expected a FusedOptimizerSpec, a dict of its fields, or None; got {type(x).__name__}")


#: a collection's tables -> their fused spec (None: the table is an ordinary parameter)
TableSpecs = dict[str, FusedOptimizerSpec | None]


@dataclass(frozen=True)
class PerTableOptimizers:
    """A fused optimizer per table name, and a default for the tables not named.

    Args:
        default: the spec of every table not in ``tables`` (None: those tables are ordinary parameters, trained
            by the optimizers of ``configure_optimizers``).
        tables: ``{table name: spec or None}``; a name applies to the tables of that name in every collection.
            Specs may be :class:`FusedOptimizerSpec` objects or dicts of their fields.
    """

    default: FusedOptimizerSpec | None = None
    tables: Mapping[str, FusedOptimizerSpec | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "default", as_spec(self.default))
        if not isinstance(self.tables, Mapping):
            kind = type(self.tables).__name__
            raise TypeError(f"PerTableOptimizers.tables must map table names to specs, got {kind}")
        specs: dict[str, FusedOptimizerSpec | None] = {}
        for name, spec in self.tables.items():
            if not isinstance(name, str):
                raise TypeError(f"PerTableOptimizers.tables: table names are strings, got {name!r}")
            try:
                specs[name] = as_spec(spec)
            except (TypeError, ValueError) as e:
                raise type(e)(f"table {name!r}: {e}") from None
        object.__setattr__(self, "tables", specs)

    def __hash__(self) -> int:
        return hash((self.default, tuple(sorted(self.tables.items(), key=lambda kv: kv[0]))))

    def spec_of(self, table: str) -> FusedOptimizerSpec | None:
        """The spec table ``table`` trains with."""
        return self.tables.get(table, self.default)


EmbeddingOptimizer = FusedOptimizerSpec | PerTableOptimizers


def as_table_optimizers(x: Any) -> EmbeddingOptimizer | None:
    """The strategy's ``embedding_optimizer`` option, checked: None, one spec (or a dict of its fields), or a spec
    per table (:class:`PerTableOptimizers`, or a dict with the keys ``tables`` and, optionally, ``default``)."""
    if x is None or isinstance(x, (FusedOptimizerSpec, PerTableOptimizers)):
        return x
    if isinstance(x, Mapping) and "kind" not in x and "tables" in x:
        unknown = sorted(str(k) for k in x if k not in ("default", "tables"))
        if unknown:
            raise ValueError(
                f"per-table embedding_optimizer: unknown keys {unknown}; expected 'tables' (table name -> spec) "
                "and optionally 'default'"
            )
        return PerTableOptimizers(default=x.get("default"), tables=x["tables"])
    return as_spec(x)


def spec_of(option: EmbeddingOptimizer | None, table: str) -> FusedOptimizerSpec | None:
    """The spec ``option`` gives table ``table``."""
    if isinstance(option, PerTableOptimizers):
        return option.spec_of(table)
    return option


def named_tables(option: EmbeddingOptimizer | None) -> list[str]:
    """The table names ``option`` names explicitly (checked against the model's tables at sharding)."""
    return list(option.tables) if isinstance(option, PerTableOptimizers) else []


def summary(specs: Mapping[str, TableSpecs]) -> EmbeddingOptimizer | None:
    """What the model's tables train with, said once: None (nothing fused), the one spec of every fused table, or a
    :class:`PerTableOptimizers` naming each fused table's."""
    fused = {t: s for per in specs.values() for t, s in per.items() if s is not None}
    distinct = set(fused.values())
    if len(distinct) <= 1:
        return next(iter(distinct), None)
    return PerTableOptimizers(tables=fused)
