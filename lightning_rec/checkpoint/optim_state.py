"""Optimizer state keyed by parameter name, in a plan-independent form (see the package docstring).

- ``elementwise``: same shape as the parameter (momentum, Adagrad sums, Adam moments): sharded like it.
- ``rows``: one value per row (fused row-wise Adagrad): a [table rows, k] tensor, one column per column piece
  of the table in the saving layout (k = 1 unless the table is split by columns). A shard loads the piece(s)
  over its columns: exactly its own value when the layout is unchanged; merging column pieces gives their
  width-weighted mean (the full-row statistic), and splitting a row gives each piece the row's value.
- ``rowwise`` (read only, written by lightning_rec.dcp/1): the same state broadcast over the row's columns.
- 0-dim tensors and other values (step counters): in the meta file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from lightning_rec.checkpoint.errors import CheckpointError
from lightning_rec.checkpoint.placement import Placement, placements
from lightning_rec.optim import CombinedOptimizer, FusedOptimizer


def _leaves(optimizer: Any) -> dict[str, torch.optim.Optimizer]:
    """``{leaf id: optimizer}``: plain optimizers by position ("0", "1", ...), a fused one as "fused".

    A rank that holds no fused tables has no fused optimizer, so the fused leaf is matched by name, not position.
    """

    def flat(o: Any) -> list[torch.optim.Optimizer]:
        o = getattr(o, "_optimizer", o)  # LightningOptimizer
        return [x for c in o.optimizers for x in flat(c)] if isinstance(o, CombinedOptimizer) else [o]

    out: dict[str, torch.optim.Optimizer] = {}
    for leaf in flat(optimizer):
        if isinstance(leaf, FusedOptimizer):
            if "fused" in out:
                raise ValueError("an optimizer combines two FusedOptimizers; combine their kernels into one")
            out["fused"] = leaf
        else:
            out[str(len(out) - ("fused" in out))] = leaf
    return out


def _leaf_kind(leaf: torch.optim.Optimizer) -> str:
    if isinstance(leaf, FusedOptimizer):
        return "fused:" + ",".join(sorted({k.spec.kind for k in leaf.kernels}))
    return f"{type(leaf).__module__}.{type(leaf).__qualname__}"


def _leaf_state(leaf: torch.optim.Optimizer) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    if isinstance(leaf, FusedOptimizer):
        return [(p, states) for k in leaf.kernels for p, states in zip(k.tables(), k.optimizer_states().values())]
    return list(leaf.state.items())


def _leaf_groups(leaf: torch.optim.Optimizer, names: Mapping[int, str]) -> list[dict[str, Any]]:
    if isinstance(leaf, FusedOptimizer):
        # one group per kernel (a spec), each with its kind and lr; ranks hold different kernels, so the merge
        # over ranks joins the groups of equal hyper-parameters
        return [
            {
                "hparams": {k: v for k, v in saved.items() if k != "tables"},
                "params": [names[id(p)] for p in g["params"]],
            }
            for saved, g in zip(leaf.state_dict()["param_groups"], leaf.param_groups)
        ]
    return [
        {"hparams": {k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        for g in leaf.param_groups
    ]


def _key(leaf: str, name: str, state: str) -> str:
    return f"{leaf}/{name}/{state}"


def _param_names(model: nn.Module, optimizer: Any) -> dict[int, str]:
    names = {id(p): n for n, p in model.named_parameters()}
    for leaf in _leaves(optimizer).values():
        unknown = [tuple(p.shape) for g in leaf.param_groups for p in g["params"] if id(p) not in names]
        if unknown:
            raise ValueError(
                f"optimizer {_leaf_kind(leaf)} holds parameters of shapes {unknown} that are not parameters of the "
                "LightningModule; checkpoints key optimizer state by parameter name"
            )
    return names


def optimizer_state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """``{"tensors": {flat key: tensor or DTensor}, "meta": {...}}`` for one (possibly combined) optimizer.

    Collective: every rank calls it (the meta is merged over ranks, since each rank holds other tables). An
    error on one rank is raised on every rank at that merge, so no rank is left waiting.
    """
    tensors: dict[str, Any] = {}
    leaves_meta: dict[str, dict[str, Any]] = {}
    try:
        _flatten(model, optimizer, tensors, leaves_meta)
    except Exception as e:  # raised below, on every rank
        return {"tensors": {}, "meta": _merge_over_ranks({}, e)}
    return {"tensors": tensors, "meta": _merge_over_ranks(leaves_meta)}


def _flatten(model: nn.Module, optimizer: Any, tensors: dict[str, Any], leaves_meta: dict[str, Any]) -> None:
    names = _param_names(model, optimizer)
    places = placements(model)
    for j, leaf in _leaves(optimizer).items():
        layout: dict[str, dict[str, Any]] = {}
        for p, st in _leaf_state(leaf):
            name = names[id(p)]
            place = places.get(name)
            for k, v in st.items():
                if not torch.is_tensor(v) or v.dim() == 0:
                    layout.setdefault(name, {})[k] = ("value", v.detach().clone() if torch.is_tensor(v) else v)
                    continue
                shape = list(p.shape)
                global_shape = place.global_shape if place is not None else shape
                if list(v.shape) == shape:
                    layout.setdefault(name, {})[k] = ("elementwise", global_shape, v.dtype)
                    tensors[_key(j, name, k)] = v.detach() if place is None else place.sharded(v.detach())
                elif v.dim() == 1 and p.dim() == 2 and v.shape[0] == p.shape[0]:
                    # one value per row on disk: a column per column piece of the table, not one per column
                    columns = place.column_offsets() if place is not None else [0]
                    layout.setdefault(name, {})[k] = ("rows", global_shape, v.dtype, columns)
                    col = v.detach()[:, None]
                    tensors[_key(j, name, k)] = (
                        col
                        if place is None
                        else place.rows_sharded(col, len(columns), columns.index(place.local_offsets[1]))
                    )
                else:
                    raise ValueError(
                        f"optimizer state {k!r} of parameter {name!r} has shape {list(v.shape)}; checkpoints support "
                        f"state shaped like the parameter {shape}, one value per row, or scalars"
                    )
        leaves_meta[j] = {"kind": _leaf_kind(leaf), "groups": _leaf_groups(leaf, names), "state": layout}


def _merge_over_ranks(leaves: dict[str, dict[str, Any]], error: Exception | None = None) -> dict[str, dict[str, Any]]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return leaves
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"error": f"{type(error).__name__}: {error}"} if error is not None else leaves)
    if error is not None:
        raise error
    failed = [(r, x["error"]) for r, x in enumerate(gathered) if "error" in x]
    if failed:
        raise CheckpointError(
            f"collecting optimizer state failed on rank {failed[0][0]} (so every rank stops): {failed[0][1]}"
        )
    plain = [sorted(k for k in x if k != "fused") for x in gathered]
    if any(p != plain[0] for p in plain):
        raise ValueError(f"ranks disagree on their optimizers: {[[x[k]['kind'] for k in x] for x in gathered]}")
    out: dict[str, dict[str, Any]] = {}
    for j in sorted({k for x in gathered for k in x}):
        per_rank = [x[j] for x in gathered if j in x]
        if j == "fused":
            out[j] = _merge_fused(per_rank)
            continue
        kinds = {x["kind"] for x in per_rank}
        if len(kinds) != 1:
            raise ValueError(f"ranks disagree on optimizer {j}: {sorted(kinds)}")
        if len({len(x["groups"]) for x in per_rank}) != 1:
            raise ValueError(f"ranks disagree on the number of param groups of optimizer {j}")
        groups = []
        for gi in range(len(per_rank[0]["groups"])):
            params: dict[str, None] = {}
            for x in per_rank:
                params.update(dict.fromkeys(x["groups"][gi]["params"]))
            groups.append({"hparams": per_rank[0]["groups"][gi]["hparams"], "params": list(params)})
        state: dict[str, dict[str, Any]] = {}
        for x in per_rank:
            for name, entries in x["state"].items():
                state.setdefault(name, {}).update(entries)
        out[j] = {"kind": per_rank[0]["kind"], "groups": groups, "state": state}
    return out


def _fused_kinds(kind: str) -> set[str]:
    """The fused kinds a leaf kind names (``"fused:rowwise_adagrad,sgd"``)."""
    return set(kind.partition(":")[2].split(","))


def _merge_fused(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The fused leaf over ranks: every kind any rank runs, and one group per set of hyper-parameters."""
    kinds = set().union(*(_fused_kinds(x["kind"]) for x in per_rank))
    groups: dict[str, dict[str, Any]] = {}
    state: dict[str, dict[str, Any]] = {}
    for x in per_rank:
        for g in x["groups"]:
            merged = groups.setdefault(repr(sorted(g["hparams"].items())), {"hparams": g["hparams"], "params": {}})
            merged["params"].update(dict.fromkeys(g["params"]))
        for name, entries in x["state"].items():
            state.setdefault(name, {}).update(entries)
    return {
        "kind": "fused:" + ",".join(sorted(kinds)),
        "groups": [{"hparams": g["hparams"], "params": list(g["params"])} for g in groups.values()],
        "state": state,
    }


def optimizer_targets(
    model: nn.Module, optimizer: Any, saved: dict[str, dict[str, Any]], index: int
) -> tuple[dict[str, Any], Callable[[], None]]:
    """DCP load targets for one optimizer, and a function that applies what was loaded. Checks first."""
    names = _param_names(model, optimizer)
    params = dict(model.named_parameters())
    places = placements(model)
    leaves = _leaves(optimizer)
    plain_have = sorted(k for k in leaves if k != "fused")
    plain_saved = sorted(k for k in saved if k != "fused")
    if plain_have != plain_saved:
        raise ValueError(
            f"optimizer {index}: the checkpoint holds {[saved[k]['kind'] for k in sorted(saved)]}, this run has "
            f"{[_leaf_kind(leaves[k]) for k in sorted(leaves)]}"
        )
    holder = {names[id(p)]: j for j, leaf in leaves.items() for g in leaf.param_groups for p in g["params"]}
    # state the optimizers already hold (Adagrad's sums, fused kernels' state): loaded in place, no extra copy
    live = {
        (j, names[id(p)], k): v
        for j, leaf in leaves.items()
        for p, st in _leaf_state(leaf)
        for k, v in st.items()
        if torch.is_tensor(v)
    }
    targets: dict[str, Any] = {}
    loaded: dict[str, dict[str, dict[str, Any]]] = {j: {} for j in leaves}
    for j, leaf in leaves.items():
        if j not in saved:
            raise ValueError(
                f"optimizer {index}: this run has a {_leaf_kind(leaf)} optimizer but the checkpoint holds no state for "
                "it (was it saved without embedding_optimizer?)"
            )
        if j == "fused":
            extra = _fused_kinds(_leaf_kind(leaf)) - _fused_kinds(saved[j]["kind"])
            if extra:
                raise ValueError(
                    f"optimizer {index}: this run's fused optimizer runs {sorted(extra)}, which the checkpoint's "
                    f"({saved[j]['kind']}) does not"
                )
        elif _leaf_kind(leaf) != saved[j]["kind"]:
            raise ValueError(
                f"optimizer {index}: the checkpoint's optimizer is {saved[j]['kind']}, this run's is {_leaf_kind(leaf)}"
            )
        groups = saved[j]["groups"]
        if j != "fused":
            if len(leaf.param_groups) != len(groups):
                raise ValueError(
                    f"optimizer {index} ({saved[j]['kind']}): the checkpoint has {len(groups)} param groups, this "
                    f"run has {len(leaf.param_groups)}"
                )
            for gi, g in enumerate(leaf.param_groups):
                stray = [names[id(p)] for p in g["params"] if names[id(p)] not in set(groups[gi]["params"])]
                if stray:
                    raise ValueError(
                        f"optimizer {index} ({saved[j]['kind']}) param group {gi}: parameters {stray} are not in that "
                        "group in the checkpoint"
                    )
    for j, leaf_meta in saved.items():
        for name, entries in leaf_meta["state"].items():
            if name not in params:
                continue  # a table this rank holds no piece of
            if holder.get(name) != j:
                raise ValueError(
                    f"the checkpoint holds {leaf_meta['kind']} state for parameter {name!r}, which this run's "
                    f"optimizer {index} does not update that way; loading would drop it"
                )
            param, place = params[name], places.get(name)
            for k, entry in entries.items():
                if entry[0] == "value":
                    loaded[j].setdefault(name, {})[k] = entry[1]
                    continue
                form, global_shape, dtype = entry[:3]
                expect = place.global_shape if place is not None else list(param.shape)
                if list(global_shape) != list(expect):
                    raise ValueError(
                        f"optimizer state {k!r} of {name!r}: the checkpoint has shape {list(global_shape)}, this "
                        f"model {expect}"
                    )
                if form == "rows":
                    target, rows = _rows_target(param, place, dtype, len(entry[3]))
                    if param.numel():
                        targets[_key(j, name, k)] = target
                    loaded[j].setdefault(name, {})[k] = ("rows", rows, _column_weights(entry[3], expect[1], place))
                    continue
                buf = live.get((j, name, k))
                if (
                    form != "elementwise"
                    or buf is None
                    or buf.shape != param.shape
                    or buf.dtype != dtype
                    or not buf.is_contiguous()
                ):
                    buf = torch.empty(param.shape, dtype=dtype, device=param.device)
                if param.numel():
                    targets[_key(j, name, k)] = buf if place is None else place.sharded(buf)
                loaded[j].setdefault(name, {})[k] = (form, buf)

    def apply() -> None:
        for j, leaf in leaves.items():
            state = {name: {k: _restore(v) for k, v in entries.items()} for name, entries in loaded[j].items()}
            if j == "fused":
                _load_fused(cast(FusedOptimizer, leaf), names, state, saved[j])
            else:
                _load_torch(leaf, names, state, saved[j])

    return targets, apply


def _rows_target(param: torch.Tensor, place: Placement | None, dtype: torch.dtype, k: int) -> tuple[Any, torch.Tensor]:
    """A load target for the rows this rank holds of a [table rows, k] row-wise state, and a view of those rows."""
    if place is None:
        buf = torch.empty(param.shape[0], k, dtype=dtype, device=param.device)
        return buf, buf
    row0, nr = place.local_offsets[0], place.local_sizes[0]
    buf = torch.empty(nr, k, dtype=dtype, device=param.device)
    target = place.rows_target(buf)
    if target is not None:
        return target, buf
    whole = torch.empty(place.global_shape[0], k, dtype=dtype, device=param.device)
    return whole, whole[row0 : row0 + nr]


def _column_weights(saved_columns: list[int], width: int, place: Placement | None) -> torch.Tensor:
    """How many of this shard's columns fall in each saved column piece."""
    c0, nc = (place.local_offsets[1], place.local_sizes[1]) if place is not None else (0, width)
    ends = [*saved_columns[1:], width]
    return torch.tensor(
        [max(0, min(e, c0 + nc) - max(s, c0)) for s, e in zip(saved_columns, ends)], dtype=torch.float64
    )


def _restore(v: Any) -> Any:
    if not isinstance(v, tuple):
        return v
    if v[0] == "rowwise":
        return _row_values(v[1])
    if v[0] == "rows":
        rows, weights = v[1], v[2]
        hit = weights.nonzero().flatten().tolist()
        if len(hit) == 1:
            return rows[:, hit[0]].clone()  # the layout's own piece: bitwise
        w = weights[hit].to(rows.dtype)
        return (rows[:, hit] * w).sum(1) / w.sum()
    return v[1]


def _row_values(spread: torch.Tensor) -> torch.Tensor:
    """Row-wise state back from its per-column spread: the mean over the columns, exact where they are equal.

    (A float mean of equal values is not always bitwise that value; resuming in the same layout must be.)
    """
    first = spread[:, 0]
    return torch.where((spread == first[:, None]).all(1), first, spread.mean(1))


def _load_torch(
    leaf: torch.optim.Optimizer, names: dict[int, str], loaded: dict[str, dict[str, Any]], saved: dict[str, Any]
) -> None:
    index: dict[str, int] = {}
    groups = []
    for gi, g in enumerate(leaf.param_groups):
        ids = []
        for p in g["params"]:
            index[names[id(p)]] = len(index)
            ids.append(index[names[id(p)]])
        groups.append({**saved["groups"][gi]["hparams"], "params": ids})
    leaf.load_state_dict({"state": {index[n]: st for n, st in loaded.items()}, "param_groups": groups})


def _load_fused(
    leaf: FusedOptimizer, names: dict[int, str], loaded: dict[str, dict[str, Any]], saved: dict[str, Any]
) -> None:
    group_of = {name: g["hparams"] for g in saved["groups"] for name in g["params"]}
    tables: dict[str, dict[str, torch.Tensor]] = {}
    groups = []
    for i, k in enumerate(leaf.kernels):
        for p, table in zip(k.tables(), leaf.table_names(i)):
            tables[table] = dict(loaded.get(names[id(p)], {}))
        first = names[id(k.tables()[0])]
        if first not in group_of:
            raise ValueError(f"the checkpoint's fused optimizer has no param group holding {first!r}")
        groups.append({**group_of[first], "tables": leaf.table_names(i)})
    leaf.load_state_dict({"param_groups": groups, "tables": tables})
