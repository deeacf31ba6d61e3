"""Unsharded EmbeddingBagCollection / EmbeddingCollection against an independent plain-torch reference.

The reference never goes through lightning_rec: it builds every bag from Python lists and looks it up with
``F.embedding_bag`` / ``F.embedding`` on copies of the module's weights (taken from its state_dict).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_rec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    JaggedTensor,
    KeyedJaggedTensor,
    KeyedTensor,
    PoolingType,
)
from lightning_rec.embedding_modules import FeatureLayout

# fbgemm's dense CPU backward is correct but warns that it has no autograd kernel (docs/ARCHITECTURE.md, fbgemm pitfalls).
pytestmark = pytest.mark.filterwarnings("ignore:.*an autograd kernel was not registered")

MAX_EXAMPLES = int(os.environ.get("LIGHTNING_REC_HYPOTHESIS_EXAMPLES", "25"))
HYP = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("LIGHTNING_REC_HYPOTHESIS_RANDOM", "0") != "1",
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# (rtol, atol) for outputs and gradients, against a float32 reference computed from the same (rounded) weights.
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (3e-2, 6e-2),
}


# -- random cases ---------------------------------------------------------------------------------


@dataclass
class Table:
    name: str
    rows: int
    dim: int
    features: list[str]
    mean: bool


@dataclass
class Case:
    tables: list[Table]
    batch: int
    bags: dict[str, list[list[int]]]  # feature -> one list of ids per sample
    key_order: list[str]  # order of the keys in the input KJT (a permutation of the config order)
    seed: int

    @property
    def features(self) -> list[str]:
        return [f for t in self.tables for f in t.features]

    def table_of(self, f: str) -> Table:
        return next(t for t in self.tables if f in t.features)


@st.composite
def cases(draw, max_features_per_table: int = 3) -> Case:
    n_tables = draw(st.integers(1, 3))
    tables = []
    for i in range(n_tables):
        n_feat = draw(st.integers(1, max_features_per_table))
        tables.append(
            Table(
                name=f"t{i}",
                rows=draw(st.integers(1, 20)),
                dim=draw(st.integers(1, 9)),
                features=[f"t{i}_f{j}" for j in range(n_feat)],
                mean=draw(st.booleans()),
            )
        )
    batch = draw(st.integers(0, 4))
    bags = {}
    for t in tables:
        for f in t.features:
            bags[f] = [draw(st.lists(st.integers(0, t.rows - 1), min_size=0, max_size=5)) for _ in range(batch)]
    feats = [f for t in tables for f in t.features]
    key_order = draw(st.permutations(feats))
    return Case(tables, batch, bags, list(key_order), draw(st.integers(0, 2**31 - 1)))


def bag_weights(case: Case) -> dict[str, list[list[float]]]:
    g = torch.Generator().manual_seed(case.seed)
    return {
        f: [(torch.rand(len(bag), generator=g) * 1.5 + 0.25).tolist() for bag in bags] for f, bags in case.bags.items()
    }


def build_kjt(case: Case, weights: dict[str, list[list[float]]] | None) -> KeyedJaggedTensor:
    values, lengths, w = [], [], []
    for f in case.key_order:
        for i, bag in enumerate(case.bags[f]):
            values += bag
            lengths.append(len(bag))
            if weights is not None:
                w += weights[f][i]
    return KeyedJaggedTensor.from_lengths_sync(
        case.key_order,
        torch.tensor(values, dtype=torch.long),
        torch.tensor(lengths, dtype=torch.long),
        weights=None if weights is None else torch.tensor(w, dtype=torch.float32),
    )


def ebc_configs(case: Case, dtype: torch.dtype) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            num_embeddings=t.rows,
            embedding_dim=t.dim,
            name=t.name,
            feature_names=list(t.features),
            pooling=PoolingType.MEAN if t.mean else PoolingType.SUM,
            dtype=dtype,
        )
        for t in case.tables
    ]


def ref_weights(module: nn.Module, prefix: str, case: Case) -> dict[str, torch.Tensor]:
    """Float32 leaf copies of the module's tables, taken from its state_dict."""
    sd = module.state_dict()
    return {t.name: sd[f"{prefix}.{t.name}.weight"].detach().float().clone().requires_grad_() for t in case.tables}


def ref_pooled(case: Case, w: dict[str, torch.Tensor], weights: dict[str, list[list[float]]] | None) -> torch.Tensor:
    """``[batch, sum of dims]`` in config order, straight from F.embedding_bag."""
    outs = []
    for f in case.features:
        t = case.table_of(f)
        bags = case.bags[f]
        ids = torch.tensor([i for bag in bags for i in bag], dtype=torch.long)
        lens = torch.tensor([len(bag) for bag in bags], dtype=torch.long)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lens, 0)])
        if weights is None:
            out = F.embedding_bag(ids, w[t.name], offsets, mode="mean" if t.mean else "sum", include_last_offset=True)
        else:
            psw = torch.tensor([x for ws in weights[f] for x in ws], dtype=torch.float32)
            out = F.embedding_bag(ids, w[t.name], offsets, mode="sum", per_sample_weights=psw, include_last_offset=True)
            if t.mean:
                out = out / lens.clamp_min(1).to(out.dtype)[:, None]
        outs.append(out)
    return torch.cat(outs, dim=1)


def dense_grad(w: torch.Tensor) -> torch.Tensor:
    assert w.grad is not None, "table got no gradient"
    return w.grad.to_dense() if w.grad.is_sparse else w.grad


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def check_ebc(case: Case, *, dtype, kernel: str, weighted: bool, sparse_grad: bool) -> None:
    torch.manual_seed(case.seed)
    ebc = EmbeddingBagCollection(ebc_configs(case, dtype), is_weighted=weighted, kernel=kernel, sparse_grad=sparse_grad)
    w_ref = ref_weights(ebc, "embedding_bags", case)
    weights = bag_weights(case) if weighted else None
    kjt = build_kjt(case, weights)

    out = ebc(kjt)
    assert isinstance(out, KeyedTensor)
    assert out.keys() == case.features
    assert out.length_per_key() == [case.table_of(f).dim for f in case.features]
    assert out.values().dtype == dtype
    expected = ref_pooled(case, w_ref, weights)
    assert out.values().shape == expected.shape
    close(out.values(), expected, dtype, "pooled output")
    for i, f in enumerate(case.features):
        lo = sum(case.table_of(g).dim for g in case.features[:i])
        close(out[f], expected[:, lo : lo + case.table_of(f).dim], dtype, f"output of {f}")

    g = torch.Generator().manual_seed(case.seed + 1)
    upstream = torch.rand(expected.shape, generator=g) * 2 - 1
    out.values().backward(upstream.to(out.values().dtype))
    (expected * upstream).sum().backward()
    for t in case.tables:
        p = ebc.embedding_bags[t.name].weight
        assert p.grad is not None, f"table {t.name} got no gradient"
        assert p.grad.is_sparse == sparse_grad
        assert p.grad.dtype == dtype and p.grad.shape == p.shape
        close(dense_grad(p), w_ref[t.name].grad, dtype, f"grad of {t.name}")


# -- EmbeddingBagCollection: equivalence with the reference ---------------------------------------

KERNEL_VARIANTS = [("torch", False), ("torch", True), ("fbgemm", False)]


@pytest.mark.parametrize("kernel,sparse_grad", KERNEL_VARIANTS, ids=["torch", "torch-sparse", "fbgemm"])
@HYP
@given(case=cases(), weighted=st.booleans())
def test_ebc_matches_reference_fp32(case: Case, weighted: bool, kernel: str, sparse_grad: bool) -> None:
    check_ebc(case, dtype=torch.float32, kernel=kernel, weighted=weighted, sparse_grad=sparse_grad)


@HYP
@given(
    case=cases(max_features_per_table=2),
    weighted=st.booleans(),
    variant=st.sampled_from(
        [
            (torch.float16, "torch", False),
            (torch.float16, "torch", True),
            (torch.float16, "fbgemm", False),
            (torch.float16, "auto", False),
            (torch.bfloat16, "torch", False),
            (torch.bfloat16, "torch", True),
            (torch.bfloat16, "auto", False),
        ]
    ),
)
def test_ebc_matches_reference_low_precision(case: Case, weighted: bool, variant) -> None:
    dtype, kernel, sparse_grad = variant
    check_ebc(case, dtype=dtype, kernel=kernel, weighted=weighted, sparse_grad=sparse_grad)


def _fixed_case(batch: int = 3) -> Case:
    tables = [
        Table("user", 7, 3, ["u", "u2"], mean=True),
        Table("item", 11, 8, ["i"], mean=False),
        Table("ctx", 5, 5, ["c"], mean=True),
    ]
    bags = {
        "u": [[0, 0, 6], [], [2]][:batch],
        "u2": [[1], [1, 1, 1, 1], []][:batch],
        "i": [[10, 3], [3], [0, 10, 10]][:batch],
        "c": [[], [], [4]][:batch],
    }
    return Case(tables, batch, bags, ["i", "c", "u2", "u"], seed=1234)


@pytest.mark.parametrize("kernel,sparse_grad", KERNEL_VARIANTS, ids=["torch", "torch-sparse", "fbgemm"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("batch", [3, 0])
def test_ebc_fixed_case(kernel: str, sparse_grad: bool, weighted: bool, batch: int) -> None:
    """Shared tables, mixed dims (incl. non-multiples of 4), empty bags, duplicate ids, shuffled keys."""
    check_ebc(_fixed_case(batch), dtype=torch.float32, kernel=kernel, weighted=weighted, sparse_grad=sparse_grad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("sparse_grad", [False, True], ids=["dense", "sparse"])
def test_low_precision_shared_tables_fixed_case(dtype: torch.dtype, sparse_grad: bool) -> None:
    """Two features on one table: their (sparse) gradients must combine even where torch cannot add sparse fp16."""
    case = _fixed_case()
    check_ebc(case, dtype=dtype, kernel="torch", weighted=True, sparse_grad=sparse_grad)
    check_ec(case, dtype=dtype, sparse_grad=sparse_grad)


def test_empty_batch_output_stays_in_the_graph() -> None:
    ebc = EmbeddingBagCollection(_small_configs(), kernel="torch")
    kjt = KeyedJaggedTensor(
        ["f0", "f1", "f2"], torch.zeros(0, dtype=torch.long), lengths=torch.zeros(0, dtype=torch.long)
    )
    out = ebc(kjt).values()
    assert out.shape == (0, 11) and out.requires_grad
    out.sum().backward()  # a rank with no samples still runs backward
    assert all(p.grad is not None and not p.grad.any() for p in ebc.parameters())
    with torch.no_grad():
        assert not ebc(kjt).values().requires_grad


def test_weighted_mean_is_weighted_sum_over_bag_length() -> None:
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(num_embeddings=3, embedding_dim=2, name="t", feature_names=["f"], pooling="mean")],
        is_weighted=True,
        kernel="torch",
    )
    with torch.no_grad():
        ebc.embedding_bags["t"].weight.copy_(torch.tensor([[1.0, 2.0], [10.0, 20.0], [100.0, 200.0]]))
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["f"], torch.tensor([0, 1, 2]), torch.tensor([2, 0, 1]), weights=torch.tensor([1.0, 3.0, 0.5])
    )
    out = ebc(kjt).values()
    expected = torch.tensor([[(1 + 30) / 2, (2 + 60) / 2], [0.0, 0.0], [50.0, 100.0]])
    torch.testing.assert_close(out, expected)


def test_unweighted_collection_ignores_input_weights() -> None:
    case = _fixed_case()
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(ebc_configs(case, torch.float32), kernel="torch")
    with_w = ebc(build_kjt(case, bag_weights(case))).values()
    without = ebc(build_kjt(case, None)).values()
    torch.testing.assert_close(with_w, without)


# -- EmbeddingCollection ----------------------------------------------------------------------------


def check_ec(case: Case, *, dtype, sparse_grad: bool) -> None:
    torch.manual_seed(case.seed)
    configs = [
        EmbeddingConfig(
            num_embeddings=t.rows, embedding_dim=t.dim, name=t.name, feature_names=list(t.features), dtype=dtype
        )
        for t in case.tables
    ]
    ec = EmbeddingCollection(configs, sparse_grad=sparse_grad)
    w_ref = ref_weights(ec, "embeddings", case)
    out = ec(build_kjt(case, None))
    assert isinstance(out, dict) and list(out) == case.features
    g = torch.Generator().manual_seed(case.seed + 1)
    ref_loss = 0.0
    roots, grads = [], []
    for f in case.features:
        t = case.table_of(f)
        jt = out[f]
        assert isinstance(jt, JaggedTensor)
        ids = torch.tensor([i for bag in case.bags[f] for i in bag], dtype=torch.long)
        expected = F.embedding(ids, w_ref[t.name])
        assert jt.values().shape == (ids.numel(), t.dim) and jt.values().dtype == dtype
        assert jt.lengths().tolist() == [len(bag) for bag in case.bags[f]]
        close(jt.values(), expected, dtype, f"embeddings of {f}")
        upstream = torch.rand(expected.shape, generator=g) * 2 - 1
        roots.append(jt.values())
        grads.append(upstream.to(dtype))
        ref_loss = ref_loss + (expected * upstream).sum()
    torch.autograd.backward(roots, grads)  # one backward, as a training step does
    if isinstance(ref_loss, torch.Tensor):
        ref_loss.backward()
    for t in case.tables:
        p = ec.embeddings[t.name].weight
        ref_grad = w_ref[t.name].grad
        if ref_grad is None:  # no feature of this table had any id
            ref_grad = torch.zeros(t.rows, t.dim)
        if p.grad is None:
            assert not ref_grad.any()
            continue
        assert p.grad.is_sparse == sparse_grad
        close(dense_grad(p), ref_grad, dtype, f"grad of {t.name}")


@pytest.mark.parametrize("sparse_grad", [False, True], ids=["dense", "sparse"])
@HYP
@given(case=cases(), dtype=st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16]))
def test_ec_matches_reference(case: Case, dtype: torch.dtype, sparse_grad: bool) -> None:
    check_ec(case, dtype=dtype, sparse_grad=sparse_grad)


@pytest.mark.parametrize("sparse_grad", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("batch", [3, 0])
def test_ec_fixed_case(sparse_grad: bool, batch: int) -> None:
    check_ec(_fixed_case(batch), dtype=torch.float32, sparse_grad=sparse_grad)


# -- precision and kernel selection ---------------------------------------------------------------


def _small_configs(dtype=torch.float32, names=("a", "b")):
    return [
        EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name=names[0], feature_names=["f0", "f1"], dtype=dtype),
        EmbeddingBagConfig(
            num_embeddings=6, embedding_dim=3, name=names[1], feature_names=["f2"], pooling="mean", dtype=dtype
        ),
    ]


def _small_kjt(weights: bool = False) -> KeyedJaggedTensor:
    values = torch.tensor([1, 2, 9, 0, 3, 3, 5, 0, 5, 1])
    return KeyedJaggedTensor.from_lengths_sync(
        ["f0", "f1", "f2"],
        values,
        torch.tensor([2, 1, 0, 1, 2, 0, 1, 3, 0]),
        weights=torch.linspace(0.5, 2.0, values.numel()) if weights else None,
    )


def test_bf16_with_fbgemm_kernel_raises() -> None:
    ebc = EmbeddingBagCollection(_small_configs(torch.bfloat16), kernel="fbgemm")
    with pytest.raises(ValueError, match="kernel='fbgemm' cannot be used: fbgemm has no torch.bfloat16 kernel"):
        ebc(_small_kjt())
    fp32 = EmbeddingBagCollection(_small_configs(), kernel="fbgemm")
    fp32(_small_kjt())
    fp32.to(torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        fp32(_small_kjt())


def test_fbgemm_kernel_rejects_sparse_grad_and_mixed_dtypes() -> None:
    with pytest.raises(ValueError, match="sparse_grad=True needs the torch kernel"):
        EmbeddingBagCollection(_small_configs(), kernel="fbgemm", sparse_grad=True)(_small_kjt())
    mixed = _small_configs()
    mixed[1].dtype = torch.float16
    with pytest.raises(ValueError, match="mix dtypes"):
        EmbeddingBagCollection(mixed, kernel="fbgemm")(_small_kjt())
    # auto falls back to torch, which promotes to the widest dtype
    out = EmbeddingBagCollection(mixed, kernel="auto")(_small_kjt())
    assert out.values().dtype == torch.float32


def test_unknown_kernel_name() -> None:
    with pytest.raises(ValueError, match="kernel must be one of"):
        EmbeddingBagCollection(_small_configs(), kernel="cuda")


def test_bf16_conversion_with_auto_kernel_keeps_working() -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(_small_configs(), kernel="auto")
    ebc(_small_kjt())
    ebc.to(torch.bfloat16)
    p = ebc.embedding_bags["a"].weight
    assert p.dtype == torch.bfloat16 and isinstance(p, nn.Parameter)
    out = ebc(_small_kjt()).values()
    assert out.dtype == torch.bfloat16
    ref = EmbeddingBagCollection(_small_configs(), kernel="torch")
    ref.load_state_dict({k: v.float() for k, v in ebc.state_dict().items()})
    torch.testing.assert_close(out.float(), ref(_small_kjt()).values(), rtol=3e-2, atol=3e-2)
    out.float().sum().backward()
    assert p.grad is not None and p.grad.dtype == torch.bfloat16


# -- state_dict and parameters ------------------------------------------------------------------------

ODD_NAMES = ("user.id", "item table", "表格.ü", "a.b c.d")


@pytest.mark.parametrize("kernel", ["torch", "fbgemm"])
def test_ebc_state_dict_keys_parameters_and_storage(kernel: str) -> None:
    configs = [
        EmbeddingBagConfig(num_embeddings=5 + i, embedding_dim=4, name=n, feature_names=[f"f{i}"])
        for i, n in enumerate(ODD_NAMES)
    ]
    ebc = EmbeddingBagCollection(configs, kernel=kernel)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        [f"f{i}" for i in range(4)], torch.tensor([0, 1, 2, 3, 4]), torch.tensor([1, 1, 1, 2])
    )
    ebc(kjt)  # the fbgemm kernel packs its tables here; nothing below may change because of it
    expected_keys = [f"embedding_bags.{n}.weight" for n in ODD_NAMES]
    sd = ebc.state_dict()
    assert list(sd) == expected_keys
    params = dict(ebc.named_parameters())
    assert list(params) == expected_keys
    for i, (name, p) in enumerate(params.items()):
        assert type(p) is nn.Parameter and p.is_leaf and p.requires_grad
        assert p.shape == (5 + i, 4)
        assert sd[name].data_ptr() == p.data_ptr()
        assert not sd[name].requires_grad
    assert len(list(ebc.parameters())) == len(ODD_NAMES)
    assert ebc.embedding_bags[ODD_NAMES[2]].weight is params[expected_keys[2]]

    # state_dict tensors write through to the live weights, and the next forward sees them
    with torch.no_grad():
        sd[expected_keys[0]].fill_(2.0)
    assert bool((ebc.embedding_bags["user.id"].weight == 2.0).all())
    assert torch.allclose(ebc(kjt)["f0"], torch.full((1, 4), 2.0))

    # load_state_dict round trip into a fresh module and back into this one
    new = {k: torch.randn_like(v) for k, v in sd.items()}
    ebc.load_state_dict(new)
    for k, p in params.items():
        assert torch.equal(p.detach(), new[k])
        assert ebc.state_dict()[k].data_ptr() == p.data_ptr()
    other = EmbeddingBagCollection(configs, kernel="torch")
    other.load_state_dict(ebc.state_dict())
    torch.testing.assert_close(other(kjt).values(), ebc(kjt).values(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        ebc(kjt)["f3"], (new["embedding_bags.a.b c.d.weight"][3] + new["embedding_bags.a.b c.d.weight"][4])[None]
    )


@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_strict_load_state_dict_with_dotted_and_prefix_sharing_names(kind: str) -> None:
    names = ["user", "user.id", "user.id.x", "u v.w"]
    if kind == "ebc":
        make = lambda: EmbeddingBagCollection(  # noqa: E731
            [
                EmbeddingBagConfig(num_embeddings=3, embedding_dim=2, name=n, feature_names=[f"f{i}"])
                for i, n in enumerate(names)
            ]
        )
        prefix = "embedding_bags"
    else:
        make = lambda: EmbeddingCollection(  # noqa: E731
            [
                EmbeddingConfig(num_embeddings=3, embedding_dim=2, name=n, feature_names=[f"f{i}"])
                for i, n in enumerate(names)
            ]
        )
        prefix = "embeddings"
    a, b = make(), make()
    assert list(a.state_dict()) == [f"{prefix}.{n}.weight" for n in names]
    result = b.load_state_dict(a.state_dict())  # strict
    assert not result.missing_keys and not result.unexpected_keys
    for k, v in a.state_dict().items():
        assert torch.equal(b.state_dict()[k], v)

    # strict loading still reports real mismatches
    sd = dict(a.state_dict())
    sd[f"{prefix}.user.idx.weight"] = torch.zeros(3, 2)
    sd[f"{prefix}.user.id.bias"] = torch.zeros(2)
    del sd[f"{prefix}.user.id.x.weight"]
    with pytest.raises(RuntimeError) as err:
        b.load_state_dict(sd)
    msg = str(err.value)
    assert f'Missing key(s) in state_dict: "{prefix}.user.id.x.weight"' in msg
    assert f'"{prefix}.user.idx.weight"' in msg and f'"{prefix}.user.id.bias"' in msg
    result = b.load_state_dict(sd, strict=False)
    assert result.missing_keys == [f"{prefix}.user.id.x.weight"]
    assert sorted(result.unexpected_keys) == sorted([f"{prefix}.user.idx.weight", f"{prefix}.user.id.bias"])
    # nested inside a user model, the prefixes compose
    outer, outer2 = nn.ModuleDict({"m": a}), nn.ModuleDict({"m": b})
    outer2.load_state_dict(outer.state_dict())
    with pytest.raises(RuntimeError, match="Unexpected key"):
        outer2.load_state_dict({**outer.state_dict(), f"m.{prefix}.nope.weight": torch.zeros(1)})


def test_ec_state_dict_keys_and_round_trip() -> None:
    configs = [
        EmbeddingConfig(num_embeddings=4, embedding_dim=3, name=n, feature_names=[f"f{i}"])
        for i, n in enumerate(ODD_NAMES)
    ]
    ec = EmbeddingCollection(configs)
    sd = ec.state_dict()
    assert list(sd) == [f"embeddings.{n}.weight" for n in ODD_NAMES]
    assert [n for n, _ in ec.named_parameters()] == list(sd)
    for k, p in ec.named_parameters():
        assert type(p) is nn.Parameter and p.is_leaf and sd[k].data_ptr() == p.data_ptr()
    new = {k: torch.randn_like(v) for k, v in sd.items()}
    ec.load_state_dict(new)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        [f"f{i}" for i in range(4)], torch.tensor([3, 0]), torch.tensor([1, 0, 0, 1])
    )
    out = ec(kjt)
    assert torch.equal(out["f0"].values(), new["embeddings.user.id.weight"][[3]])
    assert torch.equal(out["f3"].values(), new["embeddings.a.b c.d.weight"][[0]])
    assert out["f1"].values().shape == (0, 3)


def test_fbgemm_after_half_conversion_tracks_parameters() -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(_small_configs(), is_weighted=True, kernel="fbgemm")
    kjt = _small_kjt(weights=True)
    ebc(kjt)  # pack fp32
    ebc.to(torch.float16)
    params = [ebc.embedding_bags[n].weight for n in ("a", "b")]
    assert all(type(p) is nn.Parameter and p.dtype == torch.float16 and p.is_leaf for p in params)

    def torch_reference() -> torch.Tensor:
        ref = EmbeddingBagCollection(_small_configs(torch.float16), is_weighted=True, kernel="torch")
        ref.load_state_dict(ebc.state_dict())
        with torch.no_grad():
            return ref(kjt).values()

    out = ebc(kjt).values()
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, torch_reference(), rtol=2e-3, atol=2e-3)
    sd = ebc.state_dict()
    for n, p in zip(("a", "b"), params):
        assert sd[f"embedding_bags.{n}.weight"].data_ptr() == p.data_ptr()

    # An optimizer step on the parameters is what the next forward sees (never a detached copy).
    opt = torch.optim.SGD(ebc.parameters(), lr=0.5)
    before = [p.detach().clone() for p in params]
    out.float().pow(2).sum().backward()
    grads = [p.grad.clone() for p in params]
    assert all(g.dtype == torch.float16 and g.abs().sum() > 0 for g in grads)
    opt.step()
    for p, b, g in zip(params, before, grads):
        torch.testing.assert_close(p.detach(), b - 0.5 * g, rtol=0, atol=1e-3)
    after = ebc(kjt).values()
    assert not torch.equal(after, out)
    torch.testing.assert_close(after, torch_reference(), rtol=2e-3, atol=2e-3)

    # load_state_dict after the step writes through too
    ebc.load_state_dict({k: torch.zeros_like(v) for k, v in ebc.state_dict().items()})
    assert not ebc(kjt).values().any()

    # and back to fp32
    ebc.to(torch.float32)
    ebc.load_state_dict({k: torch.ones_like(v) for k, v in ebc.state_dict().items()})
    out32 = ebc(kjt).values()
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32, torch_reference().float(), rtol=1e-3, atol=1e-3)


def test_fbgemm_optimizer_steps_fp32_match_torch_kernel() -> None:
    torch.manual_seed(0)
    a = EmbeddingBagCollection(_small_configs(), kernel="fbgemm")
    b = EmbeddingBagCollection(_small_configs(), kernel="torch")
    b.load_state_dict(a.state_dict())
    oa = torch.optim.SGD(a.parameters(), lr=0.3, momentum=0.9)
    ob = torch.optim.SGD(b.parameters(), lr=0.3, momentum=0.9)
    kjt = _small_kjt()
    for _ in range(3):
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            m(kjt).values().sin().sum().backward()
            o.step()
    for k, v in b.state_dict().items():
        torch.testing.assert_close(a.state_dict()[k], v, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a(kjt).values(), b(kjt).values(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("weighted", [False, True])
def test_sparse_grad_sgd_step_equals_dense_step(weighted: bool) -> None:
    torch.manual_seed(0)
    dense = EmbeddingBagCollection(_small_configs(), is_weighted=weighted, kernel="torch")
    sparse = EmbeddingBagCollection(_small_configs(), is_weighted=weighted, kernel="torch", sparse_grad=True)
    sparse.load_state_dict(dense.state_dict())
    od = torch.optim.SGD(dense.parameters(), lr=0.2)
    os_ = torch.optim.SGD(sparse.parameters(), lr=0.2)
    kjt = _small_kjt(weights=weighted)
    for _ in range(3):
        for m, o in ((dense, od), (sparse, os_)):
            o.zero_grad()
            m(kjt).values().pow(2).sum().backward()
            o.step()
    assert sparse.embedding_bags["a"].weight.grad.is_sparse
    for k, v in dense.state_dict().items():
        torch.testing.assert_close(sparse.state_dict()[k], v, rtol=1e-6, atol=1e-6)


# -- bad input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["torch", "fbgemm"])
@pytest.mark.parametrize("bad,shown", [(-1, "-1"), (6, "6"), (100, "100")])
def test_out_of_range_id_names_feature_table_value_and_range(kernel: str, bad: int, shown: str) -> None:
    ebc = EmbeddingBagCollection(_small_configs(), kernel=kernel)
    values = torch.tensor([1, 2, 9, 0, 3, 3, 5, 0, bad, 1])
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2"], values, torch.tensor([2, 1, 0, 1, 2, 0, 1, 3, 0]))
    msg = rf"feature 'f2' \(table 'b'\) has id {shown}, outside the valid range \[0, 5\] \(num_embeddings=6\)"
    with pytest.raises(ValueError, match=msg):
        ebc(kjt)
    # the key order of the input does not change which feature is named
    with pytest.raises(ValueError, match=msg):
        ebc(kjt.permute([2, 0, 1]))


def test_out_of_range_id_in_embedding_collection_and_shared_table() -> None:
    ec = EmbeddingCollection([EmbeddingConfig(num_embeddings=3, embedding_dim=2, name="tbl", feature_names=["x", "y"])])
    kjt = KeyedJaggedTensor.from_lengths_sync(["x", "y"], torch.tensor([0, 2, 1, 3]), torch.tensor([2, 0, 1, 1]))
    with pytest.raises(ValueError, match=r"feature 'y' \(table 'tbl'\) has id 3, outside the valid range \[0, 2\]"):
        ec(kjt)
    kjt = KeyedJaggedTensor.from_lengths_sync(["x", "y"], torch.tensor([-5, 0]), torch.tensor([1, 0, 1, 0]))
    with pytest.raises(ValueError, match=r"feature 'x' \(table 'tbl'\) has id -5"):
        ec(kjt)


def test_kjt_keys_must_match_features() -> None:
    ebc = EmbeddingBagCollection(_small_configs(), strict_features=True)
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "zz", "f2"], torch.tensor([1, 2, 3]), torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match=r"missing \['f1'\], unexpected \['zz'\]"):
        ebc(kjt)
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f2"], torch.tensor([1, 2]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"missing \['f1'\], unexpected \[\]"):
        ebc(kjt)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["f0", "f1", "f2", "extra"], torch.tensor([1, 2, 3, 4]), torch.tensor([1, 1, 1, 1])
    )
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['extra'\]"):
        ebc(kjt)
    # permute() may repeat keys; a collection does not guess which copy to use
    repeated = _small_kjt().permute([0, 1, 2, 0])
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \[\], duplicated \['f0'\]"):
        ebc(repeated)
    ec = EmbeddingCollection(
        [EmbeddingConfig(num_embeddings=3, embedding_dim=2, name="t", feature_names=["x"])], strict_features=True
    )
    with pytest.raises(ValueError, match=r"missing \['x'\], unexpected \['y'\]"):
        ec(KeyedJaggedTensor.from_lengths_sync(["y"], torch.tensor([0]), torch.tensor([1])))
    with pytest.raises(TypeError, match="expected a KeyedJaggedTensor"):
        ebc({"f0": torch.tensor([1])})


def test_weighted_collection_needs_weights() -> None:
    ebc = EmbeddingBagCollection(_small_configs(), is_weighted=True)
    assert ebc.is_weighted()
    with pytest.raises(ValueError, match=r"is_weighted=True.*no weights"):
        ebc(_small_kjt(weights=False))


def test_config_errors() -> None:
    def cfg(**kw):
        base = dict(num_embeddings=4, embedding_dim=2, name="t", feature_names=["f"])
        base.update(kw)
        return base

    with pytest.raises(ValueError, match="table name 't' is used twice"):
        EmbeddingBagCollection([EmbeddingBagConfig(**cfg()), EmbeddingBagConfig(**cfg(feature_names=["g"]))])
    with pytest.raises(ValueError, match="table name 't' is used twice"):
        EmbeddingCollection([EmbeddingConfig(**cfg()), EmbeddingConfig(**cfg(feature_names=["g"]))])
    assert EmbeddingBagConfig(**cfg(feature_names=[])).feature_names == ["t"]  # TorchRec's default
    with pytest.raises(ValueError, match="duplicate feature names"):
        EmbeddingBagConfig(**cfg(feature_names=["f", "f"]))
    with pytest.raises(ValueError, match="dtype must be one of"):
        EmbeddingBagConfig(**cfg(dtype=torch.int64))
    with pytest.raises(ValueError, match="dtype must be one of"):
        EmbeddingConfig(**cfg(dtype="float64"))
    with pytest.raises(ValueError, match="dtype must be one of"):
        EmbeddingConfig(**cfg(dtype="nn"))
    assert EmbeddingBagConfig(**cfg(dtype="float16")).dtype == torch.float16
    for field in ("num_embeddings", "embedding_dim"):
        for bad in (0, -3, 2.0, True, None):
            with pytest.raises(ValueError, match=f"{field} must be a positive int"):
                EmbeddingBagConfig(**cfg(**{field: bad}))
    with pytest.raises(ValueError, match="table name must be a non-empty string"):
        EmbeddingBagConfig(**cfg(name=""))
    with pytest.raises(ValueError, match="use EmbeddingConfig for unpooled"):
        EmbeddingBagConfig(**cfg(pooling="none"))
    with pytest.raises(ValueError, match="use EmbeddingConfig for unpooled"):
        EmbeddingBagConfig(**cfg(pooling=PoolingType.NONE))
    with pytest.raises(ValueError, match="unknown pooling 'max'"):
        EmbeddingBagConfig(**cfg(pooling="max"))
    with pytest.raises(ValueError, match="unknown pooling"):
        EmbeddingBagConfig(**cfg(pooling=1))
    with pytest.raises(ValueError, match="does not pool"):
        EmbeddingConfig(**cfg(pooling="sum"))
    with pytest.raises(ValueError, match="weight_init_min > weight_init_max"):
        EmbeddingBagConfig(**cfg(weight_init_min=1.0, weight_init_max=0.0))
    with pytest.raises(TypeError, match="expected EmbeddingBagConfig"):
        EmbeddingBagCollection([EmbeddingConfig(**cfg())])
    assert EmbeddingBagConfig(**cfg(pooling="Mean")).pooling == PoolingType.MEAN
    assert EmbeddingBagConfig(**cfg(pooling="sum")).pooling == PoolingType.SUM


def test_config_init() -> None:
    c = EmbeddingBagConfig(num_embeddings=400, embedding_dim=8, name="t", feature_names=["f"])
    assert c.weight_init_min == pytest.approx(-0.05) and c.weight_init_max == pytest.approx(0.05)
    w = EmbeddingBagCollection([c]).embedding_bags["t"].weight
    assert float(w.detach().abs().max()) <= 0.05 and float(w.detach().std()) > 0.01
    c2 = EmbeddingBagConfig(num_embeddings=4, embedding_dim=2, name="t", feature_names=["f"], init_fn=nn.init.ones_)
    assert torch.equal(EmbeddingBagCollection([c2]).embedding_bags["t"].weight.detach(), torch.ones(4, 2))


def test_extra_keys_are_ignored_unless_strict() -> None:
    ebc = EmbeddingBagCollection(_small_configs())
    base = ebc(_small_kjt(weights=False))
    extra = KeyedJaggedTensor.concat(
        [
            KeyedJaggedTensor.from_lengths_sync(
                ["zz"], torch.tensor([7, 8, 9]), torch.tensor([3] + [0] * (base.values().size(0) - 1))
            ),
            _small_kjt(weights=False),
        ]
    )
    assert torch.equal(ebc(extra).values(), base.values())


def test_one_feature_read_by_two_tables() -> None:
    t1 = EmbeddingBagConfig(num_embeddings=4, embedding_dim=2, name="t1", feature_names=["f"])
    t2 = EmbeddingBagConfig(num_embeddings=5, embedding_dim=3, name="t2", feature_names=["f"], pooling="mean")
    ebc = EmbeddingBagCollection([t1, t2])
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([1, 3, 0]), torch.tensor([2, 1]))
    out = ebc(kjt)
    assert out.keys() == ["f@t1", "f@t2"] and out.length_per_key() == [2, 3]
    w1, w2 = ebc.embedding_bags["t1"].weight, ebc.embedding_bags["t2"].weight
    assert torch.allclose(out["f@t1"], torch.stack([w1[1] + w1[3], w1[0]]))
    assert torch.allclose(out["f@t2"], torch.stack([(w2[1] + w2[3]) / 2, w2[0]]))
    # the sharded modules build their layout without allow_shared: refused with the clear error
    with pytest.raises(ValueError, match="feature 'f' is listed by tables 't1' and 't2'.*not yet sharded"):
        FeatureLayout([t1, t2])
    ec = EmbeddingCollection(
        [EmbeddingConfig(num_embeddings=4, embedding_dim=2, name=n, feature_names=["f"]) for n in ("a", "b")],
        need_indices=True,
    )
    res = ec(kjt)
    assert list(res) == ["f@a", "f@b"]
    assert torch.equal(res["f@b"].values(), ec.embeddings["b"].weight[torch.tensor([1, 3, 0])])
    assert res["f@a"].weights().tolist() == [1, 3, 0]  # need_indices: the ids come back as weights


def test_float_values_and_int_weights_in_a_kjt() -> None:
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["f"], torch.tensor([1.0, 2.0]), torch.tensor([2]), weights=torch.tensor([1, 2])
    )
    assert kjt["f"].weights().dtype == torch.long  # kept as given
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(num_embeddings=4, embedding_dim=2, name="t", feature_names=["f"])])
    with pytest.raises(ValueError, match=r"lookup needs 1-D integer ids.*torch.float32.*\['f'\]"):
        ebc(kjt)
    # integer weights of a weighted collection are used as float weights
    wbc = EmbeddingBagCollection(ebc.embedding_bag_configs(), is_weighted=True)
    out = wbc(
        KeyedJaggedTensor.from_lengths_sync(
            ["f"], torch.tensor([1, 2]), torch.tensor([2]), weights=torch.tensor([1, 2])
        )
    )
    w = wbc.embedding_bags["t"].weight
    assert torch.allclose(out.values(), (w[1] + 2 * w[2]).unsqueeze(0))


def test_int32_lengths_lookup_matches_int64() -> None:
    ebc = EmbeddingBagCollection(_small_configs())
    kjt = _small_kjt(weights=False)
    k32 = KeyedJaggedTensor(kjt.keys(), kjt.values().int(), lengths=kjt.lengths().int())
    assert k32.lengths().dtype == torch.int32 and k32.offsets().dtype == torch.int32
    assert torch.equal(ebc(k32).values(), ebc(kjt).values())


def test_variable_batch_per_feature_matches_expanded_input() -> None:
    # f0 has 2 distinct bags, f1 has 3; inverse_indices maps a batch of 4 onto them
    cfgs = [EmbeddingBagConfig(num_embeddings=6, embedding_dim=2, name="t", feature_names=["f0", "f1"], pooling="mean")]
    ebc = EmbeddingBagCollection(cfgs)
    vbe = KeyedJaggedTensor(
        ["f0", "f1"],
        torch.tensor([1, 2, 3, 4, 5, 0]),
        lengths=torch.tensor([2, 1, 1, 0, 2]),
        stride_per_key_per_rank=[[2], [3]],
        inverse_indices=(["f0", "f1"], torch.tensor([[0, 1, 1, 0], [2, 0, 1, 2]])),
    )
    assert vbe.variable_stride_per_key() and vbe.stride_per_key() == [2, 3] and vbe.stride() == 3
    full = KeyedJaggedTensor(
        ["f0", "f1"], torch.tensor([1, 2, 3, 3, 1, 2, 5, 0, 4, 5, 0]), lengths=torch.tensor([2, 1, 1, 2, 2, 1, 0, 2])
    )
    assert torch.allclose(ebc(vbe).values(), ebc(full).values())
    no_inv = KeyedJaggedTensor(["f0", "f1"], vbe.values(), lengths=vbe.lengths(), stride_per_key_per_rank=[[2], [3]])
    with pytest.raises(ValueError, match="no inverse_indices"):
        ebc(no_inv)


def test_device_and_reset_parameters() -> None:
    ebc = EmbeddingBagCollection(_small_configs())
    assert ebc.device == torch.device("cpu")
    before = [p.detach().clone() for p in ebc.parameters()]
    ebc.reset_parameters()
    assert all(not torch.equal(a, b) for a, b in zip(before, ebc.parameters()))


def test_forward_on_meta_device_gives_shapes() -> None:
    ebc = EmbeddingBagCollection(_small_configs(), device="meta")
    kjt = _small_kjt(weights=False)
    meta = KeyedJaggedTensor(kjt.keys(), kjt.values().to("meta"), lengths=kjt.lengths().to("meta"))
    out = ebc(meta)
    assert out.values().device.type == "meta" and out.values().shape == (3, 11)
    assert out.keys() == ["f0", "f1", "f2"]


def test_entries_past_the_last_bag_are_not_looked_up() -> None:
    # TorchRec accepts a KJT whose values / weights run past the last bag; those entries belong to no bag
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=4, feature_names=["a", "b"])],
        is_weighted=True,
    )
    ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name="t", num_embeddings=10, embedding_dim=4, feature_names=["a", "b"])]
    )
    lengths = torch.tensor([1, 2, 0, 1])
    values = torch.tensor([1, 2, 3, 4])
    weights = torch.tensor([0.5, 1.0, 2.0, 3.0])
    ref = KeyedJaggedTensor(["b", "a"], values, weights=weights, lengths=lengths)
    # 99 is out of range for the table: looked up, it would raise
    padded = KeyedJaggedTensor(
        ["b", "a"],
        torch.cat([values, torch.tensor([99, 99])]),
        weights=torch.cat([weights, torch.ones(5)]),
        lengths=lengths,
    )
    assert torch.equal(ebc(padded).values(), ebc(ref).values())
    got, want = ec(padded), ec(ref)
    for k in want:
        assert torch.equal(got[k].values(), want[k].values()) and torch.equal(got[k].lengths(), want[k].lengths())
