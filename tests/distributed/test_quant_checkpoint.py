"""A checkpoint directory written by 2 sharded processes (Trainer, rec_sharded), quantized in one process: equal
to quantizing the trained model's full state."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_rec import (
    RecShardedStrategy,
    ShardingPlan,
    column_wise,
    data_parallel,
    full_state_dict,
    load_quantized,
    quantize_embeddings,
    row_wise,
)
from lightning_rec.cli import main
from lightning_rec.testing import run_distributed
from tests.lightning.models import QUIET_TRAINER, ClickModule, Clicks, collate

# every table split another way: row blocks, column blocks, a replica on each rank
PLAN = ShardingPlan({"ebc": {"user": row_wise(), "item": column_wise(ranks=[1, 0]), "geo": data_parallel()}})


def _train_and_save(rank: int, ws: int, ckpt: str, full: str) -> None:
    model = ClickModule(plan=PLAN)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=ws,
        strategy=RecShardedStrategy(),
        max_epochs=1,
        limit_train_batches=3,
        use_distributed_sampler=False,
        **QUIET_TRAINER,
    )
    trainer.fit(model)
    with pytest.raises(ValueError, match=r"needs unsharded collections; \['ebc'\] are sharded"):
        quantize_embeddings(model)
    trainer.save_checkpoint(ckpt)
    state = full_state_dict(model)  # collective
    if rank == 0:
        torch.save(state, full)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_two_process_checkpoint_quantized_in_one_process(tmp_path: Path) -> None:
    ckpt, full = str(tmp_path / "last.ckpt"), str(tmp_path / "full.pt")
    run_distributed(_train_and_save, 2, ckpt, full, init_process_group=False, timeout_s=240)
    trained = ClickModule()
    state = torch.load(full, weights_only=True)
    assert not torch.equal(state["ebc.embedding_bags.user.weight"], trained.ebc.embedding_bags["user"].weight)
    trained.load_state_dict(state)
    batch = collate([Clicks(8)[i] for i in range(8)])[0]
    for dtype in (torch.qint8, torch.quint4x2, torch.quint2x4, torch.float16):
        want = quantize_embeddings(trained, dtype, inplace=False).eval()
        for model in (ClickModule(), ClickModule):
            got = load_quantized(ckpt, model, dtype)
            for k, v in want.state_dict().items():
                assert torch.equal(got.state_dict()[k], v) if torch.is_tensor(v) else got.state_dict()[k] == v, k
            assert torch.equal(got(batch), want(batch)), dtype
    out = tmp_path / "served.pt"
    args = ["export", ckpt, "--model", "tests.lightning.models:ClickModule", "--quantize", "int8", "-o", str(out)]
    assert main(args) == 0
    served = quantize_embeddings(ClickModule(), torch.qint8)
    served.load_state_dict(torch.load(out, weights_only=True))
    assert torch.equal(served(batch), quantize_embeddings(trained, torch.qint8, inplace=False)(batch))
