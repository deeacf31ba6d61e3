"""Position-weighted features (TorchRec's ``PositionWeightedModule`` / ``PositionWeightedProcessor``).

Each feature gets a learned weight per position in its bag; the weights become the JaggedTensor / KJT
weights, so a weighted ``EmbeddingBagCollection`` pools position-weighted embeddings.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_rec.sparse import JaggedTensor, KeyedJaggedTensor, checks_enabled


def _positions(lengths: torch.Tensor, offsets: torch.Tensor, n: int) -> torch.Tensor:
    """Position of every id inside its bag."""
    starts = torch.repeat_interleave(offsets[:-1].long(), lengths.long(), output_size=n)
    return torch.arange(n, device=lengths.device) - starts


def _position_weights_of(key: str, jt: JaggedTensor, weight: torch.Tensor) -> torch.Tensor:
    lengths = jt.lengths()
    if checks_enabled() and lengths.numel() and int(lengths.max()) > weight.numel():
        raise ValueError(
            f"feature {key!r} has a bag of {int(lengths.max())} ids, longer than its max length {weight.numel()}"
        )
    return weight[_positions(lengths, jt.offsets(), jt.values().size(0))]


# fx.wrap: one graph node each (the traced input is a Proxy whose keys cannot be iterated)
@torch.fx.wrap
def _weight_jt_dict(
    features: dict[str, JaggedTensor], keys: list[str], weights: list[torch.Tensor]
) -> dict[str, JaggedTensor]:
    table = dict(zip(keys, weights))
    out = {}
    for key, jt in features.items():
        if key in table:
            jt = JaggedTensor(
                jt.values(),
                weights=_position_weights_of(key, jt, table[key]),
                lengths=jt.lengths(),
                offsets=jt.offsets(),
            )
        out[key] = jt
    return out


@torch.fx.wrap
def _weight_kjt(features: KeyedJaggedTensor, keys: list[str], weights: list[torch.Tensor]) -> KeyedJaggedTensor:
    table = dict(zip(keys, weights))
    jts = features.to_dict()
    per_key = [
        _position_weights_of(k, jts[k], table[k])
        if k in table
        else torch.ones(jts[k].values().size(0), device=features.device)
        for k in features.keys()  # noqa: SIM118 (a KJT, not a dict)
    ]
    return KeyedJaggedTensor(
        features.keys(),
        features.values(),
        weights=torch.cat(per_key) if per_key else None,
        lengths=features.lengths(),
        offsets=features.offsets(),
        stride=features.stride(),
        stride_per_key_per_rank=features.stride_per_key_per_rank() if features.variable_stride_per_key() else None,
    )


class _PositionWeights(nn.Module):
    def __init__(self, max_feature_lengths: dict[str, int], device: torch.device | None = None) -> None:
        super().__init__()
        self.max_feature_lengths = dict(max_feature_lengths)
        self.position_weights = nn.ParameterDict(
            {k: nn.Parameter(torch.ones(n, device=device)) for k, n in self.max_feature_lengths.items()}
        )

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for p in self.position_weights.values():
                p.fill_(1.0)

    def _args(self) -> tuple[list[str], list[torch.Tensor]]:
        keys = list(self.max_feature_lengths)
        return keys, [self.position_weights[k] for k in keys]


class PositionWeightedModule(_PositionWeights):
    """``{feature: JaggedTensor}`` -> the same with per-position weights (features without a max length pass)."""

    def forward(self, features: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]:
        return _weight_jt_dict(features, *self._args())


class PositionWeightedProcessor(_PositionWeights):
    """A KeyedJaggedTensor -> the same with per-position weights (1.0 for features without a max length)."""

    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        return _weight_kjt(features, *self._args())
