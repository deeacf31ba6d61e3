"""A ``torch.export`` program of the *unsharded* model (``torch.export.save``), and the unsharded CPU copy it
traces.

:func:`export_program` writes plain tensors in (``dense [B, num_dense]``, ``values [N]``, ``lengths [F * B]``
key-major, as ``KeyedJaggedTensor.lengths()``), tensors out, a dynamic batch and any bag lengths, only aten ops
in the graph (the torch lookup, never fbgemm), so ``torch.export.load`` serves it in a process that has neither
lightning_rec nor fbgemm. :func:`inference_model` is the unsharded CPU copy it traces. Quantized collections
(``export_program(quantize=...)``, or a model quantized already) trace their torch lookup: the stored rows,
dequantized by aten ops. :func:`fx_trace` is the same copy under ``torch.fx``. ``lightning_rec.export``
re-exports these names.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from lightning_rec import _compat, checkpoint
from lightning_rec.checkpoint import atomic, collective
from lightning_rec.configs import BaseEmbeddingConfig, EmbeddingBagConfig, EmbeddingConfig
from lightning_rec.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from lightning_rec.kernels import TableContainer
from lightning_rec.quant import EmbeddingBagCollection as QuantEmbeddingBagCollection
from lightning_rec.quant import EmbeddingCollection as QuantEmbeddingCollection
from lightning_rec.quant import FrozenManagedCollisionCollection, quantize_embeddings
from lightning_rec.sharding import (
    ShardedCollection,
    ShardedEmbeddingBagCollection,
    full_state_dict,
    sharded_collections,
)
from lightning_rec.sparse import KeyedJaggedTensor, KeyedTensor

#: the ``extra_files`` entry of an exported program that records its input signature (JSON)
SIGNATURE_FILE = "lightning_rec_signature.json"


class _ExportTables(TableContainer):
    """The tables of an inference copy under names without ``.``: torch.export resolves parameters by
    splitting their names at dots, which a table named ``"geo.city"`` breaks. Looked up by the table names."""

    def __init__(self, tables: TableContainer) -> None:
        super().__init__()
        self._names: dict[str, str] = {}
        for i, name in enumerate(tables):
            safe = f"t{i}_" + re.sub(r"\W", "_", name)
            self._names[name] = safe
            self.add_module(safe, tables[name])

    def __getitem__(self, name: str) -> nn.Module:
        return self.get_submodule(self._names[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)


def _unsharded_twin(m: ShardedCollection, full: dict[str, torch.Tensor], prefix: str) -> nn.Module:
    """The unsharded collection of sharded ``m`` on CPU, holding the gathered full tables (torch kernel)."""
    if isinstance(m, ShardedEmbeddingBagCollection):
        twin: nn.Module = EmbeddingBagCollection(
            cast("list[EmbeddingBagConfig]", m.tables), is_weighted=m.is_weighted(), device="meta", kernel="torch"
        )
    else:
        twin = EmbeddingCollection(cast("list[EmbeddingConfig]", m.tables), device="meta")
    attr = m.table_attr
    # gathered tables are fresh tensors, taken as they are; replicated ones are the live weights: copied
    live = {p.untyped_storage().data_ptr() for p in m.parameters()}
    state = {}
    for t in m.tables:
        w = full.pop(f"{prefix}{attr}.{t.name}.weight").detach().to("cpu")
        state[f"{attr}.{t.name}.weight"] = w.clone() if w.untyped_storage().data_ptr() in live else w
    twin.load_state_dict(state, assign=True)
    return twin


def inference_model(model: nn.Module) -> nn.Module | None:
    """A CPU copy of ``model`` for inference: every sharded collection unsharded, torch lookups, ``eval()``.

    Collective when ``model`` holds sharded collections (every rank calls it; the full tables are gathered
    on rank 0, which alone gets the copy: the other ranks get None). ``model`` itself is not changed: the
    copy shares no storage with it, and references to the trainer, process groups and fused kernels are
    left out.
    """
    sharded = list(sharded_collections(model))
    full = full_state_dict(model, rank0_only=True) if sharded else {}
    if collective.rank() != 0:
        return None
    # deepcopy, except what must not be copied: the sharded collections (replaced by their twins), the
    # trainer, the device mesh and the cached fused optimizer (which hold process groups and fbgemm kernels)
    memo: dict[int, Any] = {id(m): _unsharded_twin(m, full, f"{path}." if path else "") for path, m in sharded}
    for sub in model.modules():
        for name in ("_trainer", "_device_mesh", "_lightning_rec_fused_optimizer", "_fabric", "_compiled_call_impl"):
            value = sub.__dict__.get(name)
            if value is not None:
                memo[id(value)] = None
    if id(model) in memo:  # the model is itself one sharded collection
        out = memo[id(model)]
    else:
        out = copy.deepcopy(model, memo)
    for m in out.modules():
        if isinstance(m, EmbeddingBagCollection):
            m.kernel = "torch"  # aten ops only: the program loads where fbgemm is not installed
        if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection)):
            m.sparse_grad = False  # inference: no gradient, and a plain embedding_bag in the graph
        if isinstance(m, (QuantEmbeddingBagCollection, QuantEmbeddingCollection)):
            m.use_torch_lookup()  # dequantized in aten ops: the program needs no fbgemm either
    return out.to("cpu").eval()


def _rename_tables(model: nn.Module) -> None:
    """Tables under dot-free names (see ``_ExportTables``); state_dict keys change, so only just before tracing."""
    for m in model.modules():
        if isinstance(m, (EmbeddingBagCollection, QuantEmbeddingBagCollection)):
            m.embedding_bags = _ExportTables(cast(TableContainer, m.embedding_bags))
        elif isinstance(m, (EmbeddingCollection, QuantEmbeddingCollection)):
            m.embeddings = _ExportTables(cast(TableContainer, m.embeddings))
        elif isinstance(m, FrozenManagedCollisionCollection):  # a quantized managed-collision collection's maps
            m._managed_collision_modules = _ExportTables(m._managed_collision_modules)


def _collection_features(model: nn.Module) -> tuple[dict[str, int], dict[str, list[str]]]:
    """``{feature: rows it may index}`` and ``{collection path: its features in config order}``."""
    rows: dict[str, int] = {}
    features: dict[str, list[str]] = {}
    for path, m in model.named_modules():
        configs: Sequence[BaseEmbeddingConfig]
        if isinstance(m, (EmbeddingBagCollection, QuantEmbeddingBagCollection)):
            configs = m.embedding_bag_configs()
        elif isinstance(m, (EmbeddingCollection, QuantEmbeddingCollection)):
            configs = m.embedding_configs()
        else:
            continue
        features[path] = [f for t in configs for f in t.feature_names]
        for t in configs:
            for f in t.feature_names:
                rows[f] = min(rows.get(f, t.num_embeddings), t.num_embeddings)
    return rows, features


def _tensor_outputs(out: Any) -> Any:
    if isinstance(out, KeyedTensor):
        return out.values()  # [B, sum of dims], keys in the KeyedTensor's order
    if torch.is_tensor(out) or isinstance(out, torch.fx.Proxy):  # a Proxy under torch.fx.symbolic_trace
        return out
    if isinstance(out, (tuple, list)):
        return type(out)(_tensor_outputs(o) for o in out)
    raise TypeError(
        f"export_program needs a model whose forward returns tensors, KeyedTensors or tuples of them; it returned "
        f"{type(out).__name__} (wrap the model in a module that returns tensors)"
    )


class TensorInputs(nn.Module):
    """Calls ``model(dense, KeyedJaggedTensor(keys, values, lengths[, weights]))`` from plain tensors.

    The signature an exported program serves: ``forward(dense, values, lengths[, weights])``, or without
    ``dense`` when ``num_dense`` is None (the model is then called with the KJT alone). ``lengths`` is
    key-major (``[len(keys) * B]``: every sample of ``keys[0]``, then of ``keys[1]``, ...), as
    ``KeyedJaggedTensor.lengths()``. KeyedTensor outputs become their ``values()``.

    The model sees one more sample than given (empty bags, zero dense features), and every output loses it
    again (outputs are batch-first): a batch of one is then never a special case of the traced program
    (shape code branches on a dimension of size 1). Models for inference treat samples independently.
    """

    def __init__(self, model: nn.Module, keys: Sequence[str], num_dense: int | None, weighted: bool = False) -> None:
        super().__init__()
        self.model = model
        self.keys = list(keys)
        self.num_dense = num_dense
        self.weighted = weighted

    def forward(self, *inputs: torch.Tensor) -> Any:
        f = len(self.keys)
        dense = inputs[0] if self.num_dense is not None else None
        values, lengths = inputs[(0 if dense is None else 1) :][:2]
        weights = inputs[-1] if self.weighted else None
        b = dense.size(0) if dense is not None else lengths.numel() // f
        # key k's bags move k places on: one empty bag ends every key
        pos = torch.arange(f * b, device=lengths.device)
        padded = lengths.new_zeros(f * (b + 1)).index_copy(0, pos + pos // b, lengths)
        kjt = KeyedJaggedTensor(self.keys, values, lengths=padded, weights=weights)
        if dense is None:
            out = self.model(kjt)
        else:
            out = self.model(torch.cat([dense, dense.new_zeros(1, dense.size(1))]), kjt)
        # size-oblivious: the strides of the [B, ...] results must not make the trace branch on a batch of one
        with _compat.size_oblivious():
            return _first_samples(_tensor_outputs(out), b)


def _first_samples(out: Any, b: Any) -> Any:
    if torch.is_tensor(out) or isinstance(out, torch.fx.Proxy):
        return out[:b]  # type: ignore[index]  # fx.Proxy's operators are attached at run time
    return type(out)(_first_samples(o, b) for o in out)


def _example(
    keys: list[str], rows: dict[str, int], num_dense: int | None, weighted: bool, batch_size: int
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    # bags of 1 to 3 ids: no size 0 or 1 the tracer could specialise on
    lengths = torch.randint(1, 4, (len(keys) * batch_size,), generator=g)
    per_key = lengths.view(len(keys), batch_size).sum(1).tolist()
    values = torch.cat([torch.randint(0, rows[k], (n,), generator=g) for k, n in zip(keys, per_key)])
    out: list[torch.Tensor] = [] if num_dense is None else [torch.randn(batch_size, num_dense, generator=g)]
    out += [values, lengths]
    if weighted:
        out.append(torch.rand(values.numel(), generator=g))
    return tuple(out)


def _keys(model: nn.Module, keys: Sequence[str] | None) -> tuple[list[str], dict[str, int], dict[str, list[str]]]:
    rows, features = _collection_features(model)
    keys = list(rows) if keys is None else list(keys)
    unknown = [k for k in keys if k not in rows]
    if not keys or unknown:
        raise ValueError(
            f"export_program: keys {unknown or keys} are not features of the model's embedding "
            f"collections (features: {list(rows)})"
        )
    return keys, rows, features


def _num_dense(model: nn.Module, num_dense: int | str | None) -> int | None:
    if num_dense != "auto":
        return num_dense  # type: ignore[return-value]
    dense = getattr(model, "num_dense", None)
    if dense is None:
        raise ValueError(
            "export_program: the model has no `num_dense` attribute; pass num_dense= (the "
            "number of dense features) or num_dense=None for a model called as model(kjt)"
        )
    return dense


def _trace(
    model: nn.Module, keys: Sequence[str] | None, num_dense: int | None, weighted: bool, batch_size: int
) -> tuple[torch.export.ExportedProgram, dict[str, Any]]:
    keys, rows, _ = _keys(model, keys)
    # a collection reading other features (or another order) permutes the KJT: its per-key id counts are
    # symbols in the program (KeyedJaggedTensor keeps them symbolic), so any mix of collections exports
    _rename_tables(model)
    wrapper = TensorInputs(model, keys, num_dense, weighted)
    example = _example(keys, rows, num_dense, weighted, batch_size)
    batch, ids = torch.export.Dim("batch", min=1), torch.export.Dim("ids", min=0)
    shapes: list[Any] = [] if num_dense is None else [{0: batch}]
    shapes += [{0: ids}, {0: len(keys) * batch}] + ([{0: ids}] if weighted else [])
    with torch.no_grad():
        program = torch.export.export(wrapper, example, dynamic_shapes=(tuple(shapes),))  # one *inputs
    names = ([] if num_dense is None else ["dense"]) + ["values", "lengths"] + (["weights"] if weighted else [])
    signature: dict[str, Any] = {
        "inputs": names,
        "keys": keys,
        "num_dense": num_dense,
        "weighted": weighted,
        "rows": {k: rows[k] for k in keys},
    }
    stored = {
        t: kind.name
        for m in model.modules()
        if isinstance(m, (QuantEmbeddingBagCollection, QuantEmbeddingCollection))
        for t, kind in m.storage_types().items()
    }
    if stored:
        signature["quantized"] = stored  # {table: storage type}, e.g. "INT8"
    return program, signature


def export_program(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    keys: Sequence[str] | None = None,
    num_dense: int | str | None = "auto",
    weighted: bool = False,
    checkpoint_dir: str | os.PathLike | None = None,
    trusted: bool = False,
    example_batch_size: int = 4,
    quantize: Any = None,
    per_table_weight_dtype: Mapping[str, Any] | None = None,
) -> Path:
    """Write a ``torch.export`` program of ``model``'s unsharded copy to ``path`` (``torch.export.save``).

    Serve it anywhere torch is installed::

        program = torch.export.load(path).module()
        logits = program(dense, values, lengths)   # any batch size, any bag lengths

    Args:
        model: the trained model, sharded (collective: every rank calls this; rank 0 writes) or not.
        path: the file to write (``.pt2``); it appears only when complete.
        keys: the features, in the order ``lengths`` lists them (default: the features of the model's
            embedding collections, in config order, each once). Collections may read any of them in any order.
        num_dense: dense features (the model is called as ``model(dense, kjt)``); ``"auto"`` reads the
            model's ``num_dense`` attribute; None: no dense input, the model is called as ``model(kjt)``.
        weighted: a fourth input, ``weights [N]``, becomes the KJT's per-id weights.
        checkpoint_dir: load this checkpoint directory (:func:`lightning_rec.checkpoint.save`, or a
            ``rec_sharded`` Trainer checkpoint, from any world size or plan) into the unsharded copy first;
            single process only. ``trusted`` as in ``lightning_rec.checkpoint.load``.
        example_batch_size: batch size of the example traced (the program takes any batch size >= 1).
        quantize: store the copy's embedding tables quantized (``torch.qint8`` / ``"int8"``, ``"int4"``, ...: see
            :func:`lightning_rec.quant.quantize_embeddings`), ``per_table_weight_dtype`` overriding it per table. A
            model whose collections are quantized already exports as it is. Either way the program dequantizes
            the looked-up rows in aten ops, so it still serves without fbgemm.

    The signature (input names, keys, num_dense, rows per feature) is stored with the program as the
    extra file ``SIGNATURE_FILE`` (JSON).
    """
    if checkpoint_dir is not None and collective.distributed() and dist.get_world_size() > 1:
        raise ValueError(
            "export_program(checkpoint_dir=...) runs in one process (it loads the checkpoint into an "
            "unsharded copy); under a process group, load the checkpoint into the model first"
        )
    if per_table_weight_dtype and quantize is None:
        raise ValueError("export_program: per_table_weight_dtype needs quantize= (the type of the other tables)")
    path = collective.broadcast_path(path)
    twin = inference_model(model)  # None on ranks other than 0
    error: BaseException | None = None
    if twin is not None:
        tmp = atomic.partial_path(path)
        try:
            if checkpoint_dir is not None:
                checkpoint.load(checkpoint_dir, twin, trusted=trusted)
            if quantize is not None:
                twin = quantize_embeddings(
                    twin, quantize, per_table_weight_dtype=per_table_weight_dtype, kernel="torch"
                )
            program, signature = _trace(twin, keys, _num_dense(twin, num_dense), weighted, example_batch_size)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:  # a file object: the partial name need not end in .pt2
                torch.export.save(program, f, extra_files={SIGNATURE_FILE: json.dumps(signature)})
            os.replace(tmp, path)
        except Exception as e:  # every rank hears about it below
            atomic.remove(tmp)
            error = e
    collective.agree(error, f"exporting a program to {path}")
    return path


def fx_trace(
    model: nn.Module, *, keys: Sequence[str] | None = None, num_dense: int | str | None = "auto", weighted: bool = False
) -> torch.fx.GraphModule | None:
    """``torch.fx.symbolic_trace`` of ``model``'s unsharded inference copy behind the plain-tensor signature
    (:class:`TensorInputs`), for fx inference transforms. Arguments as :func:`export_program`; collective for a
    sharded model (rank 0 gets the GraphModule, the other ranks None). The model's forward must be fx-traceable
    (no Python control flow on tensor values); table names are made dot-free as in the exported program.
    """
    twin = inference_model(model)
    if twin is None:
        return None
    keys, _, _ = _keys(twin, keys)
    _rename_tables(twin)
    return torch.fx.symbolic_trace(TensorInputs(twin, keys, _num_dense(twin, num_dense), weighted))
