"""From a training checkpoint directory (any plan, any world size) to a quantized model in one process."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_rec import checkpoint
from lightning_rec.checkpoint.storage import CheckedReader
from lightning_rec.configs import BaseEmbeddingConfig
from lightning_rec.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from lightning_rec.lightning.rec_module import RecModule
from lightning_rec.quant.quantize import check_quantizable, quantize_embeddings
from lightning_rec.quant.rows import DEFAULT_ROW_ALIGNMENT


def _saved_tables(path: os.PathLike | str, trusted: bool) -> dict[str, list[int]]:
    """``{model key: shape}`` of every tensor the checkpoint's model state holds (metadata only, no values)."""
    meta = checkpoint.read_meta(path, trusted=trusted)
    reader = CheckedReader(path, 0, meta.get("checksums"), trusted=trusted)
    prefix = "state_dict."
    return {
        k[len(prefix) :]: list(m.size)
        for k, m in reader.read_metadata().state_dict_metadata.items()
        if k.startswith(prefix) and hasattr(m, "size")
    }


def check_tables(path: os.PathLike | str, model: nn.Module, trusted: bool = False) -> None:
    """Raise a ValueError naming every table that differs between ``model``'s collections and the checkpoint
    (a table only one of them has, or one of another shape), before anything is read or changed."""
    saved = _saved_tables(path, trusted)
    problems = []
    claimed: set[str] = set()
    for where, m in model.named_modules():
        configs: list[BaseEmbeddingConfig]
        if isinstance(m, EmbeddingBagCollection):
            configs, attr = list(m.embedding_bag_configs()), "embedding_bags"
        elif isinstance(m, EmbeddingCollection):
            configs, attr = list(m.embedding_configs()), "embeddings"
        else:
            continue
        prefix = f"{where}.{attr}." if where else f"{attr}."
        ours = {t.name: [t.num_embeddings, t.embedding_dim] for t in configs}
        theirs = {
            k[len(prefix) : -len(".weight")]: v
            for k, v in saved.items()
            if k.startswith(prefix) and k.endswith(".weight")
        }
        claimed.update(prefix + n + ".weight" for n in theirs)
        label = f"collection {where or '<model>'!r}"
        if set(theirs) - set(ours):
            problems.append(f"{label}: tables only in the checkpoint: {sorted(set(theirs) - set(ours))}")
        if set(ours) - set(theirs):
            problems.append(f"{label}: tables only in the model: {sorted(set(ours) - set(theirs))}")
        problems += [
            f"{label}: table {n!r} is {theirs[n]} in the checkpoint but {ours[n]} in the model"
            for n in ours
            if n in theirs and theirs[n] != ours[n]
        ]
    if problems:
        others = sorted(
            k for k in saved if k not in claimed and (".embedding_bags." in f".{k}" or ".embeddings." in f".{k}")
        )
        hint = f" (the checkpoint's other table keys: {others})" if others else ""
        raise ValueError(f"checkpoint {path} was not written by this model: " + "; ".join(problems) + hint)


def load_quantized(
    path: str | os.PathLike,
    model: nn.Module | type[RecModule],
    dtype: Any = torch.qint8,
    *,
    per_table_weight_dtype: Mapping[str, Any] | None = None,
    output_dtype: torch.dtype = torch.float32,
    row_alignment: int | None = DEFAULT_ROW_ALIGNMENT,
    kernel: str = "auto",
    trusted: bool = False,
    strict: bool = True,
) -> nn.Module:
    """Read a checkpoint directory (written by ``rec_sharded`` / :func:`lightning_rec.checkpoint.save`, any plan and
    world size) into ``model`` in this process and quantize its embedding collections; returned in ``eval()`` mode.

    ``model`` is the unsharded model (built as for training; its tables are checked against the checkpoint first,
    naming every table that differs), or a :class:`RecModule` subclass, built from the saved hyper-parameters by
    its ``load_from_checkpoint``. Not collective: this process reads every table whole (peak memory about twice
    the float model, plus the quantized tables). ``trusted`` as in :func:`lightning_rec.checkpoint.load`; the
    other arguments as :func:`lightning_rec.quant.quantize_embeddings`.
    """
    if isinstance(model, type):
        if not issubclass(model, RecModule):
            raise TypeError(f"load_quantized takes a model or a RecModule subclass, got the class {model.__name__}")
        model = model.load_from_checkpoint(path, trusted_checkpoints=trusted)
    else:
        check_quantizable(model, dtype, output_dtype, per_table_weight_dtype)  # before reading anything
        resolved = checkpoint.resolve(path)
        if not checkpoint.is_checkpoint_dir(resolved):
            raise FileNotFoundError(f"{path} is not a checkpoint directory (no {checkpoint.META_FILE})")
        check_tables(resolved, model, trusted)
        state = checkpoint.read_checkpoint(resolved, trusted=trusted)["state_dict"]
        model.load_state_dict(state, strict=strict)
        del state
    model = quantize_embeddings(
        model,
        dtype,
        inplace=True,
        output_dtype=output_dtype,
        per_table_weight_dtype=per_table_weight_dtype,
        row_alignment=row_alignment,
        kernel=kernel,
    )
    return model.eval()
