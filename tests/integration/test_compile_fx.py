"""torch.compile (fullgraph, dynamic shapes) and torch.fx of models holding the unsharded collections."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.fx
from torch._dynamo.testing import CompileCounterWithBackend

from lightning_rec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    JaggedTensor,
    KeyedJaggedTensor,
    KeyedTensor,
)

KEYS = ["c", "a", "b", "unused"]  # not config order, plus a key no table reads


def _bag_configs() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(num_embeddings=20, embedding_dim=4, name="t1", feature_names=["a", "b"]),
        EmbeddingBagConfig(num_embeddings=10, embedding_dim=3, name="t2", feature_names=["c"], pooling="mean"),
    ]


class _Ranker(torch.nn.Module):
    """KJT built from raw tensors, permuted, pooled, regrouped, then an MLP: every step a model takes."""

    def __init__(self, weighted: bool) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(_bag_configs(), is_weighted=weighted, kernel="torch")
        self.ec = EmbeddingCollection(
            [EmbeddingConfig(num_embeddings=10, embedding_dim=4, name="s", feature_names=["c"])]
        )
        self.top = torch.nn.Linear(11 + 4, 1)

    def forward(self, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        kjt = KeyedJaggedTensor(KEYS, values, weights=weights, lengths=lengths)
        kt = self.ebc(kjt)
        ab, c = KeyedTensor.regroup([kt], [["a", "b"], ["c"]])
        seq = self.ec(kjt)["c"]
        # per-sample sum of the sequence embeddings, by segment sum over the bags
        summed = torch.segment_reduce(seq.values(), "sum", lengths=seq.lengths(), unsafe=True)
        return self.top(torch.cat([ab, c, summed], dim=1)).squeeze(1)


def _batch(batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(KEYS) * batch_size,), generator=g)
    values = torch.randint(0, 10, (int(lengths.sum()),), generator=g)
    return values, lengths, torch.rand(values.numel(), generator=g)


@pytest.mark.parametrize("weighted", [False, True])
def test_fullgraph_compile_dynamic_batches_recompiles_at_most_twice(weighted: bool) -> None:
    torch._dynamo.reset()
    model = _Ranker(weighted)
    counter = CompileCounterWithBackend("aot_eager")
    # length_per_key() reads tensor values: captured as symbolic ints instead of a graph break
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = torch.compile(model, fullgraph=True, backend=counter)
        # (a batch of exactly 1 compiles once more: dynamo specialises dimensions of size 0 and 1)
        for step, b in enumerate([3, 5, 8, 2, 7, 4]):
            values, lengths, weights = _batch(b, step)
            out = compiled(values, lengths, weights)
            ref = model(values, lengths, weights)
            assert out.shape == (b,)
            torch.testing.assert_close(out, ref)
            # training: gradients of the compiled graph match eager ones
            grads = torch.autograd.grad(out.sum(), list(model.parameters()), allow_unused=True)
            ref_grads = torch.autograd.grad(ref.sum(), list(model.parameters()), allow_unused=True)
            for g1, g2 in zip(grads, ref_grads):
                if g2 is not None:
                    torch.testing.assert_close(g1, g2)
    # the first batch compiles with static shapes; the second marks batch and bag sizes dynamic; then none
    assert counter.frame_count <= 2, f"{counter.frame_count} compilations for 6 batches"


def test_fx_symbolic_trace_of_collections_matches_eager() -> None:
    ebc = EmbeddingBagCollection(_bag_configs(), is_weighted=True)
    ec = EmbeddingCollection(
        [EmbeddingConfig(num_embeddings=10, embedding_dim=4, name="s", feature_names=["c", "a"])], need_indices=True
    )
    values, lengths, weights = _batch(4, 0)
    kjt = KeyedJaggedTensor(KEYS, values, weights=weights, lengths=lengths)

    gm = torch.fx.symbolic_trace(ebc)
    assert "embedding_bag" in gm.code and "KeyedTensor" in gm.code
    out, ref = gm(kjt), ebc(kjt)
    assert out.keys() == ref.keys() == ["a", "b", "c"]
    torch.testing.assert_close(out.values(), ref.values())

    gm_ec = torch.fx.symbolic_trace(ec)
    out_ec, ref_ec = gm_ec(kjt), ec(kjt)
    assert list(out_ec) == list(ref_ec) == ["c", "a"]
    for k in ref_ec:
        torch.testing.assert_close(out_ec[k].values(), ref_ec[k].values())
        assert torch.equal(out_ec[k].lengths(), ref_ec[k].lengths())
        assert torch.equal(out_ec[k].weights(), ref_ec[k].weights())


def test_fx_trace_builds_sparse_types_from_traced_tensors() -> None:
    class Build(torch.nn.Module):
        def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
            kjt = KeyedJaggedTensor(["x", "y"], values, lengths=lengths)
            jt = JaggedTensor(values, lengths=lengths)
            kt = KeyedTensor(["p", "q"], [1, 1], torch.stack([values[:2], values[2:4]], dim=1).float())
            return [kjt.lengths(), jt.offsets(), KeyedTensor.regroup([kt], [["q", "p"]])[0]]

    gm = torch.fx.symbolic_trace(Build())
    values, lengths = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([2, 0, 1, 2])
    for a, b in zip(gm(values, lengths), Build()(values, lengths)):
        assert torch.equal(a, b)
