"""RecShardedStrategy(pipeline=True): the next training batch's input dist starts while the current one trains,
and the weights are bitwise those of pipeline=False, with validation interleaved, a shorter last batch, several
epochs and an iterable loader (2 CPU processes)."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
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
from lightning_rec.sharding import ShardedCollection
from lightning_rec.testing import run_distributed
from tests.lightning.models import ClickModule, Clicks, collate

PLANS = {
    # row_wise, column_wise and a data-parallel table; plain SGD on the tables
    "mixed": (ShardingPlan({"ebc": {"user": row_wise(), "item": column_wise([0, 1]), "geo": data_parallel()}}), None),
    # table_wise and row_wise tables updated inside backward (fused)
    "fused": (ShardingPlan({"ebc": {"user": table_wise(rank=1), "item": table_wise(rank=0), "geo": row_wise()}}),
              {"kind": "sgd", "lr": 0.2}),
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
        return DataLoader(_RankSlice(self.trainer.global_rank, self.trainer.world_size), batch_size=5,
                          collate_fn=collate)


def _fit(plan_name: str, pipeline: bool, iterable: bool) -> tuple[dict, list[float], int, list[str]]:
    plan, fused = PLANS[plan_name]
    model = _Module(plan, iterable)
    val_losses: list[float] = []

    class _Record(L.Callback):
        def on_validation_epoch_end(self, trainer, pl_module) -> None:
            val_losses.append(float(trainer.callback_metrics["val_loss"]))

    strategy = RecShardedStrategy(embedding_grad="mean", embedding_optimizer=fused, pipeline=pipeline)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, num_sanity_val_steps=1, val_check_interval=3,
                        limit_val_batches=2, callbacks=[_Record()])
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
