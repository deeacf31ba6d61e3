"""TorchRec's way of choosing embedding optimizers per table, under the Trainer strategy (issue 44 items 1 and 2).

Two ``apply_optimizer_in_backward`` calls (row-wise Adagrad on the big tables, SGD on the small one), a fused
sequence collection (Adagrad) and an unfused collection beside them that ``configure_optimizers`` trains: sharded on 2 processes this equals one plain process
where the marks step the tables inside backward; saved at 2 processes, it resumes at 1 and at 4 processes and ends
where a straight run ends.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_rec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    RecShardedStrategy,
    full_state_dict,
)
from lightning_rec.distributed import RowWiseAdagrad, apply_optimizer_in_backward, in_backward_optimizer_filter
from lightning_rec.testing import run_distributed
from tests.lightning.models import KEYS, QUIET_TRAINER, ClickModule


class Marked(ClickModule):
    """ClickModule whose tables carry TorchRec's in-backward marks, plus an unmarked collection of its own."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__(batch_size=batch_size)
        torch.manual_seed(1)
        self.side = EmbeddingBagCollection(
            [EmbeddingBagConfig(name="side", num_embeddings=13, embedding_dim=4, feature_names=["history"])]
        )
        # a sequence collection trained fused too (its rows summed per sample below)
        self.seq = EmbeddingCollection(
            [EmbeddingConfig(name="hist", num_embeddings=13, embedding_dim=4, feature_names=["history"])]
        )
        self.head = torch.nn.Linear(4 * len(KEYS) + 8, 1)
        big = [self.ebc.embedding_bags["user"].weight, self.ebc.embedding_bags["item"].weight]
        apply_optimizer_in_backward(RowWiseAdagrad, big, {"lr": 0.1})
        apply_optimizer_in_backward(torch.optim.SGD, [self.ebc.embedding_bags["geo"].weight], {"lr": 0.3})
        apply_optimizer_in_backward(torch.optim.Adagrad, self.seq.parameters(), {"lr": 0.2})

    def forward(self, kjt):
        hist = self.seq(kjt)["history"]
        b = hist.lengths().numel()
        sample = torch.repeat_interleave(torch.arange(b), hist.lengths())
        per_sample = torch.zeros(b, 4).index_add(0, sample, hist.values())
        dense = [self.ebc(kjt).values(), self.side(kjt).values(), per_sample]
        return self.head(torch.cat(dense, dim=1)).squeeze(1)

    def configure_optimizers(self):
        # TorchRec's idiom: the dense part and unmarked tables, not the marked ones
        rest = [p for _, p in in_backward_optimizer_filter(self.named_parameters())]
        return torch.optim.SGD(rest, lr=0.2)


def _trainer(ws: int, epochs: int, strategy) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=ws,
        strategy=strategy,
        max_epochs=epochs,
        limit_train_batches=4,
        limit_val_batches=0,
        use_distributed_sampler=False,
        **QUIET_TRAINER,
    )


def _fit_job(rank: int, ws: int, epochs: int, resume: str | None, save: str | None) -> dict:
    model = Marked(batch_size=8 // ws)
    trainer = _trainer(ws, epochs, RecShardedStrategy(embedding_grad="mean"))
    trainer.fit(model, ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    fused = model.fused_optimizer()
    kinds = sorted(g["kind"] for g in fused.param_groups) if fused is not None else []
    return {
        "state": full_state_dict(model),
        "kinds": kinds,
        "fused": [model.ebc.is_fused, model.seq.is_fused],  # per rank: a rank may hold none of a collection
        "side": model.side.is_fused,
    }


def _reference(epochs: int) -> dict[str, torch.Tensor]:
    """One plain process, global batch 8: the marks step the tables inside backward, SGD the rest."""
    ref = Marked(batch_size=8)
    _trainer(1, epochs, "auto").fit(ref)
    return ref.state_dict()


def test_two_in_backward_marks_and_an_unfused_collection_match_one_process() -> None:
    results = run_distributed(_fit_job, 2, 2, None, None, init_process_group=False, timeout_s=300)
    want = _reference(2)
    for k in want:
        torch.testing.assert_close(results[0]["state"][k], want[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
    assert all(any(r["fused"][i] for r in results) for i in range(2)), [r["fused"] for r in results]
    for r in results:
        assert not r["side"]
        assert set(r["kinds"]) <= {"rowwise_adagrad", "sgd", "adagrad"} and r["kinds"]


@pytest.mark.slow
def test_saved_at_two_processes_resumes_at_one_and_four(tmp_path) -> None:
    half = str(tmp_path / "half")
    run_distributed(_fit_job, 2, 1, None, half, init_process_group=False, timeout_s=300)
    want = _reference(2)
    for ws in (1, 4):
        got = run_distributed(_fit_job, ws, 2, half, None, init_process_group=False, timeout_s=300)[0]["state"]
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0, msg=lambda m, ws=ws, k=k: f"{ws}: {k}: {m}")
