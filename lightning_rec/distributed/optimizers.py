"""TorchRec's optimizer names for a loop without Lightning: in-backward optimizers, a keyed wrapper, RowWiseAdagrad.

``apply_optimizer_in_backward(optimizer_class, params, optimizer_kwargs)`` marks parameters the way
``torch.distributed.optim._apply_optimizer_in_backward`` does (TorchRec's golden example calls torch's), so
either function works: on an unsharded model the optimizer steps each parameter inside backward; when
:class:`~lightning_rec.distributed.DistributedModelParallel` shards a collection whose tables carry such an
optimizer, :func:`in_backward_specs` maps it to the fused fbgemm kernel of the same maths.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from lightning_rec.fused_kinds import FUSED_KINDS, FusedOptimizerSpec, as_spec


class RowWiseAdagrad(torch.optim.Optimizer):
    """Adagrad with one accumulator per row (TorchRec's ``RowWiseAdagrad``, same arguments and defaults).

    For a ``[rows, dim]`` parameter: ``m[r] += mean_d(g[r] ** 2)``, ``w[r] -= clr * g[r] / (sqrt(m[r]) + eps)``
    with ``clr = lr / (1 + (step - 1) * lr_decay)`` and ``g += weight_decay * w`` first. A 1-D parameter has
    one row per element. This is the update of the fused ``"rowwise_adagrad"`` kernel, so a model trained
    unsharded with it matches one trained sharded with the fused kernel.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        maximize: bool = False,
        **unused: Any,
    ) -> None:
        for name, v in (
            ("lr", lr),
            ("lr_decay", lr_decay),
            ("weight_decay", weight_decay),
            ("initial_accumulator_value", initial_accumulator_value),
            ("eps", eps),
        ):
            if not v >= 0.0:
                raise ValueError(f"RowWiseAdagrad: {name} must be >= 0, got {v}")
        defaults = dict(
            lr=lr,
            lr_decay=lr_decay,
            weight_decay=weight_decay,
            eps=eps,
            maximize=maximize,
            initial_accumulator_value=initial_accumulator_value,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
                grad = -grad if group["maximize"] else grad
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["sum"] = torch.full(
                        (p.shape[0] if p.dim() else 1,),
                        group["initial_accumulator_value"],
                        dtype=torch.float32,
                        device=p.device,
                    )
                state["step"] += 1
                rows = grad.reshape(state["sum"].numel(), -1).float()
                w = p.view(rows.shape)
                if group["weight_decay"]:
                    rows = rows + group["weight_decay"] * w.float()
                clr = group["lr"] / (1 + (state["step"].item() - 1) * group["lr_decay"])
                state["sum"].add_(rows.pow(2).mean(dim=1))
                w.sub_((clr * rows / (state["sum"].sqrt() + group["eps"]).unsqueeze(1)).to(p.dtype))
        return loss


def _step_in_backward(param: torch.Tensor) -> None:
    for opt in param._in_backward_optimizers:  # type: ignore[attr-defined]
        opt.step()
    param.grad = None


def apply_optimizer_in_backward(
    optimizer_class: type[torch.optim.Optimizer],
    params: Iterable[torch.Tensor],
    optimizer_kwargs: Mapping[str, Any],
) -> None:
    """Step ``optimizer_class(**optimizer_kwargs)`` on each parameter as soon as its gradient is accumulated.

    Same effect and the same parameter attributes (``_in_backward_optimizers``, ``_optimizer_classes``,
    ``_optimizer_kwargs``) as torch's ``_apply_optimizer_in_backward``; the gradient is set to None after the
    step. ``DistributedModelParallel`` turns the optimizer of an embedding collection's tables into the fused
    kernel's (SGD, Adagrad, RowWiseAdagrad, Adam).
    """
    for p in params:
        opt = optimizer_class([p], **optimizer_kwargs)
        if not hasattr(p, "_in_backward_optimizers"):
            p._in_backward_optimizers = []  # type: ignore[attr-defined]
            p._optimizer_classes = []  # type: ignore[attr-defined]
            p._optimizer_kwargs = []  # type: ignore[attr-defined]
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(_step_in_backward)
        p._in_backward_optimizers.append(opt)  # type: ignore[attr-defined]
        p._optimizer_classes.append(optimizer_class)  # type: ignore[attr-defined]
        p._optimizer_kwargs.append(dict(optimizer_kwargs))  # type: ignore[attr-defined]


def in_backward_optimizer_filter(
    named_parameters: Iterable[tuple[str, torch.Tensor]], include: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """The ``(name, param)`` pairs without an in-backward optimizer (``include=True``: only those with one).

    Fused tables of a ``DistributedModelParallel`` count as having one.
    """
    for name, p in named_parameters:
        if hasattr(p, "_in_backward_optimizers") == include:
            yield name, p


# -- torch optimizer class -> fused kernel kind --------------------------------------------------------------
def _defaults(cls: type[Any]) -> dict[str, Any]:
    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return {}
    return {k: p.default for k, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}


# per kind: the options that must keep their neutral value for the fused kernel to do the same maths
_NEUTRAL: dict[str, dict[str, object]] = {
    "sgd": {"momentum": 0, "dampening": 0, "weight_decay": 0, "nesterov": False, "maximize": False},
    "adagrad": {"lr_decay": 0, "weight_decay": 0, "initial_accumulator_value": 0, "maximize": False},
    "rowwise_adagrad": {"lr_decay": 0, "initial_accumulator_value": 0, "maximize": False},
    "adam": {"amsgrad": False, "maximize": False},
}


def _kind_of_class(cls: type) -> str | None:
    if isinstance(cls, type) and issubclass(cls, torch.optim.SGD):
        return "sgd"
    if isinstance(cls, type) and issubclass(cls, torch.optim.Adagrad):
        return "adagrad"
    if isinstance(cls, type) and issubclass(cls, torch.optim.Adam):
        return "adam"
    if getattr(cls, "__name__", "") == "RowWiseAdagrad":  # ours, or TorchRec's class of the same maths
        return "rowwise_adagrad"
    return None


def spec_from_optimizer(optimizer_class: type, optimizer_kwargs: Mapping[str, Any]) -> FusedOptimizerSpec:
    """The fused kernel spec doing what ``optimizer_class(params, **optimizer_kwargs)`` does to a table.

    Raises a ValueError naming the class and option the fused kernels cannot honour.
    """
    kind = _kind_of_class(optimizer_class)
    name = getattr(optimizer_class, "__name__", repr(optimizer_class))
    if kind is None:
        raise ValueError(
            f"in-backward optimizer {name} has no fused embedding kernel; use torch.optim.SGD, "
            "torch.optim.Adagrad, RowWiseAdagrad or torch.optim.Adam"
        )
    opts = {**_defaults(optimizer_class), **dict(optimizer_kwargs)}
    for key, neutral in _NEUTRAL[kind].items():
        if key in opts and opts[key] not in (neutral, None):
            raise ValueError(
                f"in-backward optimizer {name}: {key}={opts[key]!r} is not supported by the fused "
                f"{kind} kernel (only {key}={neutral!r})"
            )
    known = {
        "params",
        "self",
        "lr",
        "eps",
        "betas",
        "weight_decay",
        "foreach",
        "differentiable",
        "fused",
        "capturable",
        "unused",
        *_NEUTRAL[kind],
    }
    unknown = sorted(k for k in dict(optimizer_kwargs) if k not in known)
    if unknown:
        raise ValueError(f"in-backward optimizer {name}: options {unknown} are not supported by the fused kernel")
    lr = opts.get("lr")
    spec: dict[str, Any] = {"kind": kind, "lr": float(lr) if lr is not None else 0.01}
    if opts.get("eps") is not None and kind != "sgd":
        spec["eps"] = float(opts["eps"])
    if kind == "adam":
        spec["betas"] = tuple(opts.get("betas", (0.9, 0.999)))
    if opts.get("weight_decay") and kind in ("rowwise_adagrad", "adam"):
        spec["weight_decay"] = float(opts["weight_decay"])
    return FusedOptimizerSpec(**spec)


# TorchRec's fused_params keys -> FusedOptimizerSpec fields
_FUSED_PARAM_KEYS = {
    "learning_rate": "lr",
    "lr": "lr",
    "eps": "eps",
    "weight_decay": "weight_decay",
    "stochastic_rounding": "stochastic_rounding",
}
_OPTIM_TYPE_TO_KIND = {k.optim_type: name for name, k in FUSED_KINDS.items()}
_OPTIM_TYPE_TO_KIND.update({"ROWWISE_ADAGRAD": "rowwise_adagrad", "ADAGRAD": "adagrad", "SGD": "sgd"})


def spec_from_fused_params(fused_params: Mapping[str, Any]) -> FusedOptimizerSpec | None:
    """A fused spec from TorchRec's ``fused_params`` (``{"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    "learning_rate": 0.1, "eps": ...}``); ``optimizer`` may also be a kind string or an optimizer class.
    None when no optimizer is given. Unknown keys raise."""
    params = dict(fused_params)
    opt = params.pop("optimizer", None)
    unknown = sorted(k for k in params if k not in _FUSED_PARAM_KEYS and k not in ("beta1", "beta2"))
    if unknown:
        raise ValueError(
            f"fused_params {unknown} are not supported; lightning_rec takes 'optimizer' with "
            f"{sorted(_FUSED_PARAM_KEYS)} and beta1 / beta2"
        )
    if opt is None:
        if params:
            raise ValueError(f"fused_params {sorted(params)} given without an 'optimizer'")
        return None
    spec = {_FUSED_PARAM_KEYS[k]: v for k, v in params.items() if k in _FUSED_PARAM_KEYS}
    if "beta1" in params or "beta2" in params:
        spec["betas"] = (params.get("beta1", 0.9), params.get("beta2", 0.999))
    if isinstance(opt, type):
        base = spec_from_optimizer(opt, {"lr": spec.pop("lr", 0.01)})
        return as_spec({**{f: getattr(base, f) for f in ("kind", "lr", "eps", "betas")}, **spec})
    name = getattr(opt, "name", str(opt))
    kind = opt if opt in FUSED_KINDS else _OPTIM_TYPE_TO_KIND.get(str(name).upper())
    if kind is None:
        raise ValueError(
            f"fused_params optimizer {opt!r} is not a fused kind; choose one of {list(FUSED_KINDS)} "
            f"(or fbgemm's EmbOptimType {sorted(_OPTIM_TYPE_TO_KIND)})"
        )
    return as_spec({"kind": kind, "lr": spec.pop("lr", 0.01), **spec})


def in_backward_specs(module: nn.Module) -> dict[str, FusedOptimizerSpec | None]:
    """``{table name: fused spec of its in-backward optimizer, or None}`` for an embedding collection's tables.

    A table (its weight) carries at most one in-backward optimizer; tables may carry different ones.
    """
    bags = hasattr(module, "embedding_bag_configs")
    configs = module.embedding_bag_configs() if bags else module.embedding_configs()  # type: ignore[operator]
    tables: Any = module.embedding_bags if bags else module.embeddings  # a TableContainer, indexed by name
    found: dict[str, FusedOptimizerSpec | None] = {}
    for name in [c.name for c in configs]:
        p = tables[name].weight
        classes = getattr(p, "_optimizer_classes", None)
        if classes is None:
            found[name] = None
            continue
        if len(classes) != 1:
            raise ValueError(f"table {name!r} has {len(classes)} in-backward optimizers; a fused table takes one")
        try:
            found[name] = spec_from_optimizer(classes[0], p._optimizer_kwargs[0])
        except ValueError as e:
            raise ValueError(f"table {name!r}: {e}") from None
    return found


class KeyedOptimizerWrapper(torch.optim.Optimizer):
    """An optimizer over ``{name: param}`` built by ``optim_factory(list of params)``, whose ``state_dict`` is
    keyed by parameter name (TorchRec's ``KeyedOptimizerWrapper``)."""

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        optim_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    ) -> None:
        self.params = dict(params)
        self._optimizer = optim_factory(list(self.params.values()))
        # like CombinedOptimizer: torch.optim.Optimizer's machinery without a second copy of the groups
        self.defaults = self._optimizer.defaults
        self.param_groups = self._optimizer.param_groups
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}

    @property  # type: ignore[override]  # torch declares state a plain attribute
    def state(self) -> dict:
        return self._optimizer.state

    @state.setter
    def state(self, value: dict) -> None:  # torch's machinery may assign; the wrapped optimizer owns the state
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        return self._optimizer.step(closure)

    def _keys(self) -> list[str]:
        name = {id(p): k for k, p in self.params.items()}
        return [name[id(p)] for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        inner, keys = self._optimizer.state_dict(), self._keys()
        return {
            "state": {keys[i]: s for i, s in inner["state"].items()},
            "param_groups": [{**g, "params": [keys[i] for i in g["params"]]} for g in inner["param_groups"]],
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        keys = self._keys()
        index = {k: i for i, k in enumerate(keys)}
        unknown = sorted(set(state_dict.get("state", {})) - set(index))
        if unknown:
            raise ValueError(f"optimizer state names parameters {unknown} this optimizer does not hold")
        self._optimizer.load_state_dict(
            {
                "state": {index[k]: s for k, s in state_dict["state"].items()},
                "param_groups": [{**g, "params": [index[k] for k in g["params"]]} for g in state_dict["param_groups"]],
            }
        )
