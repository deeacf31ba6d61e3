"""Distributed checkpoints: a torch.distributed.checkpoint (DCP) directory keyed by unsharded names.

Layout of a checkpoint directory::

    <path>/.metadata, <path>/__*_*.distcp    DCP: {"state_dict": {unsharded key: tensor},
                                                   "optimizer_<i>": {"<leaf>/<param name>/<state>": tensor}}
    <path>/meta.pt                          everything else (loops, callbacks, schedulers, hyper-parameters,
                                            optimizer hyper-parameters and the layout of their state, the plan)

Sharded tables and their optimizer state are written as ShardedTensors over the whole table, so DCP
reshards them on load into any world size, 2D layout or plan (one process included); replicated tensors
are written once. Optimizer state is keyed by parameter name, never by position, and each state tensor is
stored in a plan-independent global form:

- ``elementwise``: same shape as the parameter (momentum, Adagrad sums, Adam moments): sharded like it.
- ``rowwise``: one value per row (fused row-wise Adagrad): stored broadcast over the row's columns, and a
  shard loads the mean over its columns. A column shard's own statistic is kept exactly when the layout
  is unchanged, and merging column shards gives exactly the full-row statistic; splitting a full row
  into column shards is the only case without an exact answer (each piece starts from the full-row value).
- 0-dim tensors and other values (step counters): in ``meta.pt``.

A save writes to ``.<name>.partial`` next to the target and renames it into place once every rank has
finished, so a save killed part-way leaves the previous checkpoint as it was.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from lightning_rec import _compat

META_FILE = "meta.pt"
_FORMAT = "lightning_rec.dcp/1"


# -- where each sharded parameter sits in its table -----------------------------------------------------


@dataclass
class _Placement:
    table: str
    global_shape: list[int]
    shards: list[tuple[list[int], list[int], int]]  # (offsets, sizes, global rank) of every shard
    local_offsets: list[int]
    group: Any
    dtype: torch.dtype

    def sharded(self, local: torch.Tensor, dtype: torch.dtype | None = None) -> Any:
        return _compat.make_sharded_tensor(
            [(local, self.local_offsets)], self.shards, self.global_shape, dtype or local.dtype,
            local.device.type, self.group,
        )


def _placements(model: nn.Module) -> dict[str, _Placement]:
    """``{parameter name: placement}`` for the sharded tables this rank holds a piece of."""
    from lightning_rec.sharding.sharded import sharded_collections

    out: dict[str, _Placement] = {}
    for path, m in sharded_collections(model):
        tables, all_shards, ranks, dtypes = m.tables, m.shards, m.shard_group_ranks, m.table_dtypes
        for ti, s in m.local_shards:
            t = tables[ti]
            shards = [([x.row_offset, x.col_offset], [x.rows, x.cols], ranks[x.rank]) for x in all_shards[t.name]]
            name = f"{path}.{m.table_attr}.{t.name}.weight" if path else f"{m.table_attr}.{t.name}.weight"
            out[name] = _Placement(t.name, [t.num_embeddings, t.embedding_dim], shards,
                                   [s.row_offset, s.col_offset], m.shard_group, dtypes[ti])
    return out


def sharding_layout(model: nn.Module) -> dict[str, dict[str, Any]]:
    """``{collection path: {table: [[row_offset, rows, col_offset, cols, shard rank], ...] or "data_parallel"}}``."""
    from lightning_rec.sharding.sharded import sharded_collections

    return {
        path: {name: ("data_parallel" if shards is None else
                      [[s.row_offset, s.rows, s.col_offset, s.cols, s.rank] for s in shards])
               for name, shards in m.shards.items()}
        for path, m in sharded_collections(model)
    }


# -- optimizers ----------------------------------------------------------------------------------------


def _leaves(optimizer: Any) -> dict[str, torch.optim.Optimizer]:
    """``{leaf id: optimizer}``: plain optimizers by position ("0", "1", ...), a fused one as "fused".

    A rank that holds no fused tables has no fused optimizer, so the fused leaf is matched by name, not position.
    """
    from lightning_rec.optim import CombinedOptimizer, FusedOptimizer

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
    from lightning_rec.optim import FusedOptimizer

    if isinstance(leaf, FusedOptimizer):
        return "fused:" + ",".join(sorted({k.spec.kind for k in leaf.kernels}))
    return f"{type(leaf).__module__}.{type(leaf).__qualname__}"


def _leaf_state(leaf: torch.optim.Optimizer) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    from lightning_rec.optim import FusedOptimizer

    if isinstance(leaf, FusedOptimizer):
        return [(p, states) for k in leaf.kernels for p, states in zip(k.tables(), k.optimizer_states().values())]
    return list(leaf.state.items())


def _leaf_groups(leaf: torch.optim.Optimizer, names: Mapping[int, str]) -> list[dict[str, Any]]:
    from lightning_rec.optim import FusedOptimizer

    if isinstance(leaf, FusedOptimizer):
        # one group per kernel, and ranks hold different kernels: keep one set of hyper-parameters (a spec's)
        first = leaf.state_dict()["param_groups"][0]
        hp = {k: v for k, v in first.items() if k != "tables"}
        return [{"hparams": hp, "params": [names[id(p)] for g in leaf.param_groups for p in g["params"]]}]
    return [{"hparams": {k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
            for g in leaf.param_groups]


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
    """``{"tensors": {flat key: tensor or ShardedTensor}, "meta": {...}}`` for one (possibly combined) optimizer.

    Collective: every rank calls it (the meta is merged over ranks, since each rank holds other tables).
    """
    names = _param_names(model, optimizer)
    places = _placements(model)
    tensors: dict[str, Any] = {}
    leaves_meta: dict[str, dict[str, Any]] = {}
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
                if list(v.shape) == shape:
                    form = "elementwise"
                elif v.dim() == 1 and p.dim() == 2 and v.shape[0] == p.shape[0]:
                    form, v = "rowwise", v.detach()[:, None].expand(p.shape).contiguous()
                else:
                    raise ValueError(
                        f"optimizer state {k!r} of parameter {name!r} has shape {list(v.shape)}; checkpoints support "
                        f"state shaped like the parameter {shape}, one value per row, or scalars"
                    )
                global_shape = place.global_shape if place is not None else shape
                layout.setdefault(name, {})[k] = (form, global_shape, v.dtype)
                tensors[_key(j, name, k)] = v.detach() if place is None else place.sharded(v.detach())
        leaves_meta[j] = {"kind": _leaf_kind(leaf), "groups": _leaf_groups(leaf, names), "state": layout}
    return {"tensors": tensors, "meta": _merge_over_ranks(leaves_meta)}


def _merge_over_ranks(leaves: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return leaves
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, leaves)
    plain = [sorted(k for k in x if k != "fused") for x in gathered]
    if any(p != plain[0] for p in plain):
        raise ValueError(f"ranks disagree on their optimizers: {[[x[k]['kind'] for k in x] for x in gathered]}")
    out: dict[str, dict[str, Any]] = {}
    for j in sorted({k for x in gathered for k in x}):
        per_rank = [x[j] for x in gathered if j in x]
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


def _optimizer_targets(model: nn.Module, optimizer: Any, saved: dict[str, dict[str, Any]], index: int):
    """DCP load targets for one optimizer, and a function that applies what was loaded. Checks first."""
    names = _param_names(model, optimizer)
    params = {n: p for n, p in model.named_parameters()}
    places = _placements(model)
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
    live = {(j, names[id(p)], k): v for j, leaf in leaves.items() for p, st in _leaf_state(leaf)
            for k, v in st.items() if torch.is_tensor(v)}
    targets: dict[str, Any] = {}
    loaded: dict[str, dict[str, dict[str, Any]]] = {j: {} for j in leaves}
    for j, leaf in leaves.items():
        if j not in saved:
            raise ValueError(
                f"optimizer {index}: this run has a {_leaf_kind(leaf)} optimizer but the checkpoint holds no state for "
                "it (was it saved without embedding_optimizer?)"
            )
        if _leaf_kind(leaf) != saved[j]["kind"]:
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
                form, global_shape, dtype = entry
                expect = place.global_shape if place is not None else list(param.shape)
                if list(global_shape) != list(expect):
                    raise ValueError(
                        f"optimizer state {k!r} of {name!r}: the checkpoint has shape {list(global_shape)}, this "
                        f"model {expect}"
                    )
                buf = live.get((j, name, k))
                if form != "elementwise" or buf is None or buf.shape != param.shape or buf.dtype != dtype \
                        or not buf.is_contiguous():
                    buf = torch.empty(param.shape, dtype=dtype, device=param.device)
                if param.numel():
                    targets[_key(j, name, k)] = buf if place is None else place.sharded(buf)
                loaded[j].setdefault(name, {})[k] = (form, buf)

    def apply() -> None:
        for j, leaf in leaves.items():
            state = {name: {k: (_row_values(v[1]) if v[0] == "rowwise" else v[1]) if isinstance(v, tuple) else v
                            for k, v in entries.items()}
                     for name, entries in loaded[j].items()}
            if j == "fused":
                _load_fused(leaf, names, state, saved[j])
            else:
                _load_torch(leaf, names, state, saved[j])

    return targets, apply


def _row_values(spread: torch.Tensor) -> torch.Tensor:
    """Row-wise state back from its per-column spread: the mean over the columns, exact where they are equal.

    (A float mean of equal values is not always bitwise that value; resuming in the same layout must be.)
    """
    first = spread[:, 0]
    return torch.where((spread == first[:, None]).all(1), first, spread.mean(1))


def _load_torch(leaf, names, loaded: dict[str, dict[str, Any]], saved: dict[str, Any]) -> None:
    index: dict[str, int] = {}
    groups = []
    for gi, g in enumerate(leaf.param_groups):
        ids = []
        for p in g["params"]:
            index[names[id(p)]] = len(index)
            ids.append(index[names[id(p)]])
        groups.append({**saved["groups"][gi]["hparams"], "params": ids})
    leaf.load_state_dict({"state": {index[n]: st for n, st in loaded.items()}, "param_groups": groups})


def _load_fused(leaf, names, loaded: dict[str, dict[str, Any]], saved: dict[str, Any]) -> None:
    hp = saved["groups"][0]["hparams"]
    tables: dict[str, dict[str, torch.Tensor]] = {}
    groups = []
    for i, k in enumerate(leaf.kernels):
        for p, table in zip(k.tables(), leaf._names(i)):
            tables[table] = dict(loaded.get(names[id(p)], {}))
        groups.append({**hp, "tables": leaf._names(i)})
    leaf.load_state_dict({"param_groups": groups, "tables": tables})


# -- save / load ---------------------------------------------------------------------------------------


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _broadcast_path(path: str | os.PathLike) -> Path:
    if dist.is_available() and dist.is_initialized():
        obj = [str(path)]
        dist.broadcast_object_list(obj, src=0)
        path = obj[0]
    return Path(path)


def _partial(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


def _previous(path: Path) -> Path:
    return path.with_name(f".{path.name}.previous")


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint directory to read: ``path``, or the previous one if a save died while swapping them in."""
    path = Path(path)
    if not path.exists() and _previous(path).is_dir():
        return _previous(path)
    return path


def is_checkpoint_dir(path: str | os.PathLike) -> bool:
    p = resolve(path)
    return p.is_dir() and (p / META_FILE).is_file()


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizers: Iterable[Any] = (),
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``model`` (sharded or not) and ``optimizers`` as a checkpoint directory; ``extra`` goes to meta.

    Collective. The result loads with :func:`load` into any sharding of the same model, or into one process.
    """
    tensors: dict[str, Any] = {"state_dict": model.state_dict()}
    layouts = []
    for i, opt in enumerate(optimizers):
        state = optimizer_state(model, opt)
        tensors[f"optimizer_{i}"] = state["tensors"]
        layouts.append(state["meta"])
    return write(path, tensors, {**(extra or {}), "optimizer_layouts": layouts})


def write(path: str | os.PathLike, tensors: Mapping[str, Any], meta: dict[str, Any]) -> Path:
    """Write ``tensors`` (nested dicts of tensors / ShardedTensors) with DCP and ``meta`` with ``torch.save``.

    Collective. The directory appears at ``path`` only when complete (write aside, then rename).
    """
    path = _broadcast_path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"checkpoint path {path} exists and is a file, not a checkpoint directory")
    tmp = _partial(path)
    if _rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a save that was killed
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save(dict(tensors), checkpoint_id=str(tmp))
    if _rank() == 0:
        torch.save({"format": _FORMAT, **meta}, tmp / META_FILE)
        old = _previous(path)
        if path.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(path, old)
        os.replace(tmp, path)
        if old.exists():
            shutil.rmtree(old)
    _barrier()
    return path


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The non-tensor part of a checkpoint directory."""
    p = resolve(path)
    meta = torch.load(p / META_FILE, map_location="cpu", weights_only=False)
    if meta.get("format") != _FORMAT:
        raise ValueError(f"{p} is not a lightning_rec checkpoint (format {meta.get('format')!r})")
    return meta


def _check_model(path: Path, model_state: Mapping[str, Any], strict: bool) -> None:
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    prefix = "state_dict."
    have = {k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)}
    problems = []
    for key, value in model_state.items():
        if not (torch.is_tensor(value) or _compat.is_sharded_tensor(value)):
            continue
        if key not in have:
            if strict:
                problems.append(f"{key!r} is missing from the checkpoint")
            continue
        want = list(value.size()) if _compat.is_sharded_tensor(value) else list(value.shape)
        got = list(getattr(have[key], "size", []))
        if got != want:
            problems.append(f"{key!r} has shape {got} in the checkpoint but {want} in the model")
    if strict:
        problems += [f"{k!r} is in the checkpoint but not in the model" for k in have if k not in model_state]
    if problems:
        raise ValueError(f"checkpoint {path} does not match the model:\n  " + "\n  ".join(problems))


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizers: Iterable[Any] = (),
    strict: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint directory into ``model`` (any sharding, or none) and ``optimizers``; return its meta.

    Collective. Everything is checked against the checkpoint's metadata before any value changes; optimizer
    state is matched by parameter name, and state the run's optimizers cannot take is an error, never
    dropped.
    """
    path = resolve(_broadcast_path(path))
    if not is_checkpoint_dir(path):
        raise FileNotFoundError(f"{path} is not a checkpoint directory (no {META_FILE})")
    meta = read_meta(path)
    model_state = model.state_dict()
    _check_model(path, model_state, strict)
    targets: dict[str, Any] = {"state_dict": {k: v for k, v in model_state.items()
                                              if torch.is_tensor(v) or _compat.is_sharded_tensor(v)}}
    optimizers = list(optimizers)
    saved_opts = meta.get("optimizer_layouts", [])
    applies = []
    if optimizers:
        if len(saved_opts) != len(optimizers):
            raise ValueError(
                f"the checkpoint holds state for {len(saved_opts)} optimizer(s), this run has {len(optimizers)}"
                + (" (it was saved with save_weights_only=True)" if not saved_opts else "")
            )
        for i, (opt, saved) in enumerate(zip(optimizers, saved_opts)):
            t, apply = _optimizer_targets(model, opt, saved, i)
            if t:
                targets[f"optimizer_{i}"] = t
            applies.append(apply)
    planner = dcp.DefaultLoadPlanner(allow_partial_load=not strict)
    with torch.no_grad():
        dcp.load(targets, checkpoint_id=str(path), planner=planner)  # in place: the state_dict shares storage
    for apply in applies:
        apply()
    return meta
