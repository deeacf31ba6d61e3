"""Flows users take that our other tests do not: 2-process Lightning runs against one process.

- a batch whose KeyedJaggedTensor holds features some collections do not read (pooled, sequence and
  managed-collision collections, every sharding type);
- tables marked with TorchRec's ``apply_optimizer_in_backward`` train with that optimizer, fused;
- a sharded table no optimizer updates is named in a warning at fit start;
- ``trainer.predict`` with Lightning's own (unpadded) sampler, and validation with loaders of unequal lengths;
- the model built in ``configure_model`` (on the meta device too), or under ``trainer.init_module()`` (with
  ``empty_init=True`` too: on the meta device, initialised at set-up);
- weights-only top-k and last checkpoints with EarlyStopping, an LR scheduler and LearningRateMonitor;
- weight averaging (its copy of the model predates sharding) refused with what to do instead;
- a prediction writer with unequal batch counts per rank.
"""

from __future__ import annotations

import contextlib
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch import callbacks
from lightning.pytorch.callbacks import BasePredictionWriter, EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

from lightning_rec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    RecModule,
    RecShardedStrategy,
    ShardingPlan,
    column_wise,
    data_parallel,
    full_state_dict,
    grid_shard,
    row_wise,
    table_row_wise,
    table_wise,
)
from lightning_rec.distributed import RowWiseAdagrad, apply_optimizer_in_backward, in_backward_optimizer_filter
from lightning_rec.mc import (
    LFU_EvictionPolicy,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    MCHManagedCollisionModule,
)
from lightning_rec.sharding import ShardedEmbeddingBagCollection
from lightning_rec.testing import run_distributed
from tests.lightning.models import KEYS, QUIET_TRAINER, TABLES, ClickModule, Clicks, collate

STEPS = 4


class PartialReader(RecModule):
    """Each collection reads some of the batch's features: ``ebc`` user_id and item_id, ``ec`` history,
    ``mc`` geo (raw ids through managed collision); the KJT always holds all four."""

    def __init__(
        self, batch_size: int = 4, plan: ShardingPlan | None = None, mark: bool = False, train_tables: bool = True
    ) -> None:
        super().__init__()
        self.batch_size, self._plan, self._train_tables = batch_size, plan, train_tables
        torch.manual_seed(0)
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(name="user", num_embeddings=11, embedding_dim=4, feature_names=["user_id"]),
                EmbeddingBagConfig(
                    name="item", num_embeddings=13, embedding_dim=8, feature_names=["item_id"], pooling="mean"
                ),
            ]
        )
        self.ec: EmbeddingCollection | None = EmbeddingCollection(
            [EmbeddingConfig(name="hist", num_embeddings=13, embedding_dim=4, feature_names=["history"])]
        )
        geo = [EmbeddingBagConfig(name="geo", num_embeddings=16, embedding_dim=4, feature_names=["geo"])]
        self.mc = ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(geo),
            ManagedCollisionCollection(
                {"geo": MCHManagedCollisionModule(16, num_buckets=4, eviction_policy=LFU_EvictionPolicy())}, geo
            ),
        )
        self.head = torch.nn.Linear(20, 1)
        if mark:  # what TorchRec's examples write; the sequence collection's tables fuse too (no-bag kernels)
            for m in (self.ebc, self.ec, self.mc):
                apply_optimizer_in_backward(RowWiseAdagrad, m.parameters(), {"lr": 0.1})

    def configure_sharding(self):
        return self._plan

    def forward(self, kjt):
        seq = torch.zeros(kjt.stride(), 4)
        if self.ec is not None:
            hist = self.ec(kjt)["history"]
            seq = seq.index_add(0, torch.repeat_interleave(torch.arange(kjt.stride()), hist.lengths()), hist.values())
        feats = torch.cat([self.ebc(kjt).values(), seq, self.mc(kjt)[0].values()], dim=1)
        return self.head(feats).squeeze(1)

    def training_step(self, batch, _):
        kjt, y = batch
        return torch.nn.functional.binary_cross_entropy_with_logits(self(kjt), y)

    def configure_optimizers(self):
        named = in_backward_optimizer_filter(self.named_parameters())
        params = [p for n, p in named if self._train_tables or n.startswith("head.")]
        return torch.optim.SGD(params, lr=0.2)

    def train_dataloader(self):
        ds = Clicks()
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = torch.utils.data.DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False)
        return DataLoader(ds, batch_size=self.batch_size, collate_fn=collate, sampler=sampler)


def _trainer(devices: int, strategy, **kw) -> L.Trainer:
    kw = {"max_steps": STEPS, **kw}
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        **QUIET_TRAINER,
        use_distributed_sampler=False,
        **kw,
    )


def _fit_job(rank: int, ws: int, plan, mark: bool) -> dict:
    model = PartialReader(plan=plan, mark=mark)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(ws, RecShardedStrategy(embedding_grad="mean")).fit(model)
    assert not [w for w in caught if "no optimizer updates" in str(w.message)]
    fused = model.fused_optimizer()
    assert (fused is not None) == mark, "in-backward marks must select the fused optimizer"
    state = full_state_dict(model)
    return {k: v for k, v in state.items() if "_managed_collision" not in k} if rank == 0 else {}


def _reference(ws: int, mark: bool) -> dict:
    model = PartialReader(batch_size=4 * ws, mark=mark)
    _trainer(1, "auto").fit(model)
    return {k: v for k, v in model.state_dict().items() if "_managed_collision" not in k}


MC_PLAN = {"geo": row_wise()}
PLANS = {
    "rw-cw-tw": ShardingPlan(
        {
            "ebc": {"user": row_wise(), "item": column_wise([0, 1])},
            "ec": {"hist": table_wise(1)},
            "mc._embedding_module": MC_PLAN,
        }
    ),
    "trw-grid-dp": ShardingPlan(
        {
            "ebc": {"user": table_row_wise(0), "item": grid_shard([0])},
            "ec": {"hist": data_parallel()},
            "mc._embedding_module": MC_PLAN,
        }
    ),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_collections_ignore_features_they_do_not_read(name: str) -> None:
    got = run_distributed(_fit_job, 2, PLANS[name], False, init_process_group=False, timeout_s=240)[0]
    want = _reference(2, mark=False)
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0, msg=lambda m: f"{name} {k}: {m}")


def test_apply_optimizer_in_backward_marks_train_the_tables_fused() -> None:
    plan = ShardingPlan({"ebc": {"user": row_wise(), "item": table_wise(1)}, "mc._embedding_module": MC_PLAN})
    got = run_distributed(_fit_job, 2, plan, True, init_process_group=False, timeout_s=240)[0]
    want = _reference(2, mark=True)
    before = PartialReader().state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
    assert not torch.equal(got["ebc.embedding_bags.user.weight"], before["ebc.embedding_bags.user.weight"])
    assert not torch.equal(got["ec.embeddings.hist.weight"], before["ec.embeddings.hist.weight"])


def _unoptimized_job(rank: int, ws: int) -> list[str]:
    model = PartialReader(plan=PLANS["rw-cw-tw"], train_tables=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(ws, RecShardedStrategy(), max_steps=1).fit(model)
    return [str(w.message) for w in caught if "no optimizer updates" in str(w.message)]


def test_tables_no_optimizer_updates_are_named_once() -> None:
    msgs = run_distributed(_unoptimized_job, 2, init_process_group=False, timeout_s=240)
    assert msgs[1] == [] and len(msgs[0]) == 1, msgs
    for table in (
        "ebc.embedding_bags.user.weight",
        "ebc.embedding_bags.item.weight",
        "ec.embeddings.hist.weight",
        "mc._embedding_module.embedding_bags.geo.weight",
    ):
        assert table in msgs[0][0]


def test_marks_resolve_per_table_and_collections_mix() -> None:
    from lightning_rec.front_end import resolve_table_optimizers
    from lightning_rec.fused_kinds import as_spec

    model = PartialReader()
    apply_optimizer_in_backward(RowWiseAdagrad, [model.ebc.embedding_bags["user"].weight], {"lr": 0.1})
    # a collection's tables are all fused or none: the unmarked one is named
    with pytest.raises(ValueError, match=r"'ebc': tables \['user'\] have a fused optimizer but \['item'\] do not"):
        resolve_table_optimizers(model, None)
    apply_optimizer_in_backward(torch.optim.SGD, [model.ebc.embedding_bags["item"].weight], {"lr": 0.5})
    specs = resolve_table_optimizers(model, None)
    # marked tables fuse, each with its own spec; the unmarked sequence and managed-collision collections stay
    # ordinary parameters beside them
    assert specs["ebc"]["user"] == as_spec({"kind": "rowwise_adagrad", "lr": 0.1, "eps": 1e-10})
    assert specs["ebc"]["item"] == as_spec({"kind": "sgd", "lr": 0.5})
    assert specs["ec"] == {"hist": None} and set(specs["mc._embedding_module"].values()) == {None}
    # a default for the rest: the marks win where they are, the default fills the others
    default = {"default": {"kind": "sgd", "lr": 0.5}, "tables": {"hist": None}}
    specs = resolve_table_optimizers(model, default)
    assert set(specs["mc._embedding_module"].values()) == {as_spec({"kind": "sgd", "lr": 0.5})}
    with pytest.raises(ValueError, match=r"'ebc', table 'user'.*differs from embedding_optimizer"):
        resolve_table_optimizers(model, as_spec({"kind": "sgd", "lr": 0.5}))
    # a sequence collection's tables fuse too (no-bag kernels)
    specs = resolve_table_optimizers(model, {"default": None, "tables": {"hist": {"kind": "sgd", "lr": 0.1}}})
    assert specs["ec"] == {"hist": as_spec({"kind": "sgd", "lr": 0.1})}
    with pytest.raises(ValueError, match=r"names tables \['nope'\]"):
        resolve_table_optimizers(model, {"tables": {"nope": {"kind": "sgd", "lr": 0.1}}})


# -- evaluation with unequal batch counts --------------------------------------------------------------------


class Indexed(Dataset):
    def __init__(self, n: int) -> None:
        self.clicks = Clicks(n)

    def __len__(self) -> int:
        return len(self.clicks)

    def __getitem__(self, i: int):
        return (*self.clicks[i], i)


def _indexed_collate(samples):
    kjt, y = collate([s[:2] for s in samples])
    return kjt, y, torch.tensor([s[2] for s in samples])


class Evaluated(PartialReader):
    def __init__(self, n: int = 41, val_lengths: tuple[int, ...] | None = None, **kw) -> None:
        super().__init__(**kw)
        self.n, self.val_lengths = n, val_lengths
        self.seen: dict[int, float] = {}

    def predict_step(self, batch, _):
        kjt, _, idx = batch
        return idx, torch.sigmoid(self(kjt))

    def validation_step(self, batch, _):
        kjt, _, idx = batch
        self.seen.update(zip(idx.tolist(), torch.sigmoid(self(kjt)).tolist()))

    def predict_dataloader(self):
        return DataLoader(Indexed(self.n), batch_size=4, collate_fn=_indexed_collate)

    def val_dataloader(self):
        # each rank its own slice, of its own length: what a user's hand-made loaders may do
        lengths = self.val_lengths or (self.n,)
        rank = self.trainer.global_rank
        start = sum(lengths[:rank])
        subset = torch.utils.data.Subset(Indexed(sum(lengths)), range(start, start + lengths[rank]))
        return DataLoader(subset, batch_size=4, collate_fn=_indexed_collate)


def _evaluate_job(rank: int, ws: int, plan) -> dict:
    model = Evaluated(plan=plan, val_lengths=(13, 5))
    kw = dict(accelerator="cpu", devices=ws, logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer = L.Trainer(strategy=RecShardedStrategy(), **kw)
    preds = trainer.predict(model)  # Lightning's own predict sampler: 21 and 20 samples, 6 and 5 batches
    # each rank's own validation loader: 4 and 2 batches
    L.Trainer(strategy=RecShardedStrategy(), use_distributed_sampler=False, **kw).validate(model)
    return {
        "predict": {i: p for idx, ps in preds for i, p in zip(idx.tolist(), ps.tolist())},
        "batches": len(preds),
        "validate": dict(model.seen),
    }


@pytest.mark.parametrize("name", list(PLANS))
def test_predict_and_validate_with_unequal_batch_counts(name: str) -> None:
    results = run_distributed(_evaluate_job, 2, PLANS[name], init_process_group=False, timeout_s=240)
    assert [r["batches"] for r in results] == [6, 5]
    model = Evaluated()
    model.eval()
    with torch.no_grad():
        kjt, _, idx = _indexed_collate([Indexed(41)[i] for i in range(41)])
        want = dict(zip(idx.tolist(), torch.sigmoid(model(kjt)).tolist()))
    for stage, n in (("predict", 41), ("validate", 18)):
        got: dict[int, float] = {}
        for r in results:
            assert not set(got) & set(r[stage]), f"{stage}: a sample evaluated twice"
            got.update(r[stage])
        assert sorted(got) == list(range(n)), f"{stage}: every sample exactly once"
        for i in got:
            assert abs(got[i] - want[i]) < 1e-5, (stage, i, got[i], want[i])


class BuiltLate(RecModule):
    """The collection and head built in ``configure_model`` (Lightning's hook for models built at setup), on the
    meta device when ``meta`` (as for ModelParallelStrategy: the strategy gives them storage)."""

    def __init__(self, batch_size: int = 4, meta: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()  # load_from_checkpoint builds it the same way (on the meta device too)
        self.batch_size, self.meta = batch_size, meta
        self.ebc: EmbeddingBagCollection | None = None

    def configure_model(self) -> None:
        if self.ebc is not None:  # Lightning calls it again on every fit / validate / test
            return
        torch.manual_seed(0)
        with torch.device("meta") if self.meta else contextlib.nullcontext():
            self.ebc = EmbeddingBagCollection(TABLES)
            self.head = torch.nn.Linear(4 * len(KEYS), 1)

    def training_step(self, batch, _):
        kjt, y = batch
        assert self.ebc is not None
        logits = self.head(self.ebc(kjt).values()).squeeze(1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)

    def train_dataloader(self):
        ds = Clicks()
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = torch.utils.data.DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False)
        return DataLoader(ds, batch_size=self.batch_size, collate_fn=collate, sampler=sampler)


class _Initial(L.Callback):
    """The whole model as training starts (collective): where a meta-built model's values come from."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.state = {k: v.clone() for k, v in full_state_dict(pl_module).items()}  # dense entries are live views


def _saved_meta_job(rank: int, ws: int, path: str) -> dict:
    trainer = _trainer(ws, RecShardedStrategy(embedding_grad="mean"))
    model = BuiltLate(meta=True)
    trainer.fit(model)
    trainer.save_checkpoint(path)
    return full_state_dict(model)


def test_a_meta_built_model_loads_from_its_checkpoint_into_one_process(tmp_path) -> None:
    final = run_distributed(_saved_meta_job, 2, str(tmp_path / "m.ckpt"), init_process_group=False)[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = BuiltLate.load_from_checkpoint(tmp_path / "m.ckpt")  # configure_model builds it on meta again
    assert not [w for w in caught if "meta" in str(w.message)], [str(w.message) for w in caught]
    assert loaded.meta and {p.device.type for p in loaded.parameters()} == {"cpu"}
    for k, v in final.items():
        torch.testing.assert_close(loaded.state_dict()[k], v, atol=0, rtol=0, msg=k)


def _built_late_job(rank: int, ws: int, how: str) -> dict:
    initial = _Initial()
    trainer = _trainer(ws, RecShardedStrategy(embedding_grad="mean"), callbacks=[initial])
    if how.startswith("init_module"):  # Lightning's way to build on the strategy's device and precision
        with trainer.init_module(empty_init=how == "init_module_empty"):  # empty: on the meta device
            model = BuiltLate()
            model.configure_model()
        assert (model.head.weight.device.type == "meta") == (how == "init_module_empty")
    else:
        model = BuiltLate(meta=how == "meta")
    trainer.fit(model)
    assert isinstance(model.ebc, ShardedEmbeddingBagCollection), type(model.ebc)  # sharded, not replicated by DDP
    state = full_state_dict(model)
    return {"initial": initial.state, "final": state} if rank == 0 else {}


@pytest.mark.parametrize("how", ["configure_model", "init_module", "meta", "init_module_empty"])
def test_a_model_built_at_setup_trains_as_one_process(how: str) -> None:
    got = run_distributed(_built_late_job, 2, how, init_process_group=False, timeout_s=240)[0]
    reference = BuiltLate(batch_size=8)
    reference.configure_model()
    if how in ("meta", "init_module_empty"):  # initialised at set-up, not by the seed: start the reference there
        assert all(torch.isfinite(v).all() and v.abs().sum() > 0 for v in got["initial"].values())
        reference.load_state_dict(got["initial"])
    else:
        want = reference.state_dict()
        for k in want:
            torch.testing.assert_close(got["initial"][k], want[k], atol=0, rtol=0, msg=k)
    _trainer(1, "auto").fit(reference)
    want = reference.state_dict()
    assert set(got["final"]) == set(want)
    for k in want:
        torch.testing.assert_close(got["final"][k], want[k], atol=1e-6, rtol=0, msg=lambda m: f"{how} {k}: {m}")


class _Writer(BasePredictionWriter):
    """What a prediction writer receives, per batch and at the epoch's end."""

    def __init__(self) -> None:
        super().__init__(write_interval="batch_and_epoch")
        self.batches: list[list[int]] = []
        self.epoch_indices: list[list[int]] = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.batches.append(prediction[0].tolist())

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        self.epoch_indices = [list(b) for b in batch_indices[0]]


def _writer_job(rank: int, ws: int) -> dict:
    writer = _Writer()
    kw = dict(accelerator="cpu", devices=ws, logger=False, enable_progress_bar=False, enable_model_summary=False)
    L.Trainer(strategy=RecShardedStrategy(), callbacks=[writer], **kw).predict(
        Evaluated(plan=PLANS["rw-cw-tw"]), return_predictions=False
    )
    return {"batches": writer.batches, "epoch": writer.epoch_indices}


def test_a_prediction_writer_sees_each_sample_once_with_unequal_batch_counts() -> None:
    # Lightning's predict sampler gives the ranks 21 and 20 samples; the rank that runs out first joins the
    # other's lookups with empty batches, which no callback sees
    results = run_distributed(_writer_job, 2, init_process_group=False, timeout_s=240)
    assert [len(r["batches"]) for r in results] == [6, 5]
    assert [len(r["epoch"]) for r in results] == [6, 5]
    written = [i for r in results for b in r["batches"] for i in b]
    assert sorted(written) == list(range(41))


class Monitored(ClickModule):
    """Validation on the training data, SGD with a step schedule."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}

    def train_dataloader(self):
        ds = Clicks()
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = torch.utils.data.DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False)
        return DataLoader(ds, batch_size=self.batch_size, collate_fn=collate, sampler=sampler)

    def val_dataloader(self):
        return self.train_dataloader()


def _monitored_job(rank: int, ws: int, root: str) -> dict:
    top = ModelCheckpoint(dirpath=root, save_weights_only=True, monitor="val_loss", save_top_k=2, save_last=True)
    stop = EarlyStopping(monitor="val_loss", patience=0, min_delta=10.0)  # no epoch improves by 10: stops at the 2nd
    quiet = {k: v for k, v in QUIET_TRAINER.items() if k not in ("logger", "enable_checkpointing")}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=ws,
        strategy=RecShardedStrategy(embedding_grad="mean"),
        max_epochs=5,
        limit_train_batches=3,
        limit_val_batches=2,
        use_distributed_sampler=False,
        callbacks=[top, stop, LearningRateMonitor()],
        logger=CSVLogger(root),
        **quiet,
    )
    model = Monitored()
    trainer.fit(model)
    state = full_state_dict(model)
    return {"epoch": trainer.current_epoch, "step": trainer.global_step, "best": top.best_model_path, "state": state}


def test_weights_only_checkpoints_with_early_stopping_and_a_schedule(tmp_path) -> None:
    results = run_distributed(_monitored_job, 2, str(tmp_path), init_process_group=False, timeout_s=240)
    assert [(r["epoch"], r["step"]) for r in results] == [(2, 6), (2, 6)]  # every rank stopped after epoch 1
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == [
        "epoch=0-step=3.ckpt",
        "epoch=1-step=6.ckpt",
        "last.ckpt",
    ]
    assert (tmp_path / "lightning_logs").exists()  # the monitor's learning rates were logged
    last = Monitored.load_from_checkpoint(tmp_path / "last.ckpt")  # weights only, into one process
    for k, v in results[0]["state"].items():
        torch.testing.assert_close(last.state_dict()[k], v, atol=0, rtol=0, msg=k)
    assert set(Monitored.load_from_checkpoint(results[0]["best"]).state_dict()) == set(results[0]["state"])


def _averaging_job(rank: int, ws: int, name: str) -> str:
    averaging = getattr(callbacks, name)
    callback = averaging(swa_lrs=0.1) if name == "StochasticWeightAveraging" else averaging()
    trainer = _trainer(ws, RecShardedStrategy(), callbacks=[callback], max_epochs=2, max_steps=-1)
    try:
        trainer.fit(Monitored())
    except ValueError as e:
        return str(e)
    return "trained"


@pytest.mark.parametrize("name", [n for n in ("StochasticWeightAveraging", "WeightAveraging") if hasattr(callbacks, n)])
def test_weight_averaging_is_refused_on_every_rank(name: str) -> None:
    for msg in run_distributed(_averaging_job, 2, name, init_process_group=False, timeout_s=240):
        assert msg.startswith(f"rec_sharded: {name} keeps a copy of the whole model"), msg
        assert "AveragedModel of the dense modules" in msg
