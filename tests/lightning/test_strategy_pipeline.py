"""RecShardedStrategy(pipeline=True): the next training batch's input dist starts while the current one trains,
and the weights are bitwise those of pipeline=False, with validation interleaved, a shorter last batch, several
epochs and an iterable loader (2 CPU processes)."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, IterableDataset

from lightning_rec import (
    RecShardedStrategy,
    ShardingPlan,
    column_wise,
    data_parallel,
    full_state_dict,
    row_wise,
    table_wise,
)
from lightning_rec.data import ClickDataModule
from lightning_rec.models import DLRM
from lightning_rec.sharding import ShardedCollection
from lightning_rec.testing import run_distributed
from tests.lightning.models import ClickModule, Clicks, collate

PLANS = {
    # row_wise, column_wise and a data-parallel table; plain SGD on the tables
    "mixed": (ShardingPlan({"ebc": {"user": row_wise(), "item": column_wise([0, 1]), "geo": data_parallel()}}), None),
    # table_wise and row_wise tables updated inside backward (fused)
    "fused": (
        ShardingPlan({"ebc": {"user": table_wise(rank=1), "item": table_wise(rank=0), "geo": row_wise()}}),
        {"kind": "sgd", "lr": 0.2},
    ),
}


class _RankSlice(IterableDataset):
    """This rank's samples of ``Clicks`` without a length: the strategy wraps its loader to agree on every batch."""

    def __init__(self, rank: int, ws: int) -> None:
        self.rank, self.ws = rank, ws

    def __iter__(self):
        data = Clicks()
        return (data[i] for i in range(self.rank, len(data), self.ws))


class _Module(ClickModule):
    def __init__(self, plan: ShardingPlan, iterable: bool) -> None:
        super().__init__(batch_size=5, plan=plan)  # 32 samples per rank: 6 batches of 5 and one of 2
        self.iterable = iterable

    def train_dataloader(self):
        if not self.iterable:
            return super().train_dataloader()
        return DataLoader(
            _RankSlice(self.trainer.global_rank, self.trainer.world_size), batch_size=5, collate_fn=collate
        )


def _fit(plan_name: str, pipeline: bool, iterable: bool) -> tuple[dict, list[float], int, list[str]]:
    plan, fused = PLANS[plan_name]
    model = _Module(plan, iterable)
    val_losses: list[float] = []

    class _Record(L.Callback):
        def on_validation_epoch_end(self, trainer, pl_module) -> None:
            val_losses.append(float(trainer.callback_metrics["val_loss"]))

    strategy = RecShardedStrategy(embedding_grad="mean", embedding_optimizer=fused, pipeline=pipeline)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=1,
        val_check_interval=3,
        limit_val_batches=2,
        callbacks=[_Record()],
    )
    started = []
    original = ShardedCollection.prefetch_input_dist

    def counting(self, features):
        started.append(features.stride())
        return original(self, features)

    ShardedCollection.prefetch_input_dist = counting
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model)
    finally:
        ShardedCollection.prefetch_input_dist = original
    misses = [str(w.message) for w in caught if "pipeline=True" in str(w.message)]
    assert trainer.global_step == 14, trainer.global_step  # 7 batches per epoch, the last one of 2 samples
    return full_state_dict(model), val_losses, len(started), misses


def _job(rank: int, ws: int, plan_name: str, iterable: bool) -> None:
    want, want_val, n_plain, _ = _fit(plan_name, False, iterable)
    got, got_val, n_started, misses = _fit(plan_name, True, iterable)
    assert n_plain == 0
    assert n_started == 14, n_started  # every training batch, each one step ahead of its training
    assert not misses, misses
    assert got_val == want_val and len(want_val) >= 4, (got_val, want_val)  # sanity check + interleaved runs
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs on rank {rank}"


@pytest.mark.parametrize(("plan_name", "iterable"), [("mixed", False), ("fused", True)])
def test_pipelined_fit_equals_unpipelined_bitwise(plan_name: str, iterable: bool) -> None:
    run_distributed(_job, 2, plan_name, iterable, init_process_group=False, timeout_s=300)


def _resume_job(rank: int, ws: int, ckpt_dir: str, resume: str | None, pipeline: bool) -> dict:
    torch.manual_seed(0)
    steps = 5
    dm = ClickDataModule(
        source="synthetic", batch_size=8, train_rows=8 * ws * steps, val_rows=0, test_rows=0, size=1e-5, shuffle_block=7
    )
    tables = list(dm.feature_names)
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
        strategy=RecShardedStrategy(pipeline=pipeline),
        max_epochs=2,
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
def test_pipelined_mid_epoch_resume_reads_on_from_the_next_batch(tmp_path) -> None:
    """The loader runs one batch ahead; its checkpointed position must still be the batch after the last trained."""
    plain = run_distributed(_resume_job, 2, str(tmp_path / "p"), None, False, init_process_group=False, timeout_s=240)
    full = run_distributed(_resume_job, 2, str(tmp_path / "a"), None, True, init_process_group=False, timeout_s=240)
    mid = str(tmp_path / "a" / "step=3.ckpt")
    resumed = run_distributed(_resume_job, 2, str(tmp_path / "b"), mid, True, init_process_group=False, timeout_s=240)
    for rank in range(2):
        assert resumed[rank]["step"] == full[rank]["step"] == plain[rank]["step"] == 10
        for name, value in plain[rank].items():
            if name != "step":
                assert torch.equal(full[rank][name], value), (rank, name)
                assert torch.equal(resumed[rank][name], value), (rank, name)
