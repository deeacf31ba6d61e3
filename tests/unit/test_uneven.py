"""Which evaluation steps a rank with fewer batches joins, and when it cannot (no processes)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from lightning_rec.lightning.uneven import UnevenEvaluation, lookup_roots, unreplayable


def test_ranks_without_a_batch_before_others_cannot_join() -> None:
    assert unreplayable([[3, 2], [2, 2]]) == []
    assert unreplayable([[0, 2], [1, 2]]) == [(0, 0)]
    assert unreplayable([[2, 0, 1], [2, 1, 1]]) == []  # joins dataloader 1 after its last batch of dataloader 0
    assert unreplayable([[0, 0], [0, 0]]) == []


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        cfg = [EmbeddingBagConfig(name="t", num_embeddings=4, embedding_dim=2, feature_names=["f"])]
        self.a, self.b = EmbeddingBagCollection(cfg), EmbeddingBagCollection(cfg)

    def forward(self, kjt):
        return self.b(kjt).values() + self.a(kjt).values()


def test_short_rank_replays_its_lookups_empty_after_its_last_batch_of_each_dataloader() -> None:
    model = _Model()
    calls: list[tuple[str, int]] = []
    for name in ("a", "b"):
        getattr(model, name).register_forward_pre_hook(lambda m, args, n=name: calls.append((n, args[0].stride())))
    # what lookup_roots finds on a sharded model; unsharded collections stand in for them here
    join = UnevenEvaluation.__new__(UnevenEvaluation)
    join.counts, join.most, join._steps, join._calls, join._recording = [2, 0, 1], [3, 2, 1], 0, [], None
    join._handles = [m.register_forward_pre_hook(join._record, with_kwargs=True) for m in (model.a, model.b)]
    kjt = KeyedJaggedTensor(["f", "unread"], torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1, 0, 0]))
    for step in range(3):
        calls.clear()
        join.step(model, kjt)
        # a step's own lookups (batch 2), then after the last batch of dataloader 0: one short step there and
        # two of dataloader 1, where this rank has none, each replaying b then a with empty batches
        want = [("b", 2), ("a", 2)] + ([("b", 0), ("a", 0)] * 3 if step == 1 else [])
        assert calls == want, (step, calls)
    join.close()
    assert not lookup_roots(model)  # plain collections make no collectives
