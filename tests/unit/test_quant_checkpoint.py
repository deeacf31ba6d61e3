"""A checkpoint directory to a quantized model in one process: ``load_quantized`` and ``lightning-rec export``.
(The directory written by 2 sharded processes: tests/distributed/test_quant_checkpoint.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, checkpoint, load_quantized, quantize_embeddings
from lightning_rec.cli import main
from lightning_rec.quant import EmbeddingBagCollection as QuantEBC
from tests.lightning.models import TABLES, ClickModule, Clicks, collate

# one process saving a directory: DCP's notice that no process group exists is the intent here
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _trained(seed: int = 1) -> ClickModule:
    model = ClickModule()
    torch.manual_seed(seed)  # weights unlike a fresh ClickModule's
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


def _batch():
    return collate([Clicks(8)[i] for i in range(8)])[0]


def test_load_quantized_equals_quantizing_the_saved_model(tmp_path: Path) -> None:
    trained = _trained()
    checkpoint.save(tmp_path / "ckpt", trained)
    want = quantize_embeddings(trained, torch.quint4x2, inplace=False, per_table_weight_dtype={"geo": torch.qint8})
    for model in (ClickModule(), ClickModule):  # an instance, or the class built from the saved hyper-parameters
        got = load_quantized(tmp_path / "ckpt", model, torch.quint4x2, per_table_weight_dtype={"geo": torch.qint8})
        assert isinstance(got.ebc, QuantEBC) and not got.training
        assert got.state_dict().keys() == want.state_dict().keys()
        for k, v in want.state_dict().items():
            assert torch.equal(got.state_dict()[k], v) if torch.is_tensor(v) else got.state_dict()[k] == v, k
        assert torch.equal(got(_batch()), want(_batch()))


def test_a_checkpoint_of_another_model_names_the_tables(tmp_path: Path) -> None:
    checkpoint.save(tmp_path / "ckpt", _trained())
    other = ClickModule()
    other.ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(name="user", num_embeddings=12, embedding_dim=4, feature_names=["user_id"]),
            TABLES[1],
            EmbeddingBagConfig(name="country", num_embeddings=5, embedding_dim=4, feature_names=["geo"]),
        ]
    )
    with pytest.raises(ValueError, match="not written by this model") as e:
        load_quantized(tmp_path / "ckpt", other, torch.qint8)
    msg = str(e.value)
    assert "tables only in the checkpoint: ['geo']" in msg and "tables only in the model: ['country']" in msg
    assert "table 'user' is [11, 4] in the checkpoint but [12, 4] in the model" in msg
    with pytest.raises(FileNotFoundError, match="not a checkpoint directory"):
        load_quantized(tmp_path / "nothing", ClickModule(), torch.qint8)
    with pytest.raises(ValueError, match=r"cannot store embeddings as 'int3'"):
        load_quantized(tmp_path / "ckpt", ClickModule(), "int3")


def test_cli_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trained = _trained()
    checkpoint.save(tmp_path / "ckpt", trained)
    out = tmp_path / "model.pt"
    model = "tests.lightning.models:ClickModule"
    args = ["export", str(tmp_path / "ckpt"), "--model", model, "--quantize", "int4", "--table-dtype", "geo=fp16"]
    assert main([*args, "-o", str(out)]) == 0
    assert "tables {'FP16': 1, 'INT4': 2}" in capsys.readouterr().out
    served = quantize_embeddings(ClickModule(), torch.quint4x2, per_table_weight_dtype={"geo": torch.float16})
    served.load_state_dict(torch.load(out, weights_only=True))
    want = quantize_embeddings(trained, torch.quint4x2, False, per_table_weight_dtype={"geo": torch.float16})
    assert torch.equal(served(_batch()), want(_batch()))
    # without --quantize: the float state_dict
    assert main(["export", str(tmp_path / "ckpt"), "--model", model, "-o", str(tmp_path / "float.pt")]) == 0
    saved = torch.load(tmp_path / "float.pt", weights_only=True)
    assert torch.equal(saved["ebc.embedding_bags.user.weight"], trained.ebc.embedding_bags["user"].weight)
    # errors: one line naming what is wrong, exit code 2
    assert main([*args[:-1], "geo=int3", "-o", str(out)]) == 2
    assert "--table-dtype 'geo=int3': expected TABLE=TYPE" in capsys.readouterr().err
    assert main([*args[:3], "tests.lightning.models:Nope", "-o", str(out)]) == 2
    assert "--model tests.lightning.models:Nope: cannot import it" in capsys.readouterr().err
    assert main([*args[:5], "int2", "--table-dtype", "nope=fp16", "-o", str(out)]) == 2
    assert "per_table_weight_dtype names tables ['nope']" in capsys.readouterr().err
