"""Perceptron, MLP and SwishLayerNorm with TorchRec's arguments and state_dict keys (``_mlp.0._linear.weight``)."""

# No ``from __future__ import annotations``: fx-traced copies of these modules are TorchScript-ed by
# TorchRec users, and TorchScript needs the annotations as real objects.

from collections.abc import Callable, Sequence

import torch
from torch import nn

Activation = str | nn.Module | Callable[[torch.Tensor], torch.Tensor] | Callable[[], nn.Module]


class SwishLayerNorm(nn.Module):
    """``x * sigmoid(LayerNorm(x))`` (TorchRec's ``SwishLayerNorm``)."""

    def __init__(self, input_dims: int | list[int] | torch.Size, device: torch.device | None = None) -> None:
        super().__init__()
        self.norm = nn.Sequential(nn.LayerNorm(input_dims, device=device), nn.Sigmoid())

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input * self.norm(input)


class Perceptron(nn.Module):
    """One linear layer and its activation (TorchRec's ``Perceptron``)."""

    def __init__(
        self,
        in_size: int,
        out_size: int,
        bias: bool = True,
        activation: nn.Module | Callable[[torch.Tensor], torch.Tensor] = torch.relu,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self._in_size = in_size
        self._out_size = out_size
        self._linear = nn.Linear(in_size, out_size, bias=bias, device=device, dtype=dtype)
        self._activation_fn = activation

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._activation_fn(self._linear(input))


def _layer_activation(activation: Activation, out_size: int, device: torch.device | None) -> Callable:
    if isinstance(activation, str):
        if activation == "relu":
            return torch.relu
        if activation == "sigmoid":
            return torch.sigmoid
        if activation == "swish_layernorm":
            return SwishLayerNorm(out_size, device=device)
        raise ValueError(f"unknown activation {activation!r}: use 'relu', 'sigmoid', 'swish_layernorm' or a callable")
    if isinstance(activation, type) and issubclass(activation, nn.Module):
        return activation()  # a module class: one instance per layer
    return activation  # type: ignore[return-value]


class MLP(nn.Module):
    """Perceptrons of sizes ``layer_sizes`` (TorchRec's ``MLP``); every layer has the activation."""

    def __init__(
        self,
        in_size: int,
        layer_sizes: Sequence[int],
        bias: bool = True,
        activation: Activation = torch.relu,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        sizes = [in_size, *layer_sizes]
        self._mlp = nn.Sequential(
            *[
                Perceptron(
                    sizes[i],
                    sizes[i + 1],
                    bias=bias,
                    activation=_layer_activation(activation, sizes[i + 1], device),
                    device=device,
                    dtype=dtype,
                )
                for i in range(len(layer_sizes))
            ]
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._mlp(input)
