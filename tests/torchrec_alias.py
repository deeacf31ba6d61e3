"""Make ``import torchrec...`` resolve to lightning_rec, to run TorchRec's own tests against this project.

``install()`` registers alias modules in ``sys.modules``. A name lightning_rec has no counterpart for
resolves to a placeholder class that raises ``NotImplementedError`` when used, so a TorchRec test file
still collects and only the tests that need the missing name fail (each with a message naming it).
Used by ``benchmarks/run_torchrec_tests.py``; not part of ``make test``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import types
import unittest
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.fx

from lightning_rec.sparse import KeyedTensor, kt_regroup_arguments

# torchrec module -> lightning_rec modules searched in order for each attribute
_SOURCES: dict[str, list[str]] = {
    "torchrec": ["lightning_rec"],
    "torchrec.sparse": [],
    "torchrec.sparse.jagged_tensor": ["lightning_rec.sparse"],
    "torchrec.modules": [],
    "torchrec.modules.embedding_configs": ["lightning_rec.configs", "lightning_rec.quant"],
    "torchrec.modules.embedding_modules": ["lightning_rec.embedding_modules"],
    "torchrec.modules.mlp": ["lightning_rec.nn"],
    "torchrec.modules.crossnet": ["lightning_rec.nn"],
    "torchrec.modules.deepfm": ["lightning_rec.nn"],
    "torchrec.modules.activation": ["lightning_rec.nn"],
    "torchrec.modules.feature_processor": ["lightning_rec.nn"],
    "torchrec.models": [],
    "torchrec.models.dlrm": ["lightning_rec.models.dlrm", "lightning_rec.nn"],
    "torchrec.models.deepfm": ["lightning_rec.models.deepfm"],
    "torchrec.datasets": ["lightning_rec.data"],
    "torchrec.datasets.utils": ["lightning_rec.data"],
    "torchrec.datasets.random": ["lightning_rec.data"],
    "torchrec.datasets.criteo": ["lightning_rec.data"],
    "torchrec.distributed": ["lightning_rec.distributed", "lightning_rec.sharding"],
    "torchrec.distributed.types": ["lightning_rec.sharding", "lightning_rec.distributed", "lightning_rec.configs"],
    "torchrec.distributed.sharding_plan": [
        "lightning_rec.sharding",
        "lightning_rec.plans.plan",
        "lightning_rec.distributed",
    ],
    "torchrec.distributed.planner": ["lightning_rec.sharding"],
    "torchrec.distributed.model_parallel": ["lightning_rec.distributed"],
    "torchrec.distributed.embeddingbag": ["lightning_rec.distributed"],
    "torchrec.distributed.embedding": ["lightning_rec.distributed"],
    "torchrec.distributed.train_pipeline": ["lightning_rec.distributed"],
    "torchrec.distributed.comm": [],
    "torchrec.distributed.quant_embedding": [],
    "torchrec.distributed.test_utils": [],
    "torchrec.distributed.test_utils.test_input": [],
    "torchrec.distributed.test_utils.multi_process": [],
    "torchrec.distributed.test_utils.test_sharding": [],
    "torchrec.modules.fp_embedding_modules": ["lightning_rec.nn", "lightning_rec.embedding_modules"],
    "torchrec.modules.fused_embedding_modules": [],
    "torchrec.modules.mc_embedding_modules": ["lightning_rec.mc"],
    "torchrec.modules.mc_modules": ["lightning_rec.mc"],
    # quantized serving: the quantized collections (TorchRec's EmbeddingBagCollection / EmbeddingCollection of
    # torchrec.quant are lightning_rec.quant's), QuantManagedCollision*, QuantConfig, quantize_embeddings
    "torchrec.quant": ["lightning_rec.quant"],
    "torchrec.quant.embedding_modules": ["lightning_rec.quant"],
    "torchrec.inference": [],
    "torchrec.inference.modules": ["lightning_rec.quant"],
    "torchrec.types": ["lightning_rec.configs"],
    "torchrec.optim": ["lightning_rec.distributed"],
    "torchrec.optim.keyed": ["lightning_rec.distributed"],
    "torchrec.optim.optimizers": ["lightning_rec.distributed"],
    "torchrec.ir": [],
    "torchrec.ir.serializer": [],
    "torchrec.ir.utils": [],
    "torchrec.fx": [],
    "torchrec.test_utils": [],
    "torchrec.sparse.tests": [],
}


def _missing(qualname: str) -> type:
    def _fail(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"lightning_rec has no counterpart of {qualname}")

    return type(qualname.rsplit(".", 1)[-1], (), {"__init__": _fail, "__call__": _fail})


def _skip_if_asan_class(cls: Any) -> Any:
    return cls


def _skip_if_asan(func: Callable) -> Callable:
    return func


_EXTRA: dict[str, dict[str, Any]] = {
    # TorchRec's several implementations of KeyedTensor.regroup (fbgemm ops, fused permutes), one here
    "torchrec.sparse.jagged_tensor": {
        **dict.fromkeys(
            ("regroup_kts", "_regroup_keyed_tensors", "permute_multi_embedding", "_fbgemm_permute_pooled_embs"),
            KeyedTensor.regroup,
        ),
        "_kt_regroup_arguments": kt_regroup_arguments,
    },
    "torchrec.fx": {"symbolic_trace": torch.fx.symbolic_trace, "Tracer": torch.fx.Tracer},
    "torchrec.test_utils": {"skip_if_asan_class": _skip_if_asan_class, "skip_if_asan": _skip_if_asan},
}


def _make_module(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = []  # a package, so submodules import
    sources = _SOURCES[name]
    extra = _EXTRA.get(name, {})

    def __getattr__(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr in extra:
            return extra[attr]
        for src in sources:
            try:
                m = importlib.import_module(src)
            except ImportError:
                continue
            if hasattr(m, attr):
                return getattr(m, attr)
        return _missing(f"{name}.{attr}")

    mod.__getattr__ = __getattr__  # type: ignore[method-assign]
    return mod


def _parameterized_shim() -> types.ModuleType:
    """The part of the ``parameterized`` package TorchRec's tests use, when it is not installed."""

    class parameterized:
        @staticmethod
        def expand(cases: list) -> Callable:
            frame = inspect.currentframe()
            assert frame is not None and frame.f_back is not None
            namespace = frame.f_back.f_locals

            def deco(fn: Callable) -> None:
                for i, case in enumerate(cases):
                    args = case if isinstance(case, tuple) else (case,)

                    def test(self: unittest.TestCase, _args: tuple = args) -> Any:
                        return fn(self, *_args)

                    namespace[f"{fn.__name__}_{i}"] = test
                return None

            return deco

    mod = types.ModuleType("parameterized")
    mod.parameterized = parameterized  # type: ignore[attr-defined]
    return mod


def install(extra_files: dict[str, Path] | None = None) -> None:
    """Register the alias modules; ``extra_files`` maps torchrec module names to source files to load as-is
    (TorchRec's test helpers such as ``torchrec.sparse.tests.utils``)."""
    for name in _SOURCES:
        sys.modules.setdefault(name, _make_module(name))
    # importing TorchRec's jagged_tensor loads fbgemm's sparse ops, and its tests call some of them directly
    # (torch.ops.fbgemm.permute_multi_embedding, kt_regroup_arguments, regroup_keyed_tensor)
    if importlib.util.find_spec("fbgemm_gpu") is not None:
        importlib.import_module("fbgemm_gpu")
    if importlib.util.find_spec("parameterized") is None:
        sys.modules["parameterized"] = _parameterized_shim()
    for name, path in (extra_files or {}).items():
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
