"""Quantized comms' codecs and TorchRec-style configuration, on one process (the collectives are tested in
tests/distributed/test_qcomm.py)."""

from __future__ import annotations

import pytest
import torch

from lightning_rec import CommType, QCommsConfig, get_qcomm_codecs_registry
from lightning_rec.pipeline.output_dist import CommOp, WireCodec, pooled_codecs, sequence_codecs


def test_fp16_clamps_as_torchrec_and_keeps_nan() -> None:
    x = torch.tensor([1e6, -1e6, 65519.0, 65521.0, float("inf"), float("nan"), 1.0, 2.0**-26])
    before = x.clone()
    y = WireCodec(torch.float16).encode(x)
    assert y.dtype == torch.float16
    assert torch.equal(x.nan_to_num(0), before.nan_to_num(0))  # the input is left alone
    limit = 65504.0
    assert y[:5].tolist() == [limit, -limit, limit, limit, limit]
    assert y[5].isnan() and y[6] == 1.0 and y[7] == 0.0  # below fp16's smallest subnormal: zero


def test_loss_scale_round_trip_and_identity() -> None:
    x = torch.randn(1000) * 1e-6  # in fp16's subnormal range without a scale
    plain, scaled = WireCodec(torch.float16), WireCodec(torch.float16, 1024.0)
    err_plain = (plain.decode(plain.encode(x), torch.float32) - x).abs()
    err_scaled = (scaled.decode(scaled.encode(x), torch.float32) - x).abs()
    assert err_scaled.max() < err_plain.max() / 10
    assert (err_scaled <= 2.0**-11 * x.abs() + 2.0**-24 / 1024).all()
    same = WireCodec()
    assert same.is_identity and same.encode(x) is x
    already = x.bfloat16()
    assert WireCodec(torch.bfloat16).encode(already) is already  # already in the wire type, no scale: as is


def test_config_validation_and_registry() -> None:
    with pytest.raises(ValueError, match="fp8 / int8 codecs are not supported"):
        QCommsConfig(forward_precision=CommType.INT8)
    with pytest.raises(ValueError, match="expected one of"):
        QCommsConfig(forward_precision="fp12")
    with pytest.raises(ValueError, match="positive finite"):
        QCommsConfig(backward_loss_scale=0.0)
    with pytest.raises(ValueError, match="fp8"):
        QCommsConfig(fp8_quantize_dim=128)
    assert get_qcomm_codecs_registry(None) is None
    assert pooled_codecs(get_qcomm_codecs_registry(QCommsConfig())) is None  # fp32 both ways: unchanged
    config = QCommsConfig(forward_precision="FP16", backward_precision=CommType.BF16, backward_loss_scale=8)
    registry = get_qcomm_codecs_registry(config)
    assert set(registry) == {CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.value, CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.value}
    codecs = pooled_codecs(registry)
    assert str(codecs) == "forward float16, backward bfloat16 x8"
    assert sequence_codecs(registry) is None
    seq = get_qcomm_codecs_registry(config, comm_ops=[CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL])
    assert sequence_codecs(seq) == codecs and pooled_codecs(seq) is None
