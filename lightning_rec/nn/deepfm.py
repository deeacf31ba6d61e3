"""DeepFM's two interaction parts (Guo et al., 2017) with TorchRec's names: a deep module and an FM term."""

# No ``from __future__ import annotations``: fx-traced copies of these modules are TorchScript-ed by
# TorchRec users, and TorchScript needs the annotations as real objects.

import torch
from torch import nn


@torch.fx.wrap  # one fx node: a traced list cannot be iterated
def _flatten(embeddings: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([e.flatten(1) for e in embeddings], dim=1)


class DeepFM(nn.Module):
    """``dense_module`` applied to the flattened, concatenated embeddings (TorchRec's ``DeepFM``)."""

    def __init__(self, dense_module: nn.Module) -> None:
        super().__init__()
        self.dense_module = dense_module

    def forward(self, embeddings: list[torch.Tensor]) -> torch.Tensor:
        return self.dense_module(_flatten(embeddings))


class FactorizationMachine(nn.Module):
    """Second-order FM term ``0.5 * ((sum x)^2 - sum x^2)`` over the flattened embeddings: ``[B, 1]``."""

    def forward(self, embeddings: list[torch.Tensor]) -> torch.Tensor:
        x = _flatten(embeddings)
        s = x.sum(dim=1, keepdim=True)
        return 0.5 * (s * s - (x * x).sum(dim=1, keepdim=True))
