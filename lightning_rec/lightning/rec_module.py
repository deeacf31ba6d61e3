"""RecModule: a LightningModule that knows its embedding collections and its sharding."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import IO, Any, Self

import lightning as L
import torch
from lightning.pytorch.core.saving import load_hparams_from_tags_csv, load_hparams_from_yaml
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_rec import _compat
from lightning_rec import checkpoint as ckpt
from lightning_rec.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from lightning_rec.optim import FusedOptimizer
from lightning_rec.pipeline.shard_modules import (
    ShardedEmbeddingBagCollection,
    ShardedEmbeddingCollection,
    fused_optimizer,
    materialize_dense,
)
from lightning_rec.plans.plan import ShardingPlan

_COLLECTIONS = (EmbeddingBagCollection, EmbeddingCollection, ShardedEmbeddingBagCollection, ShardedEmbeddingCollection)


class RecModule(L.LightningModule):
    """Base LightningModule for recommendation models.

    Works unchanged on one process without any strategy (that run is the reference); under
    ``Trainer(strategy="rec_sharded")`` its embedding collections are sharded before optimizers are built.
    Override :meth:`configure_sharding` to choose placements per table.
    """

    def configure_sharding(self) -> ShardingPlan | None:
        """Return a plan for this module's collections, or None to let the strategy choose."""
        return None

    def embedding_modules(self) -> dict[str, nn.Module]:
        """``{module path: collection}`` for every (sharded or unsharded) embedding collection."""
        return {name: m for name, m in self.named_modules() if isinstance(m, _COLLECTIONS)}

    def fused_optimizer(self) -> FusedOptimizer | None:
        """The FusedOptimizer of this module's fused embedding kernels (None without ``embedding_optimizer``).

        Combine it with the dense optimizer in ``configure_optimizers`` so LR schedulers drive both:
        ``CombinedOptimizer([torch.optim.Adam(self.head.parameters()), self.fused_optimizer()])``.
        """
        return fused_optimizer(self)

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The ("replicate", "shard") DeviceMesh under the rec_sharded strategy, else None."""
        return getattr(self, "_device_mesh", None)

    @_compat.restricted_classmethod
    def load_from_checkpoint(
        cls,
        checkpoint_path: str | os.PathLike | IO,
        map_location: Any = None,
        hparams_file: str | os.PathLike | None = None,
        strict: bool | None = None,
        weights_only: bool | None = None,
        trusted_checkpoints: bool = False,
        **kwargs: Any,
    ) -> Self:
        """Lightning's ``load_from_checkpoint``, which also reads the checkpoint directories ``rec_sharded`` writes.

        A directory (DCP shards + ``meta.pt``, written by any plan and world size) loads into this one process,
        unsharded: the module is built from the saved hyper-parameters (``kwargs`` and ``hparams_file`` override
        them), ``on_load_checkpoint`` sees the checkpoint with a ``"state_dict"`` of whole tables, the state is
        loaded (``strict``) and the module is moved to the state's device. Not collective. ``map_location``: the
        stored tensors have no device; they are read onto the device it maps ``"cpu"`` to (a device, a dict
        ``{"cpu": device}`` or a ``torch.load``-style callable); default CPU. A file loads exactly as Lightning's.

        Args:
            trusted_checkpoints: unpickle the files fully, running any code they name (as
                ``RecShardedStrategy(trusted_checkpoints=True)``; ``weights_only=False`` means the same). Only for
                checkpoints you wrote whose hyper-parameters hold arbitrary objects; by default such files are
                refused with ``UnsafeCheckpointError`` and nothing in them runs.
        """
        trusted = trusted_checkpoints or weights_only is False
        path = checkpoint_path
        if not (isinstance(path, (str, os.PathLike)) and Path(ckpt.resolve(path)).is_dir()):
            if trusted and weights_only is None:
                weights_only = False
            # Lightning annotates str | Path and accepts any os.PathLike
            return super().load_from_checkpoint(
                checkpoint_path,  # type: ignore[arg-type]
                map_location,
                hparams_file,  # type: ignore[arg-type]
                strict,
                weights_only,
                **kwargs,
            )
        checkpoint = ckpt.read_checkpoint(path, trusted=trusted, device=_stored_device(map_location))
        if hparams_file is not None:  # as Lightning: the file replaces the saved hyper-parameters
            extension = str(hparams_file).rsplit(".", 1)[-1].lower()
            if extension == "csv":
                checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY] = load_hparams_from_tags_csv(hparams_file)  # type: ignore[arg-type]
            elif extension in ("yml", "yaml"):
                checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY] = load_hparams_from_yaml(hparams_file)  # type: ignore[arg-type]
            else:
                raise ValueError(".csv, .yml or .yaml is required for `hparams_file`")
        checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {}).update(kwargs)
        with warnings.catch_warnings():
            # a meta-built model is loaded again below, once it has storage: torch's notice is not the user's
            warnings.filterwarnings("ignore", message=r".*to a meta parameter in the current model.*")
            model = _compat.lightning_load_state(cls, checkpoint, strict, **kwargs)
        state = checkpoint["state_dict"]
        if not state:
            rank_zero_warn(f"The state dict in {str(path)!r} contains no parameters.")
            return model
        device = next(iter(state.values())).device
        if any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()]):
            # configure_model built on the meta device, and loading copied into nothing: give the model storage
            # (and what reset_parameters() derives, such as non-persistent buffers), then load again
            materialize_dense(model, device, "load_from_checkpoint")
            model.load_state_dict(state, strict=model.strict_loading if strict is None else strict)
        return model.to(device)


def _stored_device(map_location: Any) -> torch.device:
    """Where ``map_location`` puts a CPU storage: DCP files record no device, so every tensor is read as one."""
    if map_location is None:
        return torch.device("cpu")
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    if isinstance(map_location, dict):
        return torch.device(map_location.get("cpu", "cpu"))
    moved = map_location(torch.empty(0).untyped_storage(), "cpu")
    return torch.device("cpu") if moved is None else moved.device
