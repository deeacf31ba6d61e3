"""Ranks agree on every batch (real gloo processes): a bad line or a rank out of batches stops every rank at the
same step with one clear error, never a hang; under Trainer(strategy="rec_sharded") too."""

from __future__ import annotations

import lightning as L
import pytest
from torch.utils.data import DataLoader, IterableDataset

from lightning_rec import RecShardedStrategy
from lightning_rec.data import AgreedLoader, ClickLoader, CriteoTSV
from lightning_rec.testing import run_distributed
from tests.lightning.models import ClickModule, Clicks, collate
from tests.unit.test_data_readers import CARDS, write_lines


def _tsv_job(rank: int, ws: int, path: str) -> dict:
    loader = ClickLoader(CriteoTSV(path, 2, cardinalities=CARDS, rank=rank, world_size=ws))
    seen = 0
    try:
        for _ in loader:
            seen += 1
    except ValueError as e:
        return {"seen": seen, "error": str(e)}
    return {"seen": seen, "error": None}


def test_a_bad_line_stops_every_rank_at_the_same_step_naming_file_line_and_column(tmp_path) -> None:
    write_lines(tmp_path / "day_0", 20, seed=1)
    lines = (tmp_path / "day_0").read_text().split("\n")
    lines[9] = lines[9].replace("\t", "\t1.5", 1)  # row 9: rank 0's third batch (rows 8-9), line 10, column 2
    (tmp_path / "day_0").write_text("\n".join(lines))
    r0, r1 = run_distributed(_tsv_job, 2, str(tmp_path / "day_0"), timeout_s=60)
    assert r0["seen"] == r1["seen"] == 2  # neither rank went on to batch 3
    assert "day_0:10: column 2 (integer feature 0)" in r0["error"]
    assert "rank 0 failed reading its batch 2" in r1["error"] and "day_0:10: column 2" in r1["error"]


class _Stream(IterableDataset):
    """An iterable without a length, with a different number of batches on each rank."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def _agreed_job(rank: int, ws: int, counts: list[int]) -> dict:
    loader = AgreedLoader(DataLoader(_Stream(counts[rank]), batch_size=None), what="test loader")
    got = []
    try:
        for x in loader:
            got.append(int(x))
    except RuntimeError as e:
        return {"got": got, "error": str(e)}
    return {"got": got, "error": None}


def test_ranks_running_out_at_different_steps_raise_on_every_rank() -> None:
    results = run_distributed(_agreed_job, 3, [4, 4, 4], timeout_s=60)
    assert all(r == {"got": [0, 1, 2, 3], "error": None} for r in results)
    results = run_distributed(_agreed_job, 3, [4, 2, 4], timeout_s=60)
    for r in results:
        assert r["got"] == [0, 1]
        assert "ranks [1] ran out of batches after 2 batches while ranks [0, 2] have more" in r["error"]


class _UnevenModule(ClickModule):
    def train_dataloader(self):
        rank = self.trainer.global_rank

        class Uneven(IterableDataset):  # rank 1 has 3 batches, rank 0 has 5: no length, so no check up front
            def __iter__(self):
                ds = Clicks(20)
                yield from (collate([ds[i] for i in range(b * 4, b * 4 + 4)]) for b in range(5 - 2 * rank))

        return DataLoader(Uneven(), batch_size=None)


def _fit_job(rank: int, ws: int) -> dict:
    model = _UnevenModule()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=ws,
        strategy=RecShardedStrategy(),
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
    )
    try:
        trainer.fit(model)
    except RuntimeError as e:
        return {"step": trainer.global_step, "error": str(e)}
    return {"step": trainer.global_step, "error": None}


@pytest.mark.slow
def test_trainer_with_uneven_iterable_data_raises_on_every_rank_instead_of_hanging() -> None:
    r0, r1 = run_distributed(_fit_job, 2, init_process_group=False, timeout_s=120)
    for r in (r0, r1):
        assert r["error"] is not None and "ranks [1] ran out of batches" in r["error"], r
    # Lightning fetches one batch ahead for loaders without a length: the shortage shows when fetching the
    # batch after rank 1's third, which stops both ranks before that step runs
    assert r0["step"] == r1["step"] == 2
