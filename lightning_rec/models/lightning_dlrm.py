"""DLRM (Naumov et al., 2019) as a RecModule: bottom MLP, pooled embeddings, pairwise dots, top MLP.

Built from the parts of ``lightning_rec.models.dlrm`` (TorchRec's ``DenseArch``, ``SparseArch``,
``InteractionArch``, ``OverArch``), so its state_dict keys are those of TorchRec's ``DLRM`` and a TorchRec
DLRM checkpoint loads into it; the Lightning parts (steps, metrics, optimizers) are added on top.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.utilities.data import AttributeDict
from torchmetrics import MetricCollection

from lightning_rec.configs import EmbeddingBagConfig
from lightning_rec.embedding_modules import EmbeddingBagCollection
from lightning_rec.lightning.rec_module import RecModule
from lightning_rec.mc import (
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCallback,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    MCHManagedCollisionModule,
)
from lightning_rec.metrics import rec_metrics
from lightning_rec.models.dlrm import DenseArch, InteractionArch, OverArch, SparseArch
from lightning_rec.optim import CombinedOptimizer
from lightning_rec.plans.plan import ShardingPlan, row_wise, table_wise
from lightning_rec.sparse import KeyedJaggedTensor

_EMBEDDING_OPTIMIZERS = ("adagrad", "sgd", "sparse_adam")
_MC_KEYS = {"eviction_policy", "num_buckets", "zch_size", "tables", "row_init"}
_POLICIES: dict[str, type[LRU_EvictionPolicy | LFU_EvictionPolicy]] = {
    "lru": LRU_EvictionPolicy,
    "lfu": LFU_EvictionPolicy,
}
# a bucket of a few rows thrashes (its ids evict each other however stale the rest of the table is)
_MIN_BUCKET_ROWS = 16


def _unpack(batch: Any) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor | None]:
    # lightning_rec.data.Batch, or a (dense, sparse[, labels]) tuple for hand-made loaders
    if hasattr(batch, "dense") and hasattr(batch, "sparse"):
        return batch.dense, batch.sparse, getattr(batch, "labels", None)
    if isinstance(batch, (tuple, list)) and len(batch) in (2, 3):
        return batch[0], batch[1], batch[2] if len(batch) == 3 else None
    raise TypeError(
        f"DLRM expects a lightning_rec.data.Batch or a (dense, sparse, labels) tuple, got {type(batch).__name__}"
    )


def tables_from_cardinalities(
    feature_names: Sequence[str], num_embeddings_per_feature: Sequence[int], embedding_dim: int, pooling: str = "sum"
) -> list[EmbeddingBagConfig]:
    """One table per feature, named after the feature (so a plan names tables by feature)."""
    if len(feature_names) != len(num_embeddings_per_feature):
        raise ValueError(
            f"got {len(feature_names)} feature names but {len(num_embeddings_per_feature)} table sizes "
            "(num_embeddings_per_feature); give one per feature"
        )
    return [
        EmbeddingBagConfig(
            name=f, num_embeddings=int(n), embedding_dim=embedding_dim, feature_names=[f], pooling=pooling
        )
        for f, n in zip(feature_names, num_embeddings_per_feature)
    ]


def managed_tables(
    tables: Sequence[EmbeddingBagConfig], options: dict[str, Any]
) -> tuple[list[EmbeddingBagConfig], dict[str, MCHManagedCollisionModule]]:
    """Tables resized for managed collision, and one ``MCHManagedCollisionModule`` per managed table.

    ``options`` (``DLRM(managed_collision=...)``): ``tables`` (names; default all), ``zch_size`` (rows: one
    int, or ``{table: int}``; default the table's ``num_embeddings``), ``num_buckets`` (default 768, capped
    so that a bucket holds at least 16 rows), ``eviction_policy`` (``"lru"`` or ``"lfu"``). A managed table's
    rows are rounded up to a multiple of its bucket count.
    """
    unknown = sorted(set(options) - _MC_KEYS)
    if unknown:
        raise ValueError(f"managed_collision: unknown keys {unknown}; known keys: {sorted(_MC_KEYS)}")
    names = [t.name for t in tables]
    chosen = options.get("tables") or names
    missing = [t for t in chosen if t not in names]
    if missing:
        raise ValueError(f"managed_collision: tables {missing} are not tables of the model ({names})")
    policy = str(options.get("eviction_policy") or "lru").lower()
    if policy not in _POLICIES:
        raise ValueError(f"managed_collision: eviction_policy must be one of {list(_POLICIES)}, got {policy!r}")
    zch = options.get("zch_size")
    if isinstance(zch, dict):
        bad = sorted(set(zch) - set(chosen))
        if bad:
            raise ValueError(f"managed_collision: zch_size names tables {bad} that are not managed ({chosen})")
    buckets = int(options.get("num_buckets") or 768)
    if buckets < 1:
        raise ValueError(f"managed_collision: num_buckets must be positive, got {buckets}")
    out, modules = [], {}
    for t in tables:
        if t.name not in chosen:
            out.append(t)
            continue
        rows = int((zch.get(t.name) if isinstance(zch, dict) else zch) or t.num_embeddings)
        if rows < 1:
            raise ValueError(f"managed_collision: table {t.name!r}: zch_size must be positive, got {rows}")
        nb = min(buckets, max(1, rows // _MIN_BUCKET_ROWS))
        rows = -(-rows // nb) * nb
        out.append(dataclasses.replace(t, num_embeddings=rows))
        modules[t.name] = MCHManagedCollisionModule(
            rows, eviction_policy=_POLICIES[policy](), num_buckets=nb, name=t.name
        )
    return out, modules


def bucket_aligned_rows(rows: int, num_buckets: int, group_size: int) -> list[int]:
    """Row-block sizes of a row-wise table holding whole buckets: buckets dealt as evenly as possible."""
    per, extra = divmod(num_buckets, group_size)
    size = rows // num_buckets
    return [(per + (r < extra)) * size for r in range(group_size)]


class _ManagedSparseArch(SparseArch):
    """``SparseArch`` over a ``ManagedCollisionEmbeddingBagCollection``: raw ids in, pooled ``[B, F, D]`` out."""

    def __init__(self, mc_ebc: ManagedCollisionEmbeddingBagCollection) -> None:
        super().__init__(cast(EmbeddingBagCollection, mc_ebc.embedding_module))
        self.embedding_bag_collection = mc_ebc  # state_dict keys as TorchRec's: ..._embedding_module.embedding_bags

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled, _ = self.embedding_bag_collection(features)
        return pooled.values().reshape(-1, self.F, self.D)


class DLRM(RecModule):
    """DLRM click-through model: bottom MLP on dense features, an EmbeddingBagCollection on sparse ones,
    pairwise dot interaction, top MLP to one logit; trained with binary cross-entropy.

    Tables come from ``tables`` or, when it is None, one per feature (named after it) from
    ``feature_names`` and ``num_embeddings_per_feature`` (the data module's ``feature_names`` and
    ``cardinalities``; the example links them). Every table must have ``embedding_dim`` equal to the bottom
    MLP's last size: the interaction takes dot products between them.

    Validation and test log ``val_*`` / ``test_*`` AUROC, normalized entropy, calibration and log loss
    (``lightning_rec.metrics.rec_metrics``, synced across ranks) once per epoch, plus the loss.

    Args:
        num_dense: dense features per sample.
        feature_names / num_embeddings_per_feature / embedding_dim / pooling: build one table per feature.
        tables: explicit table configs (wins over the four above). Not saved in the hyper-parameters (a
            config may hold an ``init_fn``): pass them again to ``DLRM.load_from_checkpoint``.
        dense_arch_layer_sizes: bottom MLP sizes; must end with ``embedding_dim`` (default ``[64, D]``).
        over_arch_layer_sizes: top MLP sizes; must end with 1 (default ``[64, 32, 1]``).
        dense_lr: Adam learning rate of the MLPs.
        embedding_optimizer: torch optimizer of plain (non-fused) tables: ``"adagrad"``, ``"sgd"`` or
            ``"sparse_adam"``. Tables the strategy fuses (``embedding_optimizer=`` on the strategy) are
            updated inside backward by their kernel instead, and joined here so LR schedulers reach them.
        embedding_lr: learning rate of that optimizer.
        sparse_grad: sparse table gradients, so an optimizer step costs what the batch touched.
        kernel: lookup kernel of the unsharded collection (``"auto"``, ``"torch"``, ``"fbgemm"``).
        plan: a ``ShardingPlan`` for the ``"sparse_arch.embedding_bag_collection"`` module
            (``"sparse_arch.embedding_bag_collection._embedding_module"`` with managed collision), or None to
            let the strategy choose (with managed collision: managed tables row-wise in whole buckets, others
            table-wise).
        raw_ids: the sparse features are raw ids (``ClickDataModule(raw_ids=True)``; the CLI links it): turns
            on managed collision with the default options when ``managed_collision`` is not given.
        managed_collision: put tables behind managed collision (TorchRec's MC-EBC: raw 64-bit ids remapped to
            rows, stale ids evicted): a dict with ``eviction_policy`` (``lru`` / ``lfu``), ``num_buckets``
            (768), ``zch_size`` (rows, an int or ``{table: int}``; default the table size), ``tables``
            (default all), ``row_init`` (``uniform`` / ``zeros``); see :func:`managed_tables`. Hit rate and
            evictions are logged per epoch (``mc/hit_rate``, ``mc/evicted``, per table ``mc/<path>/<table>/...``)
            and printed by rank 0 (:class:`~lightning_rec.mc.ManagedCollisionCallback`).
    """

    def __init__(
        self,
        num_dense: int = 13,
        feature_names: list[str] | None = None,
        num_embeddings_per_feature: list[int] | None = None,
        embedding_dim: int = 16,
        pooling: str = "sum",
        tables: list[EmbeddingBagConfig] | None = None,
        dense_arch_layer_sizes: list[int] | None = None,
        over_arch_layer_sizes: list[int] | None = None,
        dense_lr: float = 1e-3,
        embedding_optimizer: str = "adagrad",
        embedding_lr: float = 0.05,
        sparse_grad: bool = True,
        kernel: str = "auto",
        plan: ShardingPlan | None = None,
        raw_ids: bool = False,
        managed_collision: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["tables", "plan"])
        if tables is None:
            if feature_names is None or num_embeddings_per_feature is None:
                raise ValueError(
                    "DLRM needs `tables`, or `feature_names` and `num_embeddings_per_feature` to build one table each"
                )
            tables = tables_from_cardinalities(feature_names, num_embeddings_per_feature, embedding_dim, pooling)
        if not tables:
            raise ValueError("DLRM needs at least one embedding table")
        if managed_collision is None and raw_ids:
            managed_collision = {}
        mc_modules: dict[str, MCHManagedCollisionModule] = {}
        if managed_collision is not None:
            if not isinstance(managed_collision, dict):
                raise TypeError(f"managed_collision must be a dict of options, got {type(managed_collision).__name__}")
            tables, mc_modules = managed_tables(tables, managed_collision)
        dense_sizes = list(dense_arch_layer_sizes) if dense_arch_layer_sizes else [64, tables[0].embedding_dim]
        over_sizes = list(over_arch_layer_sizes) if over_arch_layer_sizes else [64, 32, 1]
        d = dense_sizes[-1]
        for t in tables:
            if t.embedding_dim != d:
                raise ValueError(
                    f"table {t.name!r} has embedding_dim {t.embedding_dim} but the bottom MLP ends with {d}: "
                    "DLRM's interaction needs every table's embedding_dim equal to dense_arch_layer_sizes[-1]"
                )
        if len(over_sizes) < 2 or over_sizes[-1] != 1:
            raise ValueError(
                f"over_arch_layer_sizes needs at least two sizes and must end with 1 (one logit per sample), "
                f"got {over_sizes}"
            )
        if embedding_optimizer not in _EMBEDDING_OPTIMIZERS:
            raise ValueError(
                f"embedding_optimizer must be one of {list(_EMBEDDING_OPTIMIZERS)}, got {embedding_optimizer!r}"
            )
        if embedding_optimizer == "sparse_adam" and not sparse_grad:
            raise ValueError("embedding_optimizer='sparse_adam' needs sparse_grad=True")
        num_features = sum(len(t.feature_names) for t in tables)
        self.dense_arch = DenseArch(num_dense, dense_sizes)
        ebc = EmbeddingBagCollection(tables, kernel=kernel, sparse_grad=sparse_grad)
        if mc_modules:
            mcc = ManagedCollisionCollection(mc_modules, tables)
            row_init = (managed_collision or {}).get("row_init", "uniform")
            self.sparse_arch: SparseArch = _ManagedSparseArch(
                ManagedCollisionEmbeddingBagCollection(ebc, mcc, row_init=row_init)
            )
        else:
            self.sparse_arch = SparseArch(ebc)
        self._mc_modules = dict(mc_modules)
        self.inter_arch = InteractionArch(num_features)
        self.over_arch = OverArch(d + num_features * (num_features + 1) // 2, over_sizes)
        self._plan = plan
        self.num_dense = num_dense

        self.val_metrics = rec_metrics("val_")
        self.test_metrics = rec_metrics("test_")

    def configure_sharding(self) -> ShardingPlan | None:
        if self._plan is not None or not self._mc_modules:
            return self._plan
        # managed tables need whole buckets per rank (row-wise) and no replicas (not data-parallel)
        mesh = self.device_mesh
        group = mesh["shard"].size() if mesh is not None else 1
        plan = {}
        mc_ebc = cast(ManagedCollisionEmbeddingBagCollection, self.sparse_arch.embedding_bag_collection)
        for i, t in enumerate(cast(EmbeddingBagCollection, mc_ebc.embedding_module).embedding_bag_configs()):
            m = self._mc_modules.get(t.name)
            plan[t.name] = (
                row_wise(bucket_aligned_rows(m.zch_size, m.num_buckets, group))
                if m is not None
                else table_wise(i % group)
            )
        return ShardingPlan({"sparse_arch.embedding_bag_collection._embedding_module": plan})

    def configure_callbacks(self) -> list[L.Callback]:
        # hit rate and evictions per epoch, logged and printed by rank 0; Lightning would replace a
        # ManagedCollisionCallback the user configured (e.g. with resize_at) by this one, so keep theirs
        if not self._mc_modules or any(isinstance(c, ManagedCollisionCallback) for c in self.trainer.callbacks):  # type: ignore[attr-defined]  # set by Lightning's callback connector
            return []
        return [ManagedCollisionCallback(print_stats=True)]

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """Logits ``[B]``."""
        # a torch.fx Proxy is no Tensor: the check is skipped while fx traces (it cannot branch on a Proxy)
        if isinstance(dense, torch.Tensor) and (dense.dim() != 2 or dense.size(1) != self.num_dense):
            raise ValueError(f"dense features must be [batch, {self.num_dense}], got {tuple(dense.shape)}")
        d = self.dense_arch(dense)
        s = self.sparse_arch(sparse)
        return self.over_arch(self.inter_arch(d, s.to(d.dtype))).squeeze(1)  # [B]: the loss takes [B] labels

    def _loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dense, sparse, labels = _unpack(batch)
        if labels is None:
            raise ValueError("this step needs labels: the batch has none")
        logits = self(dense, sparse)
        return F.binary_cross_entropy_with_logits(logits.float(), labels.float()), logits, labels

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, _, labels = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=len(labels))
        return loss

    def _eval_step(self, batch: Any, metrics: MetricCollection, prefix: str) -> None:
        loss, logits, labels = self._loss(batch)
        metrics.update(torch.sigmoid(logits.float()).detach(), labels.long())
        self.log(f"{prefix}loss", loss, sync_dist=True, batch_size=len(labels))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._eval_step(batch, self.val_metrics, "val_")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._eval_step(batch, self.test_metrics, "test_")

    def _log_metrics(self, metrics: MetricCollection) -> None:
        # compute() already syncs the metric states over every rank (torchmetrics); sync_dist then averages
        # equal values, which changes nothing but tells Lightning the epoch values are global
        self.log_dict({k: v.float() for k, v in metrics.compute().items()}, prog_bar=True, sync_dist=True)
        metrics.reset()

    def on_validation_epoch_end(self) -> None:
        self._log_metrics(self.val_metrics)

    def on_test_epoch_end(self) -> None:
        self._log_metrics(self.test_metrics)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        dense, sparse, _ = _unpack(batch)
        return torch.sigmoid(self(dense, sparse))

    def configure_optimizers(self) -> torch.optim.Optimizer:

        tables = {id(p) for m in self.embedding_modules().values() for p in m.parameters()}
        # fused tables do not require grad: their kernel updates them inside backward
        emb = [p for p in self.parameters() if id(p) in tables and p.requires_grad]
        dense = [p for p in self.parameters() if id(p) not in tables and p.requires_grad]
        hp = cast(AttributeDict, self.hparams)  # save_hyperparameters() made it an AttributeDict
        opts: list[torch.optim.Optimizer | None] = [torch.optim.Adam(dense, lr=hp.dense_lr) if dense else None]
        if emb:
            kind = hp.embedding_optimizer
            if kind == "adagrad":
                opts.append(torch.optim.Adagrad(emb, lr=hp.embedding_lr))
            elif kind == "sgd":
                opts.append(torch.optim.SGD(emb, lr=hp.embedding_lr))
            else:
                opts.append(torch.optim.SparseAdam(emb, lr=hp.embedding_lr))
        opts.append(self.fused_optimizer())
        return CombinedOptimizer(opts)
