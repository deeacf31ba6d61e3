"""torch.export of the unsharded model: from a checkpoint directory, the inference copy, fx, errors.

The round trip through a fresh torch-only process is in tests/lightning/test_export_program.py (seconds more)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.fx

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, checkpoint
from lightning_rec.export import export_program, fx_trace, inference_model
from lightning_rec.models import DLRM
from lightning_rec.models.dlrm import DLRM as TorchRecDLRM

CARDS = {"user id": 23, "item": 31, "geo.city": 7}  # any string is a feature name
DENSE = 3


def _batch(
    keys: list[str], rows: list[int], b: int, max_len: int, seed: int, dense: int | None = DENSE, weighted: bool = False
) -> tuple:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (len(keys) * b,), generator=g)
    values = torch.cat(
        [torch.randint(0, n, (int(k),), generator=g) for n, k in zip(rows, lengths.view(len(keys), b).sum(1))]
    )
    out = ([] if dense is None else [torch.randn(b, dense, generator=g)]) + [values, lengths]
    return tuple(out + ([torch.rand(values.numel(), generator=g)] if weighted else []))


def _dlrm() -> DLRM:
    torch.manual_seed(0)
    return DLRM(
        num_dense=DENSE,
        feature_names=list(CARDS),
        num_embeddings_per_feature=list(CARDS.values()),
        embedding_dim=4,
        dense_arch_layer_sizes=[8, 4],
        over_arch_layer_sizes=[8, 1],
    )


# batch sizes 1 (no special case), 2, 17; bags of 0 (all empty), up to 1, up to 6 ids
SHAPES = [(1, 2), (2, 0), (17, 6), (5, 1)]


def test_export_from_a_checkpoint_directory_matches_the_trained_model(tmp_path: Path) -> None:
    trained = _dlrm()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p))  # "training": every weight differs from a fresh model's
    checkpoint.save(tmp_path / "ckpt", trained)
    fresh = _dlrm()
    before = [p.clone() for p in fresh.parameters()]
    path = export_program(fresh, tmp_path / "m.pt2", checkpoint_dir=tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters())), "the given model must not change"
    program = torch.export.load(path).module()
    trained.eval()
    for seed, (b, n) in enumerate(SHAPES):
        dense, values, lengths = _batch(list(CARDS), list(CARDS.values()), b, n, seed)
        with torch.no_grad():
            ref = trained(dense, KeyedJaggedTensor(list(CARDS), values, lengths=lengths))
        torch.testing.assert_close(program(dense, values, lengths), ref)


def test_inference_model_is_an_independent_torch_kernel_copy() -> None:
    model = _dlrm()
    copy = inference_model(model)
    assert copy is not model and not copy.training
    ebc = copy.sparse_arch.embedding_bag_collection
    assert ebc.kernel == "torch" and not ebc.sparse_grad
    for a, b in zip(model.parameters(), copy.parameters()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()


def test_bad_requests_raise_and_leave_no_file(tmp_path: Path) -> None:
    model = _dlrm()
    with pytest.raises(ValueError, match="not features of the model"):
        export_program(model, tmp_path / "a.pt2", keys=["user id", "nope"])
    with pytest.raises(ValueError, match="num_dense"):
        export_program(model.sparse_arch, tmp_path / "b.pt2")
    assert list(tmp_path.iterdir()) == []


def test_fx_trace_of_the_tensor_signature_matches_eager() -> None:
    # TorchRec's DLRM (the Lightning DLRM's parts), with a dotted table name, behind the plain-tensor signature
    ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(name="t.a", num_embeddings=10, embedding_dim=4, feature_names=["a"]),
            EmbeddingBagConfig(name="tb", num_embeddings=20, embedding_dim=4, feature_names=["b"], pooling="mean"),
        ]
    )
    model = TorchRecDLRM(ebc, DENSE, [8, 4], [8, 1])
    gm = fx_trace(model, num_dense=DENSE)
    assert isinstance(gm, torch.fx.GraphModule) and "embedding_bag" in gm.code
    for seed, (b, n) in enumerate([(1, 2), (2, 0), (17, 6)]):
        x = _batch(["a", "b"], [10, 20], b, n, seed)
        ref = model(x[0], KeyedJaggedTensor(["a", "b"], x[1], lengths=x[2])).squeeze(1)
        torch.testing.assert_close(gm(*x).squeeze(1), ref)


class _TwoCollections(torch.nn.Module):
    """Two collections reading different features in other orders: each permutes the KJT inside the program."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(
                    name="t.a", num_embeddings=10, embedding_dim=4, feature_names=["z", "x"], pooling="mean"
                )
            ]
        )
        self.b = EmbeddingBagCollection(
            [EmbeddingBagConfig(name="tb", num_embeddings=7, embedding_dim=3, feature_names=["y"])]
        )

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return torch.cat([self.a(kjt).values(), self.b(kjt).values()], dim=1)


@pytest.mark.parametrize("which", ["two collections", "dlrm, keys reversed"])
def test_collections_reading_other_keys_export_and_match_eager(tmp_path: Path, which: str) -> None:
    if which == "two collections":
        model, keys, rows, dense = _TwoCollections(), ["x", "y", "z"], [7, 7, 7], None
    else:
        model, keys, rows, dense = _dlrm(), list(reversed(CARDS)), list(reversed(CARDS.values())), DENSE
    path = export_program(model, tmp_path / "m.pt2", keys=keys, num_dense=dense)
    program = torch.export.load(path).module()
    model.eval()
    for seed, (b, n) in enumerate(SHAPES):
        x = _batch(keys, rows, b, n, seed, dense=dense)
        kjt = KeyedJaggedTensor(keys, x[-2], lengths=x[-1])
        with torch.no_grad():
            ref = model(kjt) if dense is None else model(x[0], kjt)
        torch.testing.assert_close(program(*x), ref)


def test_fx_symbolic_trace_of_the_lightning_dlrm() -> None:
    torch.manual_seed(0)
    cards = {"user id": 23, "item": 31}
    model = DLRM(
        num_dense=DENSE,
        feature_names=list(cards),
        num_embeddings_per_feature=list(cards.values()),
        embedding_dim=4,
        dense_arch_layer_sizes=[8, 4],
        over_arch_layer_sizes=[8, 1],
    )
    gm = torch.fx.symbolic_trace(model)
    for seed, (b, n) in enumerate([(1, 2), (5, 0), (9, 4)]):
        x = _batch(list(cards), list(cards.values()), b, n, seed)
        kjt = KeyedJaggedTensor(list(cards), x[1], lengths=x[2])
        torch.testing.assert_close(gm(x[0], kjt), model(x[0], kjt))
    with pytest.raises(ValueError, match=r"dense features must be \[batch, 3\]"):
        model(torch.zeros(2, 4), kjt)  # eager still checks its input
    # a dotted table name has no fx module path: a clear error names it and the way out (fx_trace renames)
    with pytest.raises(ValueError, match=r"'geo.city'.*fx_trace"):
        torch.fx.symbolic_trace(_dlrm())


def test_inference_copy_of_a_compiled_model_is_not_compiled() -> None:
    # RecShardedStrategy(compile=...) compiles the module in place (nn.Module.compile): the copy that
    # export_program traces must not carry the compiled call along
    model = _dlrm()
    model.compile(backend="eager")
    copy = inference_model(model)
    assert copy._compiled_call_impl is None and model._compiled_call_impl is not None
    x = _batch(list(CARDS), list(CARDS.values()), 3, 2, 0)
    kjt = KeyedJaggedTensor(list(CARDS), x[1], lengths=x[2])
    model.eval()
    torch.testing.assert_close(copy(x[0], kjt), model(x[0], kjt))
