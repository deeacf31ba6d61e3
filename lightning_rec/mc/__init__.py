"""Managed collision ("zero-collision hashing"): raw 64-bit ids remapped into fixed-size tables, by bucket.

Public names follow TorchRec: ``MCHManagedCollisionModule`` (one table; ``LRU_EvictionPolicy`` /
``LFU_EvictionPolicy``), ``ManagedCollisionCollection`` and the ``ManagedCollisionEmbeddingBagCollection`` /
``ManagedCollisionEmbeddingCollection`` wrappers.
"""

from lightning_rec.mc.callbacks import ManagedCollisionCallback
from lightning_rec.mc.embedding import ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection
from lightning_rec.mc.modules import (
    DEFAULT_NUM_BUCKETS,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)

__all__ = [
    "DEFAULT_NUM_BUCKETS",
    "LFU_EvictionPolicy",
    "LRU_EvictionPolicy",
    "MCHManagedCollisionModule",
    "ManagedCollisionCallback",
    "ManagedCollisionCollection",
    "ManagedCollisionEmbeddingBagCollection",
    "ManagedCollisionEmbeddingCollection",
]
