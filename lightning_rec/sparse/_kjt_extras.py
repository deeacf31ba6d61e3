"""KeyedJaggedTensor helpers with TorchRec's names: ``kjt_is_equal`` and the to/from-dict modules."""

from __future__ import annotations

import torch
from torch import nn

from lightning_rec.sparse.jagged_tensor import JaggedTensor
from lightning_rec.sparse.keyed_jagged_tensor import KeyedJaggedTensor


def kjt_is_equal(kjt_1: KeyedJaggedTensor, kjt_2: KeyedJaggedTensor) -> bool:
    """Same keys, values, lengths, weights and strides (TorchRec's ``kjt_is_equal``)."""
    if not isinstance(kjt_1, KeyedJaggedTensor) or not isinstance(kjt_2, KeyedJaggedTensor):
        return False
    w1, w2 = kjt_1.weights_or_none(), kjt_2.weights_or_none()
    return (
        kjt_1.keys() == kjt_2.keys()
        and kjt_1.stride_per_key() == kjt_2.stride_per_key()
        and torch.equal(kjt_1.values(), kjt_2.values())
        and torch.equal(kjt_1.lengths(), kjt_2.lengths())
        and (w1 is None) == (w2 is None)
        and (w1 is None or torch.equal(w1, w2))  # type: ignore[arg-type]
    )


class ComputeKJTToJTDict(nn.Module):
    """``kjt.to_dict()`` as a module (TorchRec's name; fx / script friendly)."""

    def forward(self, keyed_jagged_tensor: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        return keyed_jagged_tensor.to_dict()


class ComputeJTDictToKJT(nn.Module):
    """``KeyedJaggedTensor.from_jt_dict`` as a module (TorchRec's name)."""

    def forward(self, jt_dict: dict[str, JaggedTensor]) -> KeyedJaggedTensor:
        return KeyedJaggedTensor.from_jt_dict(jt_dict)


__all__ = ["ComputeJTDictToKJT", "ComputeKJTToJTDict", "kjt_is_equal"]
