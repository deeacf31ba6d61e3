"""Ready-made recommendation models.

- ``DLRM``: the Lightning DLRM (a RecModule: steps, metrics, optimizers), built from TorchRec's parts.
- ``lightning_rec.models.dlrm``: TorchRec's DLRM family as plain ``nn.Module``s (``torchrec.models.dlrm``).
- ``TwoTowerRetrieval``: a retrieval two-tower model on sequence embeddings.
"""

from lightning_rec.models.dlrm import (
    DLRM_DCN,
    DenseArch,
    DLRM_Projection,
    DLRMTrain,
    InteractionArch,
    InteractionDCNArch,
    InteractionProjectionArch,
    OverArch,
    SparseArch,
)
from lightning_rec.models.lightning_dlrm import DLRM, tables_from_cardinalities
from lightning_rec.models.retrieval import SyntheticSessions, TwoTowerRetrieval

__all__ = [
    "DLRM",
    "DLRM_DCN",
    "DLRMTrain",
    "DLRM_Projection",
    "DenseArch",
    "InteractionArch",
    "InteractionDCNArch",
    "InteractionProjectionArch",
    "OverArch",
    "SparseArch",
    "SyntheticSessions",
    "TwoTowerRetrieval",
    "tables_from_cardinalities",
]
