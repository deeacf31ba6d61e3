"""lightning_rec.nn building blocks and the TorchRec DLRM family, against plain-torch formulas."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from lightning_rec.models import DLRM as LightningDLRM
from lightning_rec.models.dlrm import DLRM, DLRM_DCN, DLRM_Projection, DLRMTrain
from lightning_rec.nn import (
    MLP,
    CrossNet,
    DeepFM,
    FactorizationMachine,
    LowRankCrossNet,
    LowRankMixtureCrossNet,
    PositionWeightedModule,
    PositionWeightedProcessor,
    SwishLayerNorm,
    VectorCrossNet,
)


def test_mlp_keys_and_maths() -> None:
    mlp = MLP(3, [4, 2])
    assert list(mlp.state_dict()) == [
        "_mlp.0._linear.weight",
        "_mlp.0._linear.bias",
        "_mlp.1._linear.weight",
        "_mlp.1._linear.bias",
    ]
    x = torch.randn(5, 3)
    l0, l1 = mlp._mlp[0]._linear, mlp._mlp[1]._linear
    torch.testing.assert_close(mlp(x), torch.relu(l1(torch.relu(l0(x)))))
    swish = MLP(3, [4], activation="swish_layernorm")
    h = swish._mlp[0]._linear(x)
    torch.testing.assert_close(swish(x), h * torch.sigmoid(nn.functional.layer_norm(h, (4,))))
    assert isinstance(swish._mlp[0]._activation_fn, SwishLayerNorm)
    with pytest.raises(ValueError, match="unknown activation 'tanhh'"):
        MLP(3, [4], activation="tanhh")


def test_cross_networks_match_dcn_v2_formulas() -> None:
    torch.manual_seed(0)
    x0 = torch.randn(6, 5)
    cn = CrossNet(5, 2)
    xl = x0
    for w, b in zip(cn.kernels, cn.bias):
        xl = x0 * (xl @ w.T + b.squeeze(1)) + xl
    torch.testing.assert_close(cn(x0), xl)

    lr = LowRankCrossNet(5, 2, low_rank=3)
    xl = x0
    for w, v, b in zip(lr.W_kernels, lr.V_kernels, lr.bias):
        xl = x0 * ((xl @ v.T) @ w.T + b) + xl
    torch.testing.assert_close(lr(x0), xl)

    vc = VectorCrossNet(5, 2)
    xl = x0
    for w, b in zip(vc.kernels, vc.bias):
        xl = x0 * (xl @ w) + b.squeeze(1) + xl
    torch.testing.assert_close(vc(x0), xl)

    mix = LowRankMixtureCrossNet(5, 2, num_experts=3, low_rank=2)
    xl = x0
    for layer in range(2):
        experts = []
        for i in range(3):
            e = torch.relu(xl @ mix.V_kernels[layer][i].T)
            e = torch.relu(e @ mix.C_kernels[layer][i].T)
            experts.append(x0 * (e @ mix.U_kernels[layer][i].T + mix.bias[layer].squeeze(1)))
        gates = torch.softmax(torch.cat([g(xl) for g in mix.gates], dim=1), dim=1)  # [B, K]
        xl = sum(gates[:, i : i + 1] * experts[i] for i in range(3)) + xl
    torch.testing.assert_close(mix(x0), xl)


def test_deepfm_and_fm() -> None:
    embs = [torch.randn(4, 2, 3), torch.randn(4, 5)]
    flat = torch.cat([embs[0].flatten(1), embs[1]], dim=1)
    fm = FactorizationMachine()(embs)
    # pairwise products of every pair of scalars
    expected = torch.stack(
        [sum(flat[b, i] * flat[b, j] for i in range(11) for j in range(i + 1, 11)) for b in range(4)]
    ).unsqueeze(1)
    torch.testing.assert_close(fm, expected)
    dense = nn.Linear(11, 2)
    torch.testing.assert_close(DeepFM(dense)(embs), dense(flat))
    assert "_flatten" in torch.fx.symbolic_trace(FactorizationMachine()).code


def test_position_weighted() -> None:
    kjt = KeyedJaggedTensor.from_offsets_sync(["f1", "f2"], torch.arange(8), torch.tensor([0, 2, 2, 3, 4, 5, 8]))
    pw = PositionWeightedProcessor({"f1": 10, "f2": 3})
    with torch.no_grad():
        pw.position_weights["f2"].copy_(torch.tensor([1.0, 2.0, 3.0]))
    out = pw(kjt)
    assert out.weights().tolist() == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 3.0]
    jts = PositionWeightedModule({"f2": 3})(kjt.to_dict())
    assert jts["f1"].weights_or_none() is None and jts["f2"].weights().tolist() == [1.0] * 5
    with pytest.raises(ValueError, match="feature 'f2' has a bag of 3 ids, longer than its max length 2"):
        PositionWeightedModule({"f2": 2})(kjt.to_dict())
    gm = torch.fx.symbolic_trace(pw)
    assert torch.equal(gm(kjt).weights(), out.weights())


def _ebc(dim: int = 4) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        [
            EmbeddingBagConfig(num_embeddings=10, embedding_dim=dim, name="t1", feature_names=["f1", "f3"]),
            EmbeddingBagConfig(num_embeddings=10, embedding_dim=dim, name="t2", feature_names=["f2"]),
        ]
    )


def _kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_offsets_sync(
        ["f1", "f2", "f3"], torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 2, 4, 6, 7, 8, 8])
    )


def test_dlrm_family_shapes_and_reference() -> None:
    torch.manual_seed(0)
    model = DLRM(
        embedding_bag_collection=_ebc(),
        dense_in_features=5,
        dense_arch_layer_sizes=[6, 4],
        over_arch_layer_sizes=[3, 1],
    )
    dense = torch.randn(2, 5)
    out = model(dense_features=dense, sparse_features=_kjt())
    assert out.shape == (2, 1)
    # reference: plain torch on the same parameters
    d = model.dense_arch(dense)
    pooled = model.sparse_arch.embedding_bag_collection(_kjt())
    s = torch.stack([pooled["f1"], pooled["f3"], pooled["f2"]], dim=1)
    z = torch.cat([d.unsqueeze(1), s], dim=1)
    dots = z @ z.transpose(1, 2)
    i, j = torch.triu_indices(4, 4, offset=1)
    torch.testing.assert_close(out, model.over_arch(torch.cat([d, dots[:, i, j]], dim=1)))

    dcn = DLRM_DCN(_ebc(), 5, [6, 4], [3, 1], dcn_num_layers=2, dcn_low_rank_dim=2)
    assert dcn(dense, _kjt()).shape == (2, 1)
    proj = DLRM_Projection(
        _ebc(), 5, [6, 4], [3, 1], interaction_branch1_layer_sizes=[8, 8], interaction_branch2_layer_sizes=[8, 12]
    )
    assert proj(dense, _kjt()).shape == (2, 1)
    with pytest.raises(ValueError, match="not a multiple of the embedding dim"):
        DLRM_Projection(_ebc(), 5, [6, 4], [3, 1], [8, 7], [8, 8])
    with pytest.raises(ValueError, match=r"embedding_dim \(4\) and the last dense arch layer size \(3\)"):
        DLRM(_ebc(), 5, [6, 3], [3, 1])

    class Batch:
        dense_features, sparse_features, labels = dense, _kjt(), torch.tensor([0, 1])

    loss, (_, _logits, labels) = DLRMTrain(model)(Batch())
    torch.testing.assert_close(loss, nn.functional.binary_cross_entropy_with_logits(out.squeeze(1), labels.float()))


def test_torchrec_dlrm_state_dict_loads_into_the_lightning_dlrm() -> None:
    tables = [EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name=n, feature_names=[n]) for n in ("a", "b")]
    plain = DLRM(EmbeddingBagCollection(tables), 3, [5, 4], [6, 1])
    lit = LightningDLRM(
        num_dense=3, tables=tables, dense_arch_layer_sizes=[5, 4], over_arch_layer_sizes=[6, 1], kernel="torch"
    )
    plain_keys = set(plain.state_dict())
    assert plain_keys == {k for k in lit.state_dict() if not k.startswith(("val_", "test_"))}
    lit.load_state_dict(plain.state_dict(), strict=False)
    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.tensor([1, 2, 3]), torch.tensor([1, 1, 0, 1]))
    dense = torch.randn(2, 3)
    torch.testing.assert_close(lit(dense, kjt), plain(dense, kjt).squeeze(1))


def test_interaction_backward_equals_every_pairwise_dots_gradient() -> None:
    # training runs the symmetric backward ((G + G^T) C, one bmm); its gradients equal autograd's through the
    # explicit per-pair formula, and the scripted / no-grad module gives the same values through plain ops
    from lightning_rec.models.dlrm import InteractionArch

    g = torch.Generator().manual_seed(0)
    f, d = 6, 5
    arch = InteractionArch(f)
    assert list(arch.state_dict()) == []  # the index buffers are derived, not saved
    dense = torch.randn(4, d, dtype=torch.float64, generator=g, requires_grad=True)
    sparse = torch.randn(4, f, d, dtype=torch.float64, generator=g, requires_grad=True)
    weights = torch.randn(4, d + f * (f + 1) // 2, dtype=torch.float64, generator=g)
    out = arch(dense, sparse)
    assert out.grad_fn is not None
    assert "_PairDotsBackward" in {fn.name() for fn, _ in out.grad_fn.next_functions if fn is not None}
    (out * weights).sum().backward()
    got = (dense.grad.clone(), sparse.grad.clone())

    dense.grad = sparse.grad = None
    vecs = [dense] + [sparse[:, i] for i in range(f)]
    pairs = [(i, j) for i in range(f + 1) for j in range(i + 1, f + 1)]
    want = torch.cat([dense, torch.stack([(vecs[i] * vecs[j]).sum(1) for i, j in pairs], 1)], 1)
    torch.testing.assert_close(out, want)
    (want * weights).sum().backward()
    torch.testing.assert_close(got, (dense.grad, sparse.grad))
    assert torch.autograd.gradcheck(arch, (dense, sparse))
    with torch.no_grad():
        torch.testing.assert_close(arch(dense, sparse), want)
        torch.testing.assert_close(torch.jit.script(arch)(dense, sparse), want)


def test_interaction_backward_under_autocast_matches_autograds_within_bf16() -> None:
    # the products run in bf16 under autocast; the symmetric backward's matmul runs in bf16 too, as autograd's
    # would, and hands back fp32 gradients
    from lightning_rec.models.dlrm import InteractionArch

    arch = InteractionArch(5)
    grads = []
    for fast in (True, False):
        dense = torch.randn(7, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        sparse = torch.randn(7, 5, 8, generator=torch.Generator().manual_seed(2), requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if fast:
                out = arch(dense, sparse)
            else:
                c = torch.cat([dense.unsqueeze(1), sparse], 1)
                dots = torch.bmm(c, c.transpose(1, 2))
                out = torch.cat([dense, dots[:, arch.triu_indices[0], arch.triu_indices[1]]], 1)
        out.float().square().sum().backward()
        assert dense.grad is not None and sparse.grad is not None
        assert dense.grad.dtype == sparse.grad.dtype == torch.float32
        grads.append(torch.cat([dense.grad.flatten(), sparse.grad.flatten()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=2e-2, atol=2e-2 * float(grads[1].abs().max()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("autocast", [False, True])
def test_interaction_symmetric_backward_on_cuda_matches_cpu(autocast: bool) -> None:
    # the gather and batched matmul of the symmetric backward on a GPU, fp32 and under bf16 autocast, against the
    # same module on CPU
    from lightning_rec.models.dlrm import InteractionArch

    arch = InteractionArch(6)
    results = []
    for device in ("cpu", "cuda"):
        dense = torch.randn(9, 8, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
        sparse = torch.randn(9, 6, 8, generator=torch.Generator().manual_seed(2)).to(device).requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            out = arch.to(device)(dense, sparse)
        out.float().square().sum().backward()
        assert dense.grad is not None and sparse.grad is not None
        results.append([t.detach().float().cpu() for t in (out, dense.grad, sparse.grad)])
    rtol = 3e-2 if autocast else 1e-4  # bf16 sums in another order on each device
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * float(want.abs().max()))
