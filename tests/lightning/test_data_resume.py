"""Mid-epoch resume through Lightning: a run resumed from a checkpoint taken mid-epoch ends with bitwise the same
weights as an uninterrupted run (2 processes, rec_sharded, ClickDataModule's stateful loaders)."""

from __future__ import annotations

import os

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_rec import RecShardedStrategy, ShardingPlan, data_parallel, row_wise, table_wise
from lightning_rec.data import ClickDataModule
from lightning_rec.models import DLRM
from lightning_rec.testing import run_distributed

BATCH, STEPS_PER_EPOCH, EPOCHS = 8, 5, 2


def _write_tsv(path: str, n: int) -> None:
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for _ in range(n):
            ints = [str(v) for v in rng.integers(0, 50, 13)]
            cats = [f"{v:08x}" for v in rng.integers(0, 2**32, 26, dtype=np.uint64)]
            f.write("\t".join([str(int(rng.integers(0, 2))), *ints, *cats]) + "\n")


def _job(rank: int, ws: int, source: str, path: str | None, workers: int, ckpt_dir: str, resume: str | None) -> dict:
    torch.manual_seed(0)
    rows = BATCH * ws * STEPS_PER_EPOCH
    dm = ClickDataModule(
        source=source,
        path=path,
        batch_size=BATCH,
        train_rows=rows,
        val_rows=0,
        test_rows=0,
        size=1e-5,
        num_workers=workers,
        shuffle_block=7,
    )
    tables = list(dm.feature_names)  # DLRM names a table after its feature
    plan = ShardingPlan(
        {
            "sparse_arch.embedding_bag_collection": {
                **{t: data_parallel() for t in tables},
                tables[0]: row_wise(),
                tables[1]: table_wise(rank=1),
            }
        }
    )
    model = DLRM(
        num_dense=dm.num_dense,
        feature_names=dm.feature_names,
        num_embeddings_per_feature=dm.cardinalities,
        embedding_dim=4,
        dense_arch_layer_sizes=[8, 4],
        over_arch_layer_sizes=[8, 1],
        plan=plan,
        dense_lr=0.05,
        embedding_lr=0.1,
    )
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1, filename="{step}")]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=ws,
        strategy=RecShardedStrategy(),
        max_epochs=EPOCHS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=callbacks,
    )
    trainer.fit(model, dm, ckpt_path=resume)
    return {"step": trainer.global_step, **{k: v.detach().clone() for k, v in model.named_parameters()}}


@pytest.mark.slow
@pytest.mark.parametrize("source, workers", [("synthetic", 0), ("criteo_tsv", 2)])
def test_mid_epoch_resume_gives_bitwise_the_same_weights(tmp_path, source: str, workers: int) -> None:
    path = None
    if source == "criteo_tsv":
        path = str(tmp_path / "day_0")
        _write_tsv(path, BATCH * 2 * STEPS_PER_EPOCH)
    full = run_distributed(
        _job,
        2,
        source,
        path,
        workers,
        str(tmp_path / "a"),
        None,
        init_process_group=False,
        timeout_s=240,
        daemon=workers == 0,
    )
    assert full[0]["step"] == EPOCHS * STEPS_PER_EPOCH
    # step 3 is mid-epoch 0; the run goes on from its next batch, through epoch 1 (new shuffle / new rows)
    mid = os.path.join(tmp_path / "a", "step=3.ckpt")
    assert os.path.exists(mid), os.listdir(tmp_path / "a")
    resumed = run_distributed(
        _job,
        2,
        source,
        path,
        workers,
        str(tmp_path / "b"),
        mid,
        init_process_group=False,
        timeout_s=240,
        daemon=workers == 0,
    )
    for rank in range(2):
        assert resumed[rank]["step"] == full[rank]["step"]
        for name, value in full[rank].items():
            if name != "step":
                assert torch.equal(resumed[rank][name], value), (rank, name)
