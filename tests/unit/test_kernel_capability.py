"""Which kernel runs, and what happens where the installed fbgemm build lacks an op for the device.

A CPU-only fbgemm build next to a CUDA torch registers fbgemm's ops without CUDA kernels. The dense lookup
must then fall back to the torch kernel after one warning; a fused optimizer (no torch fallback) must raise
one sentence naming the package to install. Both are checked here on CPU: with the real dispatcher query
(CUDA ops are absent from the CPU build), and by simulating a missing op on CPU with a patched probe.
"""

from __future__ import annotations

import re
import types
import warnings

import pytest
import torch

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, _compat, kernels
from lightning_rec.fused_kinds import CPU_KINDS, FBGEMM_CPU_KINDS, FUSED_KINDS, KINDS, PER_ROW, FusedOptimizerSpec
from lightning_rec.kernels import _capability
from tests.fbgemm_marks import needs_fbgemm

CPU_BUILD = (_compat.fbgemm_distribution() or ("", ""))[0].endswith("-cpu")
HINT = _compat.fbgemm_install_hint(torch.__version__, "cuda")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(_capability, "_warned", set())


def _missing_on(monkeypatch, device_type: str) -> list[tuple[str, str]]:
    """Simulate an fbgemm build without kernels for ``device_type``; return the probe's calls."""
    calls: list[tuple[str, str]] = []

    def probe(op: str, dev: str) -> bool:
        calls.append((op, dev))
        return dev != device_type

    monkeypatch.setattr(_capability, "has_fbgemm_op", probe)
    return calls


def _fake_tables(device: str, n: int = 2, dtype=torch.float32) -> list:
    # resolve_kernel reads only .dtype and .device: a CUDA "table" needs no GPU
    return [types.SimpleNamespace(dtype=dtype, device=torch.device(device)) for _ in range(n)]


def _ebc(kernel: str) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    return EmbeddingBagCollection(
        [
            EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="a", feature_names=["f0", "f1"]),
            EmbeddingBagConfig(num_embeddings=7, embedding_dim=8, name="b", feature_names=["f2"], pooling="mean"),
        ],
        kernel=kernel,
    )


def _kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(
        ["f0", "f1", "f2"], torch.tensor([1, 2, 9, 0, 3, 3, 5, 0, 6, 1]), torch.tensor([2, 1, 0, 1, 2, 0, 1, 3, 0])
    )


# -- the kind table -----------------------------------------------------------------------------------------


def test_kind_table_matches_the_kernel_state():
    assert tuple(FUSED_KINDS) == KINDS and CPU_KINDS == KINDS
    assert set(FBGEMM_CPU_KINDS) == {"sgd", "adagrad", "rowwise_adagrad"}
    for kind in CPU_KINDS:
        k = kernels.FusedPooledKernel([("t", 5, 8, torch.float32)], [0], FusedOptimizerSpec(kind, lr=0.1))
        shapes = {n: tuple(s.shape) for n, s in k.optimizer_states()["t"].items()}
        assert shapes == FUSED_KINDS[kind].state_shapes(5, 8)
    assert FUSED_KINDS["partial_rowwise_adam"].state_shapes(5, 8) == {"exp_avg": (5, 8), "exp_avg_sq": (5,)}
    assert (FUSED_KINDS["rowwise_adagrad"].state_per_value, FUSED_KINDS["rowwise_adagrad"].state_per_row) == (0, 1)
    assert FUSED_KINDS["adam"].state_per_value == 2 and FUSED_KINDS["lamb"].adam_family
    assert dict(FUSED_KINDS["rowwise_adagrad"].states)["sum"] == PER_ROW


def test_optim_reexports_the_low_layer_names():
    from lightning_rec import fused_kinds, optim

    assert optim.FusedOptimizerSpec is fused_kinds.FusedOptimizerSpec and optim.as_spec is fused_kinds.as_spec
    assert optim.CPU_KINDS == fused_kinds.CPU_KINDS and optim.KINDS == fused_kinds.KINDS


# -- the real dispatcher query ------------------------------------------------------------------------------


@needs_fbgemm
def test_probe_answers_from_the_dispatcher_and_caches():
    assert kernels.has_fbgemm_op(kernels.DENSE_LOOKUP_OP, "cpu")
    assert not kernels.has_fbgemm_op("fbgemm::no_such_op", "cpu")
    assert not kernels.has_fbgemm_op(kernels.DENSE_LOOKUP_OP, "mps")
    before = kernels.has_fbgemm_op.cache_info().hits
    kernels.has_fbgemm_op(kernels.DENSE_LOOKUP_OP, "cpu")
    assert kernels.has_fbgemm_op.cache_info().hits == before + 1


@pytest.mark.skipif(not CPU_BUILD, reason="the installed fbgemm is a CUDA build")
def test_cpu_build_on_cuda_falls_back_once_with_the_package_named(fresh_warnings):
    assert not kernels.has_fbgemm_op(kernels.DENSE_LOOKUP_OP, "cuda")
    for requested in ("auto", "fbgemm"):
        _capability._warned.clear()
        with pytest.warns(RuntimeWarning, match=re.escape(f"kernel={requested!r}: using the torch kernel")) as rec:
            assert kernels.resolve_kernel(requested, _fake_tables("cuda:0"), False) == "torch"
        assert len(rec) == 1
    _capability._warned.clear()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(3):
            assert kernels.resolve_kernel("auto", _fake_tables("cuda:0"), False) == "torch"
    msgs = [str(w.message) for w in rec]
    assert len(msgs) == 1, msgs
    assert kernels.DENSE_LOOKUP_OP in msgs[0] and HINT in msgs[0] and "using the torch kernel" in msgs[0]


@pytest.mark.skipif(not CPU_BUILD, reason="the installed fbgemm is a CUDA build")
@pytest.mark.parametrize("kind", KINDS)
def test_cpu_build_refuses_fused_on_cuda_with_one_sentence(kind):
    spec = FusedOptimizerSpec(kind, lr=0.1)
    msg = (
        f"fused optimizer {kind!r} cannot run on cuda:0: the installed {'=='.join(_compat.fbgemm_distribution())} "
        f"has no cuda kernel for fbgemm::get_infos_metadata; install the CUDA build that matches torch "
        f"{torch.__version__}: {HINT}"
    )
    with pytest.raises(RuntimeError, match=re.escape(msg)) as err:
        kernels.FusedPooledKernel([("t", 4, 4, torch.float32)], [0], spec, device="cuda:0")
    assert "NotImplementedError" not in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(RuntimeError, match=re.escape(msg)):
        kernels.check_fused_available(spec, "cuda:0")


# -- simulated missing ops on CPU ---------------------------------------------------------------------------


def test_simulated_missing_dense_op_falls_back_to_torch_with_one_warning(monkeypatch, fresh_warnings):
    calls = _missing_on(monkeypatch, "cpu")
    ref = _ebc("torch")
    ebc = _ebc("fbgemm")
    kjt = _kjt()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        outs = [ebc(kjt).values() for _ in range(3)]
    msgs = [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1, msgs
    assert "kernel='fbgemm': using the torch kernel on cpu because the installed" in msgs[0]
    assert "fbgemm-gpu-cpu==" in msgs[0] and kernels.DENSE_LOOKUP_OP in msgs[0]
    assert ebc._fbgemm is None  # the fbgemm kernel was never built
    want = ref(kjt).values()
    for out in outs:
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    # gradients flow to the tables through the fallback, as through the torch kernel
    outs[0].sum().backward()
    ref(kjt).values().sum().backward()
    for name in ("a", "b"):
        torch.testing.assert_close(ebc.embedding_bags[name].weight.grad, ref.embedding_bags[name].weight.grad)
    assert calls and all(op == kernels.DENSE_LOOKUP_OP for op, _ in calls)


def test_auto_on_cpu_never_asks_for_fbgemm(monkeypatch, fresh_warnings):
    calls = _missing_on(monkeypatch, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.resolve_kernel("auto", _fake_tables("cpu"), False) == "torch"
    assert calls == []


def test_available_op_keeps_fbgemm(monkeypatch, fresh_warnings):
    _missing_on(monkeypatch, "none")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.resolve_kernel("fbgemm", _fake_tables("cpu"), False) == "fbgemm"
        assert kernels.resolve_kernel("auto", _fake_tables("cuda:0"), False) == "fbgemm"
        assert kernels.resolve_kernel("torch", _fake_tables("cuda:0"), False) == "torch"


def test_tables_fbgemm_cannot_serve_still_raise_for_explicit_fbgemm(monkeypatch, fresh_warnings):
    _missing_on(monkeypatch, "none")
    with pytest.raises(ValueError, match="kernel='fbgemm' cannot be used: fbgemm has no torch.bfloat16 kernel"):
        kernels.resolve_kernel("fbgemm", _fake_tables("cpu", dtype=torch.bfloat16), False)
    with pytest.raises(ValueError, match="kernel='fbgemm' cannot be used: sparse_grad=True"):
        kernels.resolve_kernel("fbgemm", _fake_tables("cpu"), True)
    assert kernels.resolve_kernel("auto", _fake_tables("cuda:0", dtype=torch.bfloat16), False) == "torch"
    with pytest.raises(ValueError, match=re.escape("kernel must be one of ('auto', 'fbgemm', 'torch'), got 'cuda'")):
        kernels.resolve_kernel("cuda", _fake_tables("cpu"), False)


def test_simulated_missing_fused_op_raises_naming_the_package(monkeypatch):
    calls = _missing_on(monkeypatch, "cpu")
    spec = FusedOptimizerSpec("rowwise_adagrad", lr=0.1)
    with pytest.raises(RuntimeError) as err:
        kernels.FusedPooledKernel([("t", 4, 4, torch.float32)], [0], spec)
    msg = str(err.value)
    assert msg.startswith("fused optimizer 'rowwise_adagrad' cannot run on cpu: the installed ")
    assert "fbgemm::split_embedding_codegen_forward_cpu" in msg
    assert _compat.fbgemm_install_hint(torch.__version__, "cpu") in msg
    # the kinds fbgemm has no CPU kernel for run in torch: no fbgemm op is asked for
    asked = len(calls)
    kernels.FusedPooledKernel([("t", 4, 4, torch.float32)], [0], FusedOptimizerSpec("adam", lr=0.1))
    assert len(calls) == asked


# -- on a GPU -----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kernel", ["auto", "fbgemm"])
def test_cuda_lookup_matches_the_cpu_reference(kernel, fresh_warnings):
    ref = _ebc("torch")
    ebc = _ebc(kernel).to("cuda")
    kjt = _kjt()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        out = ebc(kjt.to(torch.device("cuda"))).values()
    torch.testing.assert_close(out.cpu(), ref(kjt).values(), rtol=1e-5, atol=1e-5)
    out.sum().backward()
    ref(kjt).values().sum().backward()
    for name in ("a", "b"):
        torch.testing.assert_close(
            ebc.embedding_bags[name].weight.grad.cpu(), ref.embedding_bags[name].weight.grad, rtol=1e-5, atol=1e-5
        )


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad"])
def test_cuda_fused_kernel_matches_cpu_or_names_the_package(kind):
    spec = FusedOptimizerSpec(kind, lr=0.1)
    tables = [("a", 6, 4, torch.float32), ("b", 5, 8, torch.float32)]
    weights = [torch.randn(6, 4), torch.randn(5, 8)]
    if not kernels.has_fbgemm_op("fbgemm::get_infos_metadata", "cuda"):
        with pytest.raises(RuntimeError, match=re.escape(HINT)):
            kernels.FusedPooledKernel(tables, [0, 1], spec, device="cuda")
        return
    gpu = kernels.FusedPooledKernel(tables, [0, 1], spec, device="cuda", weights=weights)
    cpu = kernels.FusedPooledKernel(tables, [0, 1], spec, weights=weights)
    values, offsets = torch.tensor([1, 2, 5, 0, 4, 4]), torch.tensor([0, 2, 3, 5, 6])
    for k in (gpu, cpu):
        out = k(values.to(k.device), offsets.to(k.device))
        out.sum().backward()
        k.finish_step()
    for g, c in zip(gpu.tables(), cpu.tables()):
        torch.testing.assert_close(g.cpu(), c, rtol=1e-5, atol=1e-5)


# -- layering ------------------------------------------------------------------------------------------------


def _lightning_rec_imports(path) -> set[str]:
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "lightning_rec":  # from lightning_rec import x
            found.update(f"lightning_rec.{a.name}" for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_rec"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("lightning_rec"))
    return found


def test_kernels_and_fused_kinds_import_nothing_above_them():
    from pathlib import Path

    import lightning_rec

    root = Path(lightning_rec.__file__).parent
    assert _lightning_rec_imports(root / "fused_kinds.py") == set()
    allowed = {
        "lightning_rec._compat",
        "lightning_rec.fused_kinds",
        "lightning_rec.memory",
    }
    for path in sorted((root / "kernels").glob("*.py")):
        imports = {m for m in _lightning_rec_imports(path) if not m.startswith("lightning_rec.kernels")}
        assert imports <= allowed, f"{path.name} imports {sorted(imports - allowed)}"
        assert len(path.read_text().splitlines()) < 500, path.name
