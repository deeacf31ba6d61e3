"""RecModule: a LightningModule that knows its embedding collections and its sharding."""

from __future__ import annotations

import lightning as L
from torch import nn

from lightning_rec.modules import EmbeddingBagCollection, EmbeddingCollection
from lightning_rec.sharding.plan import ShardingPlan
from lightning_rec.sharding.sharded import ShardedEmbeddingBagCollection, ShardedEmbeddingCollection, fused_optimizer

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

    def fused_optimizer(self):
        """The FusedOptimizer of this module's fused embedding kernels (None without ``embedding_optimizer``).

        Combine it with the dense optimizer in ``configure_optimizers`` so LR schedulers drive both:
        ``CombinedOptimizer([torch.optim.Adam(self.head.parameters()), self.fused_optimizer()])``.
        """
        return fused_optimizer(self)

    @property
    def device_mesh(self):
        """The ("replicate", "shard") DeviceMesh under the rec_sharded strategy, else None."""
        return getattr(self, "_device_mesh", None)
