"""``RecShardedStrategy(qcomms_config=...)``: a Lightning fit whose pooled rows and gradients travel as fp16 /
bf16 installs the codecs in every sharded collection and trains to within the wire precision of one process
(the element-wise bounds are in tests/distributed/test_qcomm.py)."""

from __future__ import annotations

import pytest

from lightning_rec import CommType, QCommsConfig, RecShardedFabricStrategy, RecShardedStrategy, full_state_dict
from lightning_rec.testing import run_distributed
from tests.lightning.models import ClickModule
from tests.lightning.test_strategy import PLAN, _reference, _trainer

CONFIG = QCommsConfig(forward_precision=CommType.FP16, backward_precision=CommType.BF16)


def _fit_job(rank: int, ws: int) -> dict:
    model = ClickModule(batch_size=4, plan=PLAN)
    strategy = RecShardedStrategy(embedding_grad="mean", qcomms_config=CONFIG)
    _trainer(devices=ws, strategy=strategy, use_distributed_sampler=False).fit(model)
    state = full_state_dict(model)  # collective
    return {"state": state if rank == 0 else None, "codecs": str(model.ebc.qcomm_codecs)}


def test_fit_with_quantized_comms_stays_within_wire_precision() -> None:
    results = run_distributed(_fit_job, 2, init_process_group=False, timeout_s=240)
    assert {r["codecs"] for r in results} == {"forward float16, backward bfloat16"}
    want, got = _reference(2), results[0]["state"]
    diffs = {k: float((got[k] - want[k]).abs().max()) for k in want}
    # a few SGD steps from rows and gradients rounded to fp16 / bf16: close to one process, not equal to it
    assert max(diffs.values()) < 5e-3, diffs
    assert max(diffs["ebc.embedding_bags.user.weight"], diffs["ebc.embedding_bags.item.weight"]) > 0


@pytest.mark.parametrize("strategy", [RecShardedStrategy, RecShardedFabricStrategy])
def test_qcomms_config_must_be_a_qcomms_config(strategy) -> None:
    with pytest.raises(TypeError, match="qcomms_config must be a QCommsConfig"):
        strategy(qcomms_config="fp16")
    with pytest.raises(ValueError, match="fp8"):
        QCommsConfig(backward_precision="fp8")
