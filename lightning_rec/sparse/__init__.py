"""Sparse input and output types with TorchRec's names: JaggedTensor, KeyedJaggedTensor, KeyedTensor.

All three are ``torch.fx`` proxyable (building one from traced tensors records a node) and skip their
data-dependent checks under ``torch.compile``, so models holding them trace and compile without graph breaks.
"""

from lightning_rec.sparse._utils import SparseInputError, offsets_from_lengths
from lightning_rec.sparse._utils import segment_gather_index as _segment_gather_index
from lightning_rec.sparse.jagged_tensor import JaggedTensor, jt_is_equal
from lightning_rec.sparse.keyed_jagged_tensor import (
    ComputeJTDictToKJT,
    ComputeKJTToJTDict,
    KeyedJaggedTensor,
    kjt_is_equal,
)
from lightning_rec.sparse.keyed_tensor import KeyedTensor

__all__ = [
    "ComputeJTDictToKJT",
    "ComputeKJTToJTDict",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "SparseInputError",
    "_segment_gather_index",
    "jt_is_equal",
    "kjt_is_equal",
    "offsets_from_lengths",
]
