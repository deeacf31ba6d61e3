"""TorchRec's dense building blocks (``torchrec.modules``): MLP, Perceptron, cross networks, DeepFM, FM,
SwishLayerNorm and position-weighted feature processors, with TorchRec's argument names and state_dict keys."""

from lightning_rec.nn.crossnet import CrossNet, LowRankCrossNet, LowRankMixtureCrossNet, VectorCrossNet
from lightning_rec.nn.deepfm import DeepFM, FactorizationMachine
from lightning_rec.nn.feature_processor import PositionWeightedModule, PositionWeightedProcessor
from lightning_rec.nn.mlp import MLP, Perceptron, SwishLayerNorm

__all__ = [
    "MLP",
    "CrossNet",
    "DeepFM",
    "FactorizationMachine",
    "LowRankCrossNet",
    "LowRankMixtureCrossNet",
    "Perceptron",
    "PositionWeightedModule",
    "PositionWeightedProcessor",
    "SwishLayerNorm",
    "VectorCrossNet",
]
