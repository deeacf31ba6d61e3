"""The Lightning front end's old module paths (``lightning_rec.strategy``, ...) still name the same modules: users'
YAML ``class_path``s and pickled checkpoints and hyper-parameters hold them."""

from __future__ import annotations

import importlib
import io
import pickle

import lightning as L
import pytest
import torch
from lightning.pytorch.cli import LightningCLI

import lightning_rec
from lightning_rec.lightning.callbacks import ShardingSummary

MOVED = ["strategy", "fabric", "shard_setup", "uneven", "preemption", "child_exits", "callbacks", "rec_module"]


@pytest.mark.parametrize("name", MOVED)
def test_old_module_path_is_the_moved_module(name: str) -> None:
    old = importlib.import_module(f"lightning_rec.{name}")
    assert old is importlib.import_module(f"lightning_rec.lightning.{name}")
    assert getattr(lightning_rec, name) is old


def test_old_paths_give_the_public_classes() -> None:
    import lightning_rec.fabric
    import lightning_rec.strategy
    from lightning_rec.rec_module import RecModule

    assert importlib.import_module("lightning_rec.strategy").RecShardedStrategy is lightning_rec.RecShardedStrategy
    assert lightning_rec.strategy.RecShardedStrategy is lightning_rec.RecShardedStrategy
    assert lightning_rec.fabric.RecShardedFabricStrategy is lightning_rec.RecShardedFabricStrategy
    assert RecModule is lightning_rec.RecModule


def test_pickle_saved_under_the_old_path_loads() -> None:
    # protocol 0 names a class as text ("c<module>\n<name>\n"), so the module path can be put back to the old one
    new = pickle.dumps(ShardingSummary(batch_size=3, pooling_factors={"f": 2.0}), protocol=0)
    old = new.replace(b"lightning_rec.lightning.callbacks\n", b"lightning_rec.callbacks\n")
    assert b"lightning_rec.callbacks\n" in old and b"lightning_rec.lightning" not in old
    loaded = pickle.loads(old)
    assert type(loaded) is ShardingSummary
    assert (loaded.batch_size, loaded.pooling_factors) == (3, {"f": 2.0})
    # any protocol: the unpickler resolves the old path to the class itself
    found = pickle.Unpickler(io.BytesIO()).find_class("lightning_rec.strategy", "RecShardedStrategy")
    assert found is lightning_rec.RecShardedStrategy


class _Tiny(L.LightningModule):
    def __init__(self, width: int = 2) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(width, 1)


def test_cli_class_path_under_the_old_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["train.py"])  # the CLI reads args only, not pytest's command line
    cli = LightningCLI(
        _Tiny,
        run=False,
        seed_everything_default=False,  # leaves the other tests' random state alone
        args=[
            "--trainer.accelerator=cpu",
            "--trainer.devices=1",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            "--trainer.strategy.class_path=lightning_rec.strategy.RecShardedStrategy",
            "--trainer.strategy.init_args.embedding_grad=mean",
            "--trainer.callbacks+=lightning_rec.callbacks.ShardingSummary",
            "--trainer.callbacks.batch_size=8",
        ],
    )
    strategy = cli.trainer.strategy
    assert type(strategy) is lightning_rec.RecShardedStrategy and strategy.embedding_grad == "mean"
    summaries = [c for c in cli.trainer.callbacks if isinstance(c, ShardingSummary)]
    assert len(summaries) == 1 and summaries[0].batch_size == 8
