"""Loading a checkpoint never runs code from it (issue 19): every door refuses a planted pickle payload.

The payload is an object whose unpickling writes a marker file; each test asserts the load is refused with
UnsafeCheckpointError naming the file and the global, and that the marker does not exist. The opt-in
(trusted=True, trusted_checkpoints=True, --trust_checkpoint) does run it, which proves the payload is live.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_rec import RecShardedStrategy
from lightning_rec import checkpoint as ckpt
from lightning_rec.testing import run_distributed
from tests.lightning.models import ClickModule

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "v1_checkpoint"


class Payload:
    """Unpickles as a call of ``exec`` that creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def _plant_meta(path: Path, marker: Path) -> None:
    meta = torch.load(path / ckpt.META_FILE, weights_only=False)
    meta["hyper_parameters"] = {"lr": 0.1, "evil": Payload(str(marker))}
    torch.save(meta, path / ckpt.META_FILE)


def _plant_dcp(path: Path, marker: Path) -> None:
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)
    md.planner_data = {"evil": Payload(str(marker))}
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)


def _saved(tmp_path: Path, name: str = "c") -> Path:
    model = ClickModule()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    model(next(iter(_loader()))[0]).sum().backward()
    opt.step()
    return ckpt.save(tmp_path / name, model, [opt], extra={"hyper_parameters": {"lr": 0.1}})


def _loader():
    from torch.utils.data import DataLoader

    from tests.lightning.models import Clicks, collate

    return DataLoader(Clicks(16), batch_size=4, collate_fn=collate)


@pytest.mark.parametrize("where", ["meta", "dcp"])
def test_checkpoint_load_refuses_planted_payload(tmp_path, where: str) -> None:
    path, marker = _saved(tmp_path), tmp_path / "marker"
    (_plant_meta if where == "meta" else _plant_dcp)(path, marker)
    refused = path / (ckpt.META_FILE if where == "meta" else ".metadata")
    model = ClickModule()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ckpt.UnsafeCheckpointError, match=r"refused to load .*builtins\.exec.*trusted=True") as e:
        ckpt.load(path, model, [torch.optim.Adagrad(model.parameters(), lr=0.1)])
    assert e.value.path == str(refused) and e.value.refused == "builtins.exec"
    assert isinstance(e.value, Exception)
    assert not marker.exists(), "the payload ran"
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "a refused load changed the model"
    if where == "meta":
        with pytest.raises(ckpt.UnsafeCheckpointError):
            ckpt.read_meta(path)
        assert not marker.exists()
    # the opt-in runs it: the test's payload is live
    ckpt.load(path, ClickModule(), trusted=True)
    assert marker.exists()


def test_ordinary_checkpoint_loads_safely_and_exactly(tmp_path) -> None:
    path = _saved(tmp_path)
    src = torch.load  # every torch.load in a safe load is weights_only
    calls = []

    def spy(*a, **kw):
        calls.append(kw.get("weights_only"))
        return src(*a, **kw)

    torch.load = spy
    try:
        model = ClickModule()
        opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
        meta = ckpt.load(path, model, [opt])
    finally:
        torch.load = src
    assert calls and all(c is True for c in calls), calls
    assert meta["hyper_parameters"] == {"lr": 0.1}
    want = ClickModule()
    want_opt = torch.optim.Adagrad(want.parameters(), lr=0.1)
    want(next(iter(_loader()))[0]).sum().backward()
    want_opt.step()
    for k, v in want.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    for i, st in want_opt.state_dict()["state"].items():
        assert torch.equal(opt.state_dict()["state"][i]["sum"], st["sum"])


class _Fit(ClickModule):
    def __init__(self) -> None:
        super().__init__(batch_size=4)

    def train_dataloader(self):
        return _loader()


def _fit(path: str, trusted: bool) -> str:
    strategy = RecShardedStrategy(trusted_checkpoints=trusted)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_train_batches=1,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    try:
        trainer.fit(_Fit(), ckpt_path=path)
    except ckpt.UnsafeCheckpointError as e:
        return f"refused: {e}"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


def _strategy_job(rank: int, ws: int, cases: list[tuple[str, str]]) -> list[tuple[str, bool, str, bool]]:
    """For each (checkpoint, marker): the untrusted fit, whether the marker exists, the trusted fit, again."""
    out = []
    for path, marker in cases:
        refused = _fit(path, False)
        ran_untrusted = Path(marker).exists()
        trusted = _fit(path, True)
        out.append((refused, ran_untrusted, trusted, Path(marker).exists()))
    return out


def test_strategy_refuses_planted_payload(tmp_path) -> None:
    cases = []
    for where in ("meta", "dcp", "single-file"):
        marker = tmp_path / f"marker-{where}"
        if where == "single-file":
            path = tmp_path / "one.ckpt"
            torch.save({"state_dict": ClickModule().state_dict(), "evil": Payload(str(marker))}, path)
        else:
            path = _saved(tmp_path, where)
            (_plant_meta if where == "meta" else _plant_dcp)(path, marker)
        cases.append((str(path), str(marker)))
    (results,) = run_distributed(_strategy_job, 1, cases, init_process_group=False, timeout_s=180)
    for (path, _), (refused, ran_untrusted, trusted, ran_trusted) in zip(cases, results):
        assert refused.startswith("refused:") and "builtins.exec" in refused, (path, refused)
        assert "trusted_checkpoints" in refused, refused
        assert not ran_untrusted, f"the payload in {path} ran"
        assert ran_trusted, (path, trusted)  # the opt-in unpickles it: the payload is live


_TINY = """
trainer:
  devices: 1
  default_root_dir: {root}
  logger: false
  max_steps: 1
  limit_val_batches: 0
  enable_checkpointing: false
  callbacks: []
model:
  embedding_dim: 8
  dense_arch_layer_sizes: [8, 8]
  over_arch_layer_sizes: [8, 1]
data:
  batch_size: 64
  train_rows: 256
  val_rows: 64
  size: 0.0001
"""


def _cli_job(rank: int, ws: int, config: str, ckpt_path: str, marker: str) -> list[tuple[str, bool]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import dlrm

    out = []
    for trust in (False, True):
        try:
            dlrm.main(["--config", config, "--ckpt_path", ckpt_path, "--trust_checkpoint", str(trust).lower()])
            res = "loaded"
        except ckpt.UnsafeCheckpointError as e:
            res = f"refused: {e}"
        except Exception as e:
            res = f"{type(e).__name__}: {e}"
        out.append((res, Path(marker).exists()))
    return out


def test_main_job_refuses_planted_payload(tmp_path) -> None:
    path, marker = _saved(tmp_path), tmp_path / "marker"
    _plant_meta(path, marker)
    config = tmp_path / "tiny.yaml"
    config.write_text(_TINY.format(root=tmp_path))
    (((refused, ran_untrusted), (trusted, ran_trusted)),) = run_distributed(
        _cli_job, 1, str(config), str(path), str(marker), init_process_group=False, timeout_s=240
    )
    assert refused.startswith("refused:") and "--trust_checkpoint" in refused, refused
    assert not ran_untrusted, "the payload ran"
    assert ran_trusted, trusted


def test_v1_fixture_loads_safely_into_one_process() -> None:
    """A checkpoint written by the first format (committed fixture) loads with the safe defaults."""
    meta = ckpt.read_meta(FIXTURE)
    assert meta["format"] == "lightning_rec.dcp/1" and meta["global_step"] == 4
    assert meta["hyper_parameters"] == {"batch_size": 4, "lr": 0.2, "note": "v1"}
    assert meta["lr_schedulers"][0]["last_epoch"] == 1 and any("ModelCheckpoint" in k for k in meta["callbacks"])
    want = torch.load(FIXTURE.parent / "v1_checkpoint.expected.pt", weights_only=True)
    model = ClickModule()
    ckpt.load(FIXTURE, model)
    for k, v in want["weights"].items():
        assert torch.equal(model.state_dict()[k], v), k


def test_export_file_loads_weights_only(tmp_path) -> None:
    from lightning_rec.export import export_state_dict

    model = ClickModule()
    path = export_state_dict(model, tmp_path / "model.pt")
    state = torch.load(path, weights_only=True)
    assert set(state) == set(model.state_dict())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
