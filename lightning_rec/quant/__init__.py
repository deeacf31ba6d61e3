"""Quantized embedding tables for inference, with TorchRec's names.

``quantize_embeddings(model, dtype=torch.qint8)`` (TorchRec's ``torchrec.inference.modules.quantize_embeddings``)
replaces each unsharded collection by its quantized copy; the quantized ``EmbeddingBagCollection`` /
``EmbeddingCollection`` (TorchRec's ``torchrec.quant.embedding_modules``) take the same KeyedJaggedTensor and give
the same outputs, looked up by fbgemm's inference kernel. ``load_quantized(checkpoint_dir, model)`` goes from a
training checkpoint directory (any plan, any world size) to a quantized model in one process.

Modules: ``rows`` (fbgemm's row-wise storage: types, bytes, quantizing and reading rows), ``lookup`` (the
fbgemm kernels over the stored rows, or torch), ``embedding_modules`` (the collections), ``quantize``
(``quantize_embeddings``), ``checkpoint`` (``load_quantized``), ``mc`` (managed-collision collections served
quantized: TorchRec's ``QuantManagedCollisionEmbeddingBagCollection`` / ``QuantManagedCollisionEmbeddingCollection``,
the trained id -> row maps read only in front of the quantized tables).
"""

from lightning_rec.quant.checkpoint import check_tables, load_quantized
from lightning_rec.quant.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from lightning_rec.quant.mc import (
    FrozenManagedCollisionCollection,
    FrozenMCHModule,
    QuantManagedCollisionEmbeddingBagCollection,
    QuantManagedCollisionEmbeddingCollection,
)
from lightning_rec.quant.quantize import check_quantizable, quantize_embeddings
from lightning_rec.quant.rows import DEFAULT_ROW_ALIGNMENT, TORCHREC_ROW_ALIGNMENT, QuantConfig, row_bytes, storage_type
from lightning_rec.quant.shared import load_quantized_tables, save_quantized

__all__ = [
    "DEFAULT_ROW_ALIGNMENT",
    "TORCHREC_ROW_ALIGNMENT",
    "EmbeddingBagCollection",
    "EmbeddingCollection",
    "FrozenMCHModule",
    "FrozenManagedCollisionCollection",
    "QuantConfig",
    "QuantManagedCollisionEmbeddingBagCollection",
    "QuantManagedCollisionEmbeddingCollection",
    "check_quantizable",
    "check_tables",
    "load_quantized",
    "load_quantized_tables",
    "quantize_embeddings",
    "row_bytes",
    "save_quantized",
    "storage_type",
]
