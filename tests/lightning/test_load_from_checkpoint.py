"""``RecModule.load_from_checkpoint`` on the directories rec_sharded writes: one process, no process group."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_rec import RecShardedStrategy, ShardingPlan, data_parallel, full_state_dict, row_wise, table_wise
from lightning_rec import checkpoint as ckpt
from lightning_rec.testing import run_distributed
from tests.lightning.models import ClickModule, Clicks, collate
from tests.lightning.test_checkpoint_safety import Payload

MIXED = ShardingPlan({"ebc": {"user": row_wise(), "item": table_wise(rank=1), "geo": data_parallel()}})


@dataclass
class Note:
    """A hyper-parameter of a type no checkpoint allowlist knows."""

    text: str


class _Saved(ClickModule):
    """A ClickModule whose hyper-parameters Lightning saves (the plan is a run setting, not one of them)."""

    def __init__(self, batch_size: int = 4, lr: float = 0.2, plan=None, width: int = 1) -> None:
        super().__init__(batch_size=batch_size, lr=lr, plan=plan)
        self.save_hyperparameters(ignore=["plan"])
        self.head = torch.nn.Linear(self.head.in_features, width)  # the saved width must be the one built

    def forward(self, kjt):
        return self.head(self.ebc(kjt).values()).sum(1)


def _batch():
    return next(iter(DataLoader(Clicks(16), batch_size=8, collate_fn=collate)))[0]


def _fit_job(rank: int, ws: int, out: str, fused: bool) -> dict:
    model = _Saved(batch_size=2, lr=0.3, plan=MIXED, width=2)
    spec = {"kind": "rowwise_adagrad", "lr": 0.05} if fused else None
    mc = ModelCheckpoint(dirpath=out, save_last=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=ws,
        strategy=RecShardedStrategy(embedding_optimizer=spec),
        max_epochs=1,
        limit_train_batches=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[mc],
    )
    trainer.fit(model)
    state = full_state_dict(model)
    model.eval()
    with torch.no_grad():
        preds = model(_batch())  # every rank looks up the same batch
    return {"path": mc.last_model_path, "state": state, "preds": preds, "fused": model.fused_optimizer() is not None}


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "fused-rowwise-adagrad"])
def trained(request, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ckpt")
    res = run_distributed(_fit_job, 2, str(out), request.param, init_process_group=False, timeout_s=300)[0]
    assert Path(res["path"]).is_dir() and ckpt.is_checkpoint_dir(res["path"])
    assert res["fused"] == request.param
    return res


def test_directory_loads_into_one_process(trained: dict) -> None:
    assert not torch.distributed.is_initialized()
    model = _Saved.load_from_checkpoint(trained["path"])
    assert isinstance(model, _Saved)
    assert (model.batch_size, model.lr, model.head.out_features) == (2, 0.3, 2)  # built from the saved hparams
    assert dict(model.hparams) == {"batch_size": 2, "lr": 0.3, "width": 2}
    got = model.state_dict()
    assert set(got) == set(trained["state"])
    for k, v in trained["state"].items():
        assert torch.equal(got[k], v), k
    model.eval()
    with torch.no_grad():
        preds = model(_batch())
    torch.testing.assert_close(preds, trained["preds"], atol=1e-6, rtol=0)


def test_overrides_and_hooks(trained: dict, tmp_path) -> None:
    seen = {}

    class Hooked(_Saved):
        def on_load_checkpoint(self, checkpoint):
            seen.update(keys=set(checkpoint), state=set(checkpoint["state_dict"]))

    model = Hooked.load_from_checkpoint(trained["path"], lr=0.7)
    assert model.lr == 0.7 and model.hparams.lr == 0.7 and model.batch_size == 2
    assert {"state_dict", "hyper_parameters", "global_step", "rec_sharding"} <= seen["keys"]
    assert seen["state"] == set(trained["state"])
    hparams = tmp_path / "h.yaml"
    hparams.write_text("batch_size: 3\nwidth: 2\n")
    model = _Saved.load_from_checkpoint(trained["path"], hparams_file=hparams)
    assert (model.batch_size, model.lr) == (3, 0.2)
    with pytest.raises(RuntimeError, match="size mismatch for head.weight"):
        _Saved.load_from_checkpoint(trained["path"], width=1)
    model = _Saved.load_from_checkpoint(trained["path"], map_location=torch.device("cpu"))
    assert next(model.parameters()).device.type == "cpu"


def _plant(src: str, dst: str, value: object) -> None:
    """``dst``'s meta: ``src``'s with ``value`` among the hyper-parameters."""
    meta = ckpt.read_meta(src)
    meta["hyper_parameters"]["note"] = value
    torch.save(meta, Path(dst) / ckpt.META_FILE)


class _Noted(_Saved):
    def __init__(self, batch_size: int = 4, lr: float = 0.2, plan=None, width: int = 1, note=None) -> None:
        super().__init__(batch_size=batch_size, lr=lr, plan=plan, width=width)
        self.note = note


def test_unsafe_directory_refused_unless_trusted(trained: dict, tmp_path) -> None:
    import shutil

    path = str(tmp_path / "c")
    shutil.copytree(trained["path"], path)
    marker = tmp_path / "marker"
    _plant(trained["path"], path, Payload(str(marker)))
    with pytest.raises(
        ckpt.UnsafeCheckpointError, match=r"builtins.exec.*load_from_checkpoint\(\.\.\., trusted_checkpoints=True\)"
    ):
        _Noted.load_from_checkpoint(path)
    assert not marker.exists(), "the payload ran"
    _plant(trained["path"], path, Note("hello"))
    with pytest.raises(ckpt.UnsafeCheckpointError, match=r"test_load_from_checkpoint\.Note"):
        _Noted.load_from_checkpoint(path)
    for trust in ({"trusted_checkpoints": True}, {"weights_only": False}):
        model = _Noted.load_from_checkpoint(path, **trust)
        assert model.note == Note("hello")
        assert all(torch.equal(model.state_dict()[k], v) for k, v in trained["state"].items())


def test_single_file_loads_as_lightning(tmp_path) -> None:
    model = _Saved(batch_size=5, width=3)
    path = tmp_path / "one.ckpt"
    checkpoint = {
        "state_dict": model.state_dict(),
        "hyper_parameters": dict(model.hparams),
        "pytorch-lightning_version": L.__version__,
    }
    torch.save(checkpoint, path)
    for loaded in (_Saved.load_from_checkpoint(path), L.LightningModule.load_from_checkpoint.__func__(_Saved, path)):
        assert (loaded.batch_size, loaded.head.out_features) == (5, 3)
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    checkpoint["hyper_parameters"]["note"] = Note("x")
    torch.save(checkpoint, path)
    with pytest.raises(Exception, match="weights_only"):  # torch's refusal, as under Lightning
        _Noted.load_from_checkpoint(path)
    assert _Noted.load_from_checkpoint(path, trusted_checkpoints=True).note == Note("x")


def test_plain_directory_is_named(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="not a checkpoint directory"):
        ClickModule.load_from_checkpoint(tmp_path)
    with pytest.raises(TypeError, match="cannot be called on an instance"):
        ClickModule().load_from_checkpoint(tmp_path)
