"""Ready-made recommendation models: DLRM (ranking) and a two-tower retrieval model (sequence embeddings)."""

from lightning_rec.models.dlrm import DLRM, DenseArch, InteractionArch, OverArch, SparseArch, tables_from_cardinalities
from lightning_rec.models.retrieval import SyntheticSessions, TwoTowerRetrieval

__all__ = [
    "DLRM",
    "DenseArch",
    "InteractionArch",
    "OverArch",
    "SparseArch",
    "SyntheticSessions",
    "TwoTowerRetrieval",
    "tables_from_cardinalities",
]
