"""Specs per table: the strategy option's forms, what each table gets, and the errors that name the table."""

from __future__ import annotations

import pytest

from lightning_rec import EmbeddingBagConfig, PerTableOptimizers
from lightning_rec.fused_kinds import as_spec, as_table_optimizers, spec_of, summary
from lightning_rec.pipeline.fused_lookup import check_fused, table_specs

SGD = {"kind": "sgd", "lr": 0.1}
ROWWISE = {"kind": "rowwise_adagrad", "lr": 0.05}


def test_option_forms() -> None:
    assert as_table_optimizers(None) is None
    assert as_table_optimizers(SGD) == as_spec(SGD)
    per = as_table_optimizers({"default": SGD, "tables": {"big ids": ROWWISE, "x.y": None}})
    assert isinstance(per, PerTableOptimizers)
    # any string names a table; a table named in `tables` with None is an ordinary parameter
    assert spec_of(per, "big ids") == as_spec(ROWWISE)
    assert spec_of(per, "x.y") is None
    assert spec_of(per, "other") == as_spec(SGD)
    assert spec_of(as_spec(SGD), "anything") == as_spec(SGD)
    assert as_table_optimizers({"tables": {"t": ROWWISE}}).default is None  # type: ignore[union-attr]
    assert hash(per) == hash(as_table_optimizers({"default": SGD, "tables": {"x.y": None, "big ids": ROWWISE}}))


def test_option_errors_name_the_table() -> None:
    with pytest.raises(ValueError, match="unknown keys"):
        as_table_optimizers({"tables": {}, "defualt": SGD})
    with pytest.raises(ValueError, match=r"table 'big': unknown fused optimizer kind 'adamw'"):
        PerTableOptimizers(tables={"big": {"kind": "adamw", "lr": 0.1}})
    with pytest.raises(TypeError, match="table names are strings"):
        PerTableOptimizers(tables={3: SGD})  # type: ignore[dict-item]


def test_summary() -> None:
    one = {"a": {"t": as_spec(SGD), "u": as_spec(SGD)}, "b": {"v": None}}
    assert summary(one) == as_spec(SGD)
    two = {"a": {"t": as_spec(SGD), "u": as_spec(ROWWISE)}}
    assert summary(two) == PerTableOptimizers(tables={"t": SGD, "u": ROWWISE})
    assert summary({"a": {"t": None}}) is None and summary({}) is None


def test_collection_specs_all_or_none() -> None:
    tables = [
        EmbeddingBagConfig(name=n, num_embeddings=4, embedding_dim=4, feature_names=[f"f{n}"]) for n in ("a", "b")
    ]
    assert table_specs(SGD, tables) == [as_spec(SGD)] * 2
    assert table_specs({"a": SGD, "b": ROWWISE}, tables) == [as_spec(SGD), as_spec(ROWWISE)]
    assert table_specs(None, tables) == [None, None]
    with pytest.raises(ValueError, match=r"tables \['a'\] have a fused optimizer but \['b'\]"):
        table_specs({"a": SGD, "b": None}, tables)
    with pytest.raises(ValueError, match=r"names tables \['c'\]"):
        table_specs({"c": SGD}, tables)


def test_half_tables_with_a_torch_cpu_kind_are_refused_before_allocation() -> None:
    import torch

    t = EmbeddingBagConfig(name="big", num_embeddings=4, embedding_dim=8, feature_names=["f"], dtype=torch.float16)
    with pytest.raises(ValueError, match=r"table 'big': the fused 'adam' optimizer runs on CPU as a torch update"):
        check_fused([t], {"big": None}, [as_spec({"kind": "adam", "lr": 0.1})], torch.device("cpu"))
    check_fused([t], {"big": None}, [as_spec(SGD)], torch.device("cpu"))  # fbgemm's CPU kernel takes float16
