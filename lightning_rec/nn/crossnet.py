"""Deep & Cross Network layers (Wang et al., DCN-V2, 2020) with TorchRec's names and parameter keys.

Every layer maps ``[B, N] -> [B, N]``; ``x0`` is the input and ``xl`` the previous layer's output.
"""

# No ``from __future__ import annotations``: fx-traced copies of these modules are TorchScript-ed by
# TorchRec users, and TorchScript needs the annotations as real objects.

from collections.abc import Callable

import torch
from torch import nn


def _xavier(*shape: int) -> nn.Parameter:
    return nn.Parameter(nn.init.xavier_normal_(torch.empty(*shape)))


def _zeros(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape))


class CrossNet(nn.Module):
    """Full-rank cross layers: ``x_{l+1} = x0 * (W_l x_l + b_l) + x_l``."""

    def __init__(self, in_features: int, num_layers: int) -> None:
        super().__init__()
        self._num_layers = num_layers
        self.kernels = nn.ParameterList([_xavier(in_features, in_features) for _ in range(num_layers)])
        self.bias = nn.ParameterList([_zeros(in_features, 1) for _ in range(num_layers)])

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x0 = input.unsqueeze(2)  # [B, N, 1]
        xl = x0
        for layer in range(self._num_layers):
            xl = x0 * (torch.matmul(self.kernels[layer], xl) + self.bias[layer]) + xl
        return xl.squeeze(2)


class LowRankCrossNet(nn.Module):
    """Cross layers with ``W_l = U_l V_l`` of rank ``low_rank``: ``x_{l+1} = x0 * (W (V x_l) + b) + x_l``."""

    def __init__(self, in_features: int, num_layers: int, low_rank: int = 1) -> None:
        super().__init__()
        if low_rank < 1:
            raise ValueError(f"low_rank must be at least 1, got {low_rank}")
        self._num_layers = num_layers
        self._low_rank = low_rank
        self.W_kernels = nn.ParameterList([_xavier(in_features, low_rank) for _ in range(num_layers)])
        self.V_kernels = nn.ParameterList([_xavier(low_rank, in_features) for _ in range(num_layers)])
        self.bias = nn.ParameterList([_zeros(in_features) for _ in range(num_layers)])

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x0 = xl = input
        for layer in range(self._num_layers):
            low = nn.functional.linear(xl, self.V_kernels[layer])
            xl = x0 * (nn.functional.linear(low, self.W_kernels[layer]) + self.bias[layer]) + xl
        return xl


class VectorCrossNet(nn.Module):
    """Cross layers with a vector kernel: ``x_{l+1} = x0 * (x_l . w_l) + b_l + x_l``."""

    def __init__(self, in_features: int, num_layers: int) -> None:
        super().__init__()
        self._num_layers = num_layers
        self.kernels = nn.ParameterList([_xavier(in_features, 1) for _ in range(num_layers)])
        self.bias = nn.ParameterList([_zeros(in_features, 1) for _ in range(num_layers)])

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x0 = input.unsqueeze(2)
        xl = x0
        for layer in range(self._num_layers):
            dot = torch.tensordot(xl, self.kernels[layer], dims=([1], [0]))  # [B, 1, 1]
            xl = torch.matmul(x0, dot) + self.bias[layer] + xl
        return xl.squeeze(2)


class LowRankMixtureCrossNet(nn.Module):
    """Mixture of low-rank cross experts with softmax gates (DCN-V2's "mixture of experts" variant).

    Expert ``i``: ``x0 * (U_i g(C_i g(V_i x_l)) + b_l)``; the layer output is the gated sum plus ``x_l``.
    """

    def __init__(
        self,
        in_features: int,
        num_layers: int,
        num_experts: int = 1,
        low_rank: int = 1,
        activation: nn.Module | Callable[[torch.Tensor], torch.Tensor] = torch.relu,
    ) -> None:
        super().__init__()
        if num_experts < 1 or low_rank < 1:
            raise ValueError(f"num_experts and low_rank must be at least 1, got {num_experts}, {low_rank}")
        self._num_layers = num_layers
        self._num_experts = num_experts
        self._low_rank = low_rank
        self._in_features = in_features
        self.U_kernels = nn.ParameterList([_xavier(num_experts, in_features, low_rank) for _ in range(num_layers)])
        self.V_kernels = nn.ParameterList([_xavier(num_experts, low_rank, in_features) for _ in range(num_layers)])
        self.bias = nn.ParameterList([_zeros(in_features, 1) for _ in range(num_layers)])
        self.gates = (
            nn.ModuleList([nn.Linear(in_features, 1, bias=False) for _ in range(num_experts)])
            if num_experts > 1
            else None
        )
        self._activation = activation
        self.C_kernels = nn.ParameterList([_xavier(num_experts, low_rank, low_rank) for _ in range(num_layers)])

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x0 = input.unsqueeze(2)  # [B, N, 1]
        xl = x0
        for layer in range(self._num_layers):
            experts = []
            for i in range(self._num_experts):
                e = self._activation(torch.matmul(self.V_kernels[layer][i], xl))  # [B, r, 1]
                e = self._activation(torch.matmul(self.C_kernels[layer][i], e))
                e = torch.matmul(self.U_kernels[layer][i], e)  # [B, N, 1]
                experts.append(x0 * (e + self.bias[layer]))
            stacked = torch.cat(experts, dim=2)  # [B, N, K]
            if self.gates is not None:
                gating = torch.stack([g(xl.squeeze(2)) for g in self.gates], dim=1)  # [B, K, 1]
                mixed = torch.matmul(stacked, torch.softmax(gating, dim=1))
            else:
                mixed = stacked
            xl = mixed + xl
        return xl.squeeze(2)
