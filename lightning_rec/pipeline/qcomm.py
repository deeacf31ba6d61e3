"""Quantized communication of pooled embeddings, with TorchRec's API (``QCommsConfig``, ``CommType``,
``get_qcomm_codecs_registry``): the pooled output dist sends its rows (forward) and their gradients
(backward) as fp16 or bf16 instead of the tables' dtype, halving the exchange's bytes.

A codec (:class:`WireCodec`) multiplies by its loss scale (if any), clamps to the wire type's range (fp16:
+-65504, as TorchRec does; bf16 has fp32's range) and rounds to the nearest wire value; the receiver widens
back and divides by the scale. Everything else stays exact: the sums of row blocks and MEAN run in the output
dtype after widening, data-parallel columns never travel, and ids are untouched.

Error bound (round to nearest, ``u`` = 2**-11 for fp16, 2**-8 for bf16): every output element is the sum of
its blocks' partial sums ``p_k`` (one block per shard that holds a piece of the feature's row or column),
so ``|out - out_fp32| <= u * sum_k |p_k| + n_k * tiny`` where ``tiny`` is the wire type's spacing at zero
(fp16: 2**-24 / scale, from values that fall below its normal range; bf16 keeps fp32's), plus whatever
clamping cut off (values beyond +-65504 / scale in fp16). The same holds in backward for each pooled
gradient a shard receives, with the backward precision and scale; a table row's gradient sums those over
bags, so its error is at most ``u`` times the sum of the absolute received gradients. The tests check these
bounds element by element at 2 and 4 processes (``tests/distributed/test_qcomm.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum, unique

import torch


@unique
class CommType(Enum):
    """TorchRec's wire precisions. FP8 and INT8 are TorchRec's row-wise quantized codecs and are refused."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"
    INT8 = "int8"

    def __str__(self) -> str:
        return self.value


@unique
class CommOp(Enum):
    """The collectives a codec may apply to, by TorchRec's names."""

    POOLED_EMBEDDINGS_ALL_TO_ALL = "pooled_embeddings_all_to_all"
    POOLED_EMBEDDINGS_REDUCE_SCATTER = "pooled_embeddings_reduce_scatter"
    SEQUENCE_EMBEDDINGS_ALL_TO_ALL = "sequence_embeddings_all_to_all"


_WIRE = {CommType.FP32: None, CommType.FP16: torch.float16, CommType.BF16: torch.bfloat16}


def _comm_type(value: CommType | str, what: str) -> CommType:
    try:
        kind = value if isinstance(value, CommType) else CommType(str(value).lower())
    except ValueError:
        raise ValueError(f"{what}={value!r}: expected one of {[str(c) for c in CommType]}") from None
    if kind not in _WIRE:
        raise ValueError(
            f"{what}={kind}: lightning_rec's quantized comms send fp16 or bf16 (or fp32, i.e. unchanged); "
            "TorchRec's row-wise fp8 / int8 codecs are not supported"
        )
    return kind


def _scale(value: float | None, what: str) -> float | None:
    if value is None:
        return None
    scale = float(value)
    if not (scale > 0 and scale != float("inf")):
        raise ValueError(f"{what}={value!r}: a loss scale must be a positive finite number (or None)")
    return scale


@dataclass
class QCommsConfig:
    """Which precision the pooled embeddings travel in, forward and backward (TorchRec's fields).

    ``forward_loss_scale`` / ``backward_loss_scale`` multiply the values before they are rounded to the wire
    type and divide them after (keeping small gradients out of fp16's subnormal range). TorchRec's fp8 fields
    are accepted only as None.
    """

    forward_precision: CommType = CommType.FP32
    backward_precision: CommType = CommType.FP32
    forward_loss_scale: float | None = None
    backward_loss_scale: float | None = None
    fp8_quantize_dim: int | None = None
    fp8_quantize_dim_bwd: int | None = None
    fp8_bwd_uses_143: bool | None = False

    def __post_init__(self) -> None:
        self.forward_precision = _comm_type(self.forward_precision, "forward_precision")
        self.backward_precision = _comm_type(self.backward_precision, "backward_precision")
        self.forward_loss_scale = _scale(self.forward_loss_scale, "forward_loss_scale")
        self.backward_loss_scale = _scale(self.backward_loss_scale, "backward_loss_scale")
        if self.fp8_quantize_dim is not None or self.fp8_quantize_dim_bwd is not None or self.fp8_bwd_uses_143:
            raise ValueError("the fp8 options of QCommsConfig need an fp8 precision, which is not supported")


@dataclass(frozen=True)
class WireCodec:
    """How one direction of the pooled output dist travels: ``dtype`` (None: the values' own) and a loss scale."""

    dtype: torch.dtype | None = None
    scale: float | None = None

    @property
    def is_identity(self) -> bool:
        return self.dtype is None and self.scale is None

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as it goes on the wire (a new tensor unless the codec changes nothing)."""
        if self.is_identity or (self.dtype == x.dtype and self.scale is None):
            return x
        y = (x * self.scale if self.scale is not None else x).to(self.dtype or x.dtype)
        if y.dtype == torch.float16:
            # beyond +-65504 rounds to +-inf: clamping after the cast gives clamping before it, on half the bytes
            limit = torch.finfo(torch.float16).max
            y.clamp_(-limit, limit)
        return y

    def decode(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """What arrived, widened to ``dtype`` and unscaled."""
        x = y.to(dtype)
        return x / self.scale if self.scale is not None else x

    def __str__(self) -> str:
        kind = "as is" if self.dtype is None else str(self.dtype).removeprefix("torch.")
        return kind if self.scale is None else f"{kind} x{self.scale:g}"


@dataclass(frozen=True)
class QuantizedCommCodecs:
    """The codecs of one collective: forward values and backward gradients (TorchRec's name)."""

    forward: WireCodec = WireCodec()
    backward: WireCodec = WireCodec()

    @property
    def is_identity(self) -> bool:
        return self.forward.is_identity and self.backward.is_identity

    def __str__(self) -> str:
        return f"forward {self.forward}, backward {self.backward}"


def get_qcomm_codecs_registry(
    qcomms_config: QCommsConfig | None,
    comm_ops: Sequence[CommOp] | None = None,
    device: torch.device | None = None,
) -> dict[str, QuantizedCommCodecs] | None:
    """TorchRec's registry of codecs by collective, for a sharder's ``qcomm_codecs_registry`` argument.

    ``comm_ops`` defaults to the two pooled collectives (all-to-all and reduce-scatter), which lightning_rec
    runs as one exchange. ``device`` is accepted for TorchRec's signature; the codecs work on any device.
    """
    if qcomms_config is None:
        return None
    ops = (
        list(comm_ops)
        if comm_ops is not None
        else [
            CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL,
            CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER,
        ]
    )
    codecs = QuantizedCommCodecs(
        WireCodec(_WIRE[qcomms_config.forward_precision], qcomms_config.forward_loss_scale),
        WireCodec(_WIRE[qcomms_config.backward_precision], qcomms_config.backward_loss_scale),
    )
    return {CommOp(op).value: codecs for op in ops}


def pooled_codecs(registry: Mapping[str, QuantizedCommCodecs] | None) -> QuantizedCommCodecs | None:
    """The codecs of the pooled output dist, or None (fp32 / unchanged). Row blocks that add up (TorchRec's
    reduce-scatter) and whole blocks (its all-to-all) travel in one exchange here, so the two must agree."""
    if not registry:
        return None
    unknown = sorted(set(registry) - {op.value for op in CommOp})
    if unknown:
        raise ValueError(f"qcomm_codecs_registry: unknown collectives {unknown}; known: {[op.value for op in CommOp]}")
    wrong = [k for k, v in registry.items() if not isinstance(v, QuantizedCommCodecs)]
    if wrong:
        raise TypeError(
            f"qcomm_codecs_registry: {wrong} must map to QuantizedCommCodecs; build the registry with "
            "get_qcomm_codecs_registry(QCommsConfig(...))"
        )
    found = {
        op: registry[op.value]
        for op in (CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL, CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER)
        if op.value in registry
    }
    if len(set(found.values())) > 1:
        raise ValueError(
            "qcomm_codecs_registry: lightning_rec's pooled output dist is one exchange for whole blocks and for "
            f"row blocks that add up, so {CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.value} and "
            f"{CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.value} need the same codecs; got "
            + ", ".join(f"{op.value}: {c}" for op, c in found.items())
        )
    codecs = next(iter(found.values()), None)
    return None if codecs is None or codecs.is_identity else codecs


def sequence_codecs(registry: Mapping[str, QuantizedCommCodecs] | None) -> QuantizedCommCodecs | None:
    """The sequence output dist's codecs (None where unchanged); not supported otherwise."""
    codecs = (registry or {}).get(CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL.value)
    return None if codecs is None or codecs.is_identity else codecs
