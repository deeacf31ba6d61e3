"""torch.jit.script of the sparse types (TorchRec's contract): scripted code gives the eager results."""

import warnings

import pytest
import torch

from lightning_rec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    JaggedTensor,
    KeyedJaggedTensor,
    KeyedTensor,
)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.script is deprecated in torch 2.x
        yield


def _kjt_ops(values: torch.Tensor, lengths: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
    kjt = KeyedJaggedTensor(["a", "b"], values, weights=values.float() * 0.5, lengths=lengths)
    perm = kjt.permute([1, 0, 1])
    parts = kjt.split([1, 0, 1])
    cat = KeyedJaggedTensor.concat([parts[2], parts[0]])
    d = kjt.to_dict()
    back = KeyedJaggedTensor.from_jt_dict(d)
    vbe = KeyedJaggedTensor.from_offsets_sync(
        ["x", "y"], values[:6], torch.tensor([0, 1, 3, 4, 6]), stride_per_key_per_rank=[[1], [3]]
    )
    empty = KeyedJaggedTensor.empty_like(kjt)
    tensors = [
        perm.values(),
        perm.lengths(),
        perm.weights(),
        cat.values(),
        cat.lengths(),
        d["b"].offsets(),
        back.weights(),
        kjt["a"].values(),
        kjt.to(torch.device("cpu")).offsets(),
        empty.lengths(),
        parts[1].values(),
        vbe["y"].values(),
    ]
    ints = [kjt.stride(), vbe.stride(), len(perm.keys()), empty.values().numel()]
    ints += vbe.length_per_key() + vbe.stride_per_key() + kjt.offset_per_key()
    return tensors, ints


def test_kjt_script_matches_eager():
    scripted = torch.jit.script(_kjt_ops)
    for values, lengths in [
        (torch.arange(6), torch.tensor([1, 2, 0, 3])),
        (torch.arange(9, dtype=torch.int32), torch.tensor([3, 0, 1, 2, 2, 1], dtype=torch.int32)),
    ]:
        got, want = scripted(values, lengths), _kjt_ops(values, lengths)
        assert got[1] == want[1]
        assert len(got[0]) == len(want[0])
        for g, w in zip(got[0], want[0]):
            assert g.dtype == w.dtype and torch.equal(g, w)


def test_kjt_script_errors_and_empty():
    def lookup(kjt: KeyedJaggedTensor) -> torch.Tensor:
        return kjt["missing"].values()

    kjt = KeyedJaggedTensor(["a"], torch.arange(3), lengths=torch.tensor([1, 2]))
    with pytest.raises(Exception, match="missing"):
        torch.jit.script(lookup)(kjt)
    empty = torch.jit.script(KeyedJaggedTensor.empty)()
    assert empty.keys() == [] and empty.values().numel() == 0 and empty.lengths().dtype == torch.int32


class _JTModule(torch.nn.Module):
    def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
        jt = JaggedTensor(values, weights=values * 2.0, lengths=lengths)
        dense = JaggedTensor.from_dense([values[:2], values[2:3]])
        padded = JaggedTensor.from_dense_lengths(values.view(2, 3), lengths[:2])
        w = jt.to_padded_dense_weights(2, -1.0)
        assert w is not None
        return jt.to_dense() + [
            jt.to_padded_dense(3, 0.0),
            w,
            dense.offsets(),
            padded.values(),
            JaggedTensor.empty_like(jt).lengths(),
        ]


def test_jagged_tensor_script_matches_eager():
    m = _JTModule()
    scripted = torch.jit.script(m)
    values, lengths = torch.arange(6.0), torch.tensor([1, 2, 3])
    got, want = scripted(values, lengths), m(values, lengths)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


class _KTModule(torch.nn.Module):
    def forward(self, kts: list[KeyedTensor]) -> dict[str, torch.Tensor]:
        groups = KeyedTensor.regroup_as_dict(kts, [["c", "a"], ["b"]], ["x", "y"])
        groups["b"] = kts[0]["b"]
        groups["all"] = KeyedTensor.from_tensor_list(["p", "q"], [kts[1].values(), kts[0].values()]).values()
        return groups


def test_keyed_tensor_script_matches_eager():
    m = _KTModule()
    scripted = torch.jit.script(m)
    kts = [
        KeyedTensor(["a", "b"], [1, 2], torch.arange(6.0).view(2, 3)),
        KeyedTensor(["c"], [2], torch.arange(4.0).view(2, 2)),
    ]
    got, want = scripted(kts), m(kts)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k])


def test_collections_script_and_fx_then_script_match_eager():
    # TorchRec's contract: torch.jit.script(ebc) and torch.jit.script(symbolic_trace(ebc)) run
    torch.manual_seed(0)
    kjt = KeyedJaggedTensor.from_offsets_sync(
        keys=["f2", "f1", "f3"],
        values=torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 1, 3, 4, 7]),
        offsets=torch.tensor([0, 2, 4, 6, 8, 10, 12]),
        weights=torch.rand(12),
    )
    for names in (["t.1", "t 2"], ["t1", "t2"]):  # fx cannot name parameters under a dotted table name
        ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=names[0], embedding_dim=3, num_embeddings=10, feature_names=["f1", "f3"]),
                EmbeddingBagConfig(
                    name=names[1], embedding_dim=4, num_embeddings=10, feature_names=["f2"], pooling="mean"
                ),
            ],
            is_weighted=True,
        )
        want = ebc(kjt)
        models = [torch.jit.script(ebc)]
        if "." not in names[0]:
            models.append(torch.jit.script(torch.fx.symbolic_trace(ebc)))
        for m in models:
            got = m(kjt)
            assert got.keys() == want.keys() == ["f1", "f3", "f2"]
            torch.testing.assert_close(got.values(), want.values())
    ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f1", "f2"])],
        need_indices=True,
    )
    kjt = KeyedJaggedTensor.from_offsets_sync(
        keys=["f1", "f2"], values=torch.tensor([0, 1, 2, 3]), offsets=torch.tensor([0, 2, 3, 3, 4])
    )
    want = ec(kjt)
    for m in (torch.jit.script(ec), torch.jit.script(torch.fx.symbolic_trace(ec))):
        got = m(kjt)
        assert list(got) == list(want)
        for k in want:
            assert torch.equal(got[k].values(), want[k].values()) and torch.equal(got[k].weights(), want[k].weights())
            assert torch.equal(got[k].lengths(), want[k].lengths())
