"""A two-tower retrieval model over sequence embeddings (``EmbeddingCollection``), and synthetic sessions.

The query tower reads the user id and the user's recent items *as a sequence*: every history position
gets its own vector (no pooling in the table), a position embedding is added, and the tower pools after
that. This is what pooled tables cannot express, and it runs the sharded ``EmbeddingCollection`` path end
to end. Training uses in-batch negatives: each sample's candidate is the positive, the other candidates
of the same (local) batch are the negatives.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric.utilities.data import AttributeDict
from torch import nn
from torch.utils.data import IterableDataset

from lightning_rec.configs import EmbeddingConfig
from lightning_rec.embedding_modules import EmbeddingCollection
from lightning_rec.lightning.rec_module import RecModule
from lightning_rec.optim import CombinedOptimizer
from lightning_rec.plans.plan import ShardingPlan
from lightning_rec.sparse import JaggedTensor, KeyedJaggedTensor

FEATURES = ("user_id", "history", "candidate")


def _one_per_sample(name: str, jt: JaggedTensor) -> torch.Tensor:
    lengths = jt.lengths()
    if lengths.numel() and not bool((lengths == 1).all()):
        bad = int((lengths != 1).nonzero()[0])
        raise ValueError(f"feature {name!r} must have exactly one id per sample; sample {bad} has {int(lengths[bad])}")
    return jt.values()


def mlp(in_features: int, layer_sizes: Sequence[int], last_activation: bool = True) -> nn.Sequential:
    """Linear layers with ReLU between them (and after the last one unless ``last_activation=False``)."""
    layers: list[nn.Module] = []
    for i, out in enumerate(layer_sizes):
        layers.append(nn.Linear(in_features, out))
        if last_activation or i < len(layer_sizes) - 1:
            layers.append(nn.ReLU())
        in_features = out
    return nn.Sequential(*layers)


class TwoTowerRetrieval(RecModule):
    """Two-tower retrieval: ``query(user, history sequence)`` and ``candidate(item)`` vectors, dot-product scored.

    Input per batch: a KeyedJaggedTensor with ``user_id`` (one id per sample), ``history`` (the user's
    recent items, most recent last, any length including 0) and ``candidate`` (one item the user engaged
    with). ``history`` and ``candidate`` share the ``items`` table. The loss is the softmax cross-entropy
    of each query against every candidate of its local batch (in-batch negatives), so every rank's loss
    depends only on its own batch; validation logs ``val_loss`` and ``val_recall`` (the share of queries
    whose own candidate ranks in the top ``recall_k`` of their batch), synced across ranks.

    Args:
        num_users / num_items: table sizes.
        embedding_dim: table width and position-embedding width.
        max_history: positions beyond this (counted from the most recent) share the last position vector.
        tower_sizes: both towers' MLP sizes; the last is the retrieval vector's width.
        temperature: scores are cosine similarities divided by it.
        lr: Adam learning rate of the towers; ``embedding_lr`` is Adagrad's for the tables.
        plan: a ``ShardingPlan`` for the ``"embeddings"`` module, or None to let the strategy choose.
    """

    def __init__(
        self,
        num_users: int = 1000,
        num_items: int = 2000,
        embedding_dim: int = 16,
        max_history: int = 8,
        tower_sizes: list[int] | None = None,
        temperature: float = 0.1,
        recall_k: int = 10,
        lr: float = 3e-3,
        embedding_lr: float = 0.05,
        plan: ShardingPlan | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["plan"])
        sizes = list(tower_sizes) if tower_sizes else [32, 16]
        self.embeddings = EmbeddingCollection(
            [
                EmbeddingConfig(
                    name="users", num_embeddings=num_users, embedding_dim=embedding_dim, feature_names=["user_id"]
                ),
                EmbeddingConfig(
                    name="items",
                    num_embeddings=num_items,
                    embedding_dim=embedding_dim,
                    feature_names=["history", "candidate"],
                ),
            ]
        )
        self.position = nn.Embedding(max_history, embedding_dim)
        self.query_tower = mlp(2 * embedding_dim, sizes, last_activation=False)
        self.candidate_tower = mlp(embedding_dim, sizes, last_activation=False)
        self._plan = plan

    def configure_sharding(self) -> ShardingPlan | None:
        return self._plan

    def _pool_history(self, jt: JaggedTensor, batch_size: int) -> torch.Tensor:
        lengths = jt.lengths()
        emb = jt.values()
        sample = torch.repeat_interleave(torch.arange(batch_size, device=emb.device), lengths)
        # position 0 is the most recent item: recency matters more than the absolute index
        index_in_bag = torch.arange(emb.size(0), device=emb.device) - jt.offsets()[:-1].repeat_interleave(lengths)
        pos = (lengths.repeat_interleave(lengths) - 1 - index_in_bag).clamp_max(self.position.num_embeddings - 1)
        x = emb + self.position(pos).to(emb.dtype)
        pooled = torch.zeros(batch_size, emb.size(1), dtype=emb.dtype, device=emb.device).index_add(0, sample, x)
        return pooled / lengths.clamp_min(1).unsqueeze(1).to(emb.dtype)

    def forward(self, features: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unit-norm ``(query [B, K], candidate [B, K])``."""
        embs = self.embeddings(features)
        b = features.stride()
        user = _one_per_sample("user_id", embs["user_id"])
        cand = _one_per_sample("candidate", embs["candidate"])
        query = self.query_tower(torch.cat([user, self._pool_history(embs["history"], b)], dim=1))
        return F.normalize(query, dim=1), F.normalize(self.candidate_tower(cand), dim=1)

    def scores(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """``[B, B]``: query i against candidate j of the same batch, divided by the temperature."""
        query, cand = self(features)
        return query @ cand.t() / cast(AttributeDict, self.hparams).temperature

    def loss(self, features: KeyedJaggedTensor) -> torch.Tensor:
        s = self.scores(features)
        return F.cross_entropy(s, torch.arange(s.size(0), device=s.device))

    def training_step(self, batch: KeyedJaggedTensor, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=batch.stride())
        return loss

    def validation_step(self, batch: KeyedJaggedTensor, batch_idx: int) -> None:
        s = self.scores(batch)
        b = s.size(0)
        own = s.diagonal().unsqueeze(1)
        rank_of_own = (s > own).sum(1)  # candidates scored above the positive
        recall = (rank_of_own < min(cast(AttributeDict, self.hparams).recall_k, b)).float().mean()
        loss = F.cross_entropy(s, torch.arange(b, device=s.device))
        self.log_dict({"val_loss": loss, "val_recall": recall}, sync_dist=True, batch_size=b)

    def predict_step(self, batch: KeyedJaggedTensor, batch_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:

        tables = {id(p) for p in self.embeddings.parameters()}
        emb = [p for p in self.parameters() if id(p) in tables and p.requires_grad]
        dense = [p for p in self.parameters() if id(p) not in tables and p.requires_grad]
        hp = cast(AttributeDict, self.hparams)  # save_hyperparameters() made it an AttributeDict
        return CombinedOptimizer(
            [
                torch.optim.Adam(dense, lr=hp.lr),
                torch.optim.Adagrad(emb, lr=hp.embedding_lr) if emb else None,
                self.fused_optimizer(),
            ]
        )


class SyntheticSessions(IterableDataset):
    """Batches of ``user_id`` / ``history`` / ``candidate`` KJTs with a learnable structure.

    Items fall into ``num_clusters`` groups (item ``i`` in group ``i % num_clusters``); each user prefers
    one group. A user's history holds 0..``max_history`` items, each from the preferred group with
    probability ``affinity`` (else any item), and the candidate is always from the preferred group, so a
    model that reads the history beats chance recall. Batch ``i`` depends only on ``(seed, i)``; a
    rank iterates batches ``rank, rank + world_size, ...`` (taken from torch.distributed when not given),
    so ranks never see the same batch. The last ``num_batches % world_size`` batches are dropped: every
    rank must run the same number of sharded steps. Yields ready batches: use
    ``DataLoader(ds, batch_size=None)``.
    """

    def __init__(
        self,
        num_batches: int,
        batch_size: int = 64,
        num_users: int = 1000,
        num_items: int = 2000,
        num_clusters: int = 20,
        max_history: int = 8,
        affinity: float = 0.8,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if num_items < num_clusters:
            raise ValueError(f"num_items ({num_items}) must be at least num_clusters ({num_clusters})")
        self.num_batches, self.batch_size = num_batches, batch_size
        self.num_users, self.num_items, self.num_clusters = num_users, num_items, num_clusters
        self.max_history, self.affinity, self.seed = max_history, affinity, seed
        self.rank, self.world_size = rank, world_size

    def _shard(self) -> tuple[int, int]:
        if self.rank is not None:
            return self.rank, self.world_size or 1
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def _items_in_clusters(self, clusters: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        per_cluster = (self.num_items - clusters - 1) // self.num_clusters + 1  # items i with i % C == cluster
        k = (torch.rand(clusters.shape, generator=g) * per_cluster).long()
        return clusters + k * self.num_clusters

    def batch(self, index: int) -> KeyedJaggedTensor:
        """Batch number ``index`` (deterministic)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        b = self.batch_size
        users = torch.randint(0, self.num_users, (b,), generator=g)
        cluster = users * 7919 % self.num_clusters  # a fixed preference per user
        lengths = torch.randint(0, self.max_history + 1, (b,), generator=g)
        hist_cluster = cluster.repeat_interleave(lengths)
        history = self._items_in_clusters(hist_cluster, g)
        noise = torch.rand(history.shape, generator=g) >= self.affinity
        history = torch.where(noise, torch.randint(0, self.num_items, history.shape, generator=g), history)
        candidate = self._items_in_clusters(cluster, g)
        ones = torch.ones(b, dtype=torch.long)
        return KeyedJaggedTensor(
            list(FEATURES), torch.cat([users, history, candidate]), lengths=torch.cat([ones, lengths, ones])
        )

    def __iter__(self) -> Iterator[KeyedJaggedTensor]:
        rank, world = self._shard()
        for step in range(self.num_batches // world):
            yield self.batch(step * world + rank)

    def __len__(self) -> int:
        return self.num_batches // self._shard()[1]
