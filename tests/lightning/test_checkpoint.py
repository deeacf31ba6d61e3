"""Checkpoint directories through Trainer(strategy="rec_sharded"): exact resume, resharding, safety, errors."""

from __future__ import annotations

import os
import re

import lightning as L
import pytest
import torch

from lightning_rec import (
    CombinedOptimizer,
    RecShardedStrategy,
    ShardingPlan,
    column_wise,
    data_parallel,
    full_state_dict,
    row_wise,
    table_wise,
)
from lightning_rec import checkpoint as ckpt
from lightning_rec.testing import run_distributed
from tests.lightning.models import ClickModule

# 2 replicas x 2-way model parallel: plans speak in ranks of the 2-rank model-parallel group
MIXED_4 = ShardingPlan({"ebc": {"user": row_wise(), "item": column_wise(ranks=[1, 0]), "geo": data_parallel()}})
MIXED_2 = ShardingPlan({"ebc": {"user": row_wise(), "item": table_wise(rank=1), "geo": data_parallel()}})
OTHER_2 = ShardingPlan({"ebc": {"user": data_parallel(), "item": row_wise(), "geo": table_wise(rank=0)}})
NO_DP_2 = ShardingPlan({"ebc": {"user": row_wise(), "item": table_wise(rank=1), "geo": table_wise(rank=0)}})


def _optimizers(model: ClickModule, kind: str):
    if kind == "adagrad":
        return torch.optim.Adagrad(model.parameters(), lr=0.1)
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    if kind == "fused":
        return CombinedOptimizer([torch.optim.Adagrad(model.head.parameters(), lr=0.1), model.fused_optimizer()])
    raise ValueError(kind)


class _Model(ClickModule):
    def __init__(self, plan=None, kind: str = "adagrad", batch_size: int = 4) -> None:
        super().__init__(batch_size=batch_size, plan=plan)
        self.kind = kind

    def configure_optimizers(self):
        opt = _optimizers(self, self.kind)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}


def _trainer(ws: int, epochs: int, mp: int | None = None, kind: str = "adagrad", **kw) -> L.Trainer:
    fused = {"kind": "rowwise_adagrad", "lr": 0.1} if kind == "fused" else None
    strategy = RecShardedStrategy(embedding_grad="mean", model_parallel_size=mp, embedding_optimizer=fused)
    kw.setdefault("enable_checkpointing", False)
    return L.Trainer(
        accelerator="cpu",
        devices=ws,
        strategy=strategy,
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        limit_train_batches=4,
        use_distributed_sampler=False,
        **kw,
    )


def _train_job(
    rank: int, ws: int, mp: int, plan, kind: str, epochs: int, resume: str | None, out: str, batch: int
) -> None:
    model = _Model(plan=plan, kind=kind, batch_size=batch)
    trainer = _trainer(ws, epochs, mp, kind)
    trainer.fit(model, ckpt_path=resume)
    trainer.save_checkpoint(out)


def _unsharded_state(path: str, kind: str) -> tuple[dict, dict]:
    """Load a checkpoint directory into one process's unsharded model and a matching optimizer."""
    model = _Model(kind="adagrad" if kind == "fused" else kind)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1) if kind != "adam" else _optimizers(model, "adam")
    if kind == "fused":
        return model.state_dict(), ckpt.read_meta(path)
    ckpt.load(path, model, [opt])
    return model.state_dict(), opt.state_dict()


def _assert_same_dirs(a: str, b: str) -> None:
    """Bitwise-equal tensors (weights and optimizer state) in two checkpoint directories."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    fa, fb = a + ".pt", b + ".pt"
    dcp_to_torch_save(a, fa)
    dcp_to_torch_save(b, fb)
    sa, sb = torch.load(fa, weights_only=False), torch.load(fb, weights_only=False)

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}|") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    fa_, fb_ = flat(sa), flat(sb)
    assert set(fa_) == set(fb_)
    assert any("optimizer_0" in k for k in fa_), "no optimizer state was saved"
    for k in fa_:
        assert torch.equal(fa_[k], fb_[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("kind, plan", [("adagrad", MIXED_2), ("fused", NO_DP_2)], ids=["adagrad", "fused-rowwise"])
def test_exact_resume(tmp_path, kind: str, plan) -> None:
    straight, half, resumed = (str(tmp_path / n) for n in ("straight", "half", "resumed"))
    run_distributed(_train_job, 2, 2, plan, kind, 2, None, straight, 4, init_process_group=False, timeout_s=240)
    run_distributed(_train_job, 2, 2, plan, kind, 1, None, half, 4, init_process_group=False, timeout_s=240)
    run_distributed(_train_job, 2, 2, plan, kind, 2, half, resumed, 4, init_process_group=False, timeout_s=240)
    _assert_same_dirs(straight, resumed)
    meta = ckpt.read_meta(resumed)
    assert meta["global_step"] == 8 and meta["lr_schedulers"][0]["last_epoch"] == 2
    chunks = {
        k: len(v.chunks)
        for k, v in __import__("torch.distributed.checkpoint", fromlist=["x"])
        .FileSystemReader(resumed)
        .read_metadata()
        .state_dict_metadata.items()
        if hasattr(v, "chunks")
    }
    assert chunks["state_dict.ebc.embedding_bags.user.weight"] == 2  # row-wise: one piece per rank
    assert chunks["state_dict.head.weight"] == 1  # dense (and data-parallel) tensors are written once
    if kind == "adagrad":
        assert chunks["state_dict.ebc.embedding_bags.geo.weight"] == 1
    if kind == "fused":
        (layout,) = meta["optimizer_layouts"]
        assert layout["fused"]["kind"] == "fused:rowwise_adagrad"
        assert layout["fused"]["state"]["ebc.embedding_bags.user.weight"]["sum"][0] == "rows"
        # row-wise state costs one value per row on disk (one column: the table is not split by columns)
        md = __import__("torch.distributed.checkpoint", fromlist=["x"]).FileSystemReader(resumed).read_metadata()
        assert list(md.state_dict_metadata["optimizer_0.fused/ebc.embedding_bags.user.weight/sum"].size) == [11, 1]


def test_resharding_matrix(tmp_path) -> None:
    """Save at 4 processes (2x2, mixed plan); resume at 2 with another plan and at 1; all match a straight run."""
    half, straight, at2, at1 = (str(tmp_path / n) for n in ("half", "straight", "at2", "at1"))
    run_distributed(_train_job, 4, 2, MIXED_4, "adam", 1, None, half, 2, init_process_group=False, timeout_s=300)
    # the run that never reshards: one process on the global batch (equal to the 2x2 run by the "mean" rule)
    run_distributed(_train_job, 1, 1, None, "adam", 2, None, straight, 8, init_process_group=False, timeout_s=240)
    run_distributed(_train_job, 2, 2, OTHER_2, "adam", 2, half, at2, 4, init_process_group=False, timeout_s=240)
    run_distributed(_train_job, 1, 1, None, "adam", 2, half, at1, 8, init_process_group=False, timeout_s=240)
    want_w, want_o = _unsharded_state(straight, "adam")
    for path in (at2, at1):
        got_w, got_o = _unsharded_state(path, "adam")
        for k in want_w:
            torch.testing.assert_close(got_w[k], want_w[k], atol=2e-5, rtol=0, msg=lambda m: f"{path} {k}: {m}")
        for i, st in want_o["state"].items():
            for name, v in st.items():
                torch.testing.assert_close(
                    got_o["state"][i][name], v, atol=2e-5, rtol=1e-4, msg=lambda m: f"{path} state {i}.{name}: {m}"
                )
    # the 4-process checkpoint also loads straight into one process, weights and optimizer state
    w, o = _unsharded_state(half, "adam")
    assert float(o["state"][0]["step"]) == 4.0 and any(v.abs().sum() > 0 for v in w.values())


def _kill_during_save_job(rank: int, ws: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    model = _Model(plan=None)
    trainer = _trainer(ws, 1)
    trainer.fit(model)
    trainer.save_checkpoint(path)
    torch.save(full_state_dict(model), path + ".expected")
    original = dcp.save

    def dying_save(*args, **kwargs):
        original(*args, **kwargs)  # shards written into the partial directory, meta and rename not yet
        os._exit(9)

    dcp.save = dying_save
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # a different state, which must never become visible at `path`
    trainer.save_checkpoint(path)


def test_killed_save_leaves_previous_checkpoint(tmp_path) -> None:
    path = str(tmp_path / "last.ckpt")
    with pytest.raises(RuntimeError, match="exit"):
        run_distributed(_kill_during_save_job, 1, path, init_process_group=False, timeout_s=120)
    assert os.path.isdir(tmp_path / ".last.ckpt.partial"), "the killed save should have been writing aside"
    meta = ckpt.read_meta(path)
    assert meta["global_step"] == 4
    model = _Model()
    ckpt.load(path, model)
    want = torch.load(path + ".expected")
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k


def _mismatch_job(rank: int, ws: int, path: str) -> dict:
    from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig
    from tests.lightning.models import TABLES

    errors = {}
    for what in ("shape", "optimizer"):
        model = _Model(plan=MIXED_2)
        if what == "shape":
            tables = [
                EmbeddingBagConfig(
                    name=t.name,
                    num_embeddings=t.num_embeddings + (t.name == "item"),
                    embedding_dim=t.embedding_dim,
                    feature_names=t.feature_names,
                    pooling=t.pooling,
                )
                for t in TABLES
            ]
            model.ebc = EmbeddingBagCollection(tables)
        else:
            model.kind = "adam"
        try:
            _trainer(ws, 2).fit(model, ckpt_path=path)
            errors[what] = "no error"
        except Exception as e:
            errors[what] = f"{type(e).__name__}: {e}"
    return errors


def test_mismatched_checkpoint_names_table_and_shapes(tmp_path) -> None:
    path = str(tmp_path / "c")
    run_distributed(_train_job, 2, 2, MIXED_2, "adagrad", 1, None, path, 4, init_process_group=False, timeout_s=240)
    messages = {
        "shape": r"'ebc.embedding_bags.item.weight' has shape \[13, 4\] in the checkpoint but \[14, 4\] in the model",
        "optimizer": r"the checkpoint's optimizer is torch.optim.adagrad.Adagrad, this run's is torch.optim.adam.Adam",
    }
    for r in run_distributed(_mismatch_job, 2, path, init_process_group=False, timeout_s=240):
        for what, message in messages.items():
            assert "ValueError" in r[what] and re.search(message, r[what]), r[what]


def _export_job(rank: int, ws: int, mp: int, plan, out: str) -> dict:
    from lightning_rec.export import ExportStateDict

    model = _Model(plan=plan, batch_size=8 // ws)
    export = ExportStateDict(dirpath=out, filename="model-{epoch}.pt", every_n_epochs=1)
    trainer = _trainer(ws, 2, mp, callbacks=[export])
    trainer.fit(model)
    state = full_state_dict(model)
    preds = trainer.predict(model)
    return {"state": state if rank == 0 else None, "preds": torch.cat(preds), "last": str(export.last_path)}


@pytest.mark.parametrize("ws, mp, plan", [(2, 2, MIXED_2), (4, 2, MIXED_4)], ids=["2procs", "2x2"])
def test_export_loads_into_unsharded_module(tmp_path, ws: int, mp: int, plan) -> None:
    results = run_distributed(_export_job, ws, mp, plan, str(tmp_path), init_process_group=False, timeout_s=300)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-0.pt", "model-1.pt"]
    assert results[0]["last"] == str(tmp_path / "model-1.pt")
    exported = torch.load(tmp_path / "model-1.pt", weights_only=True)  # a plain state_dict
    for k, v in results[0]["state"].items():
        assert torch.equal(exported[k], v), k
    single = _Model()
    single.load_state_dict(exported)
    from torch.utils.data import DataLoader

    from tests.lightning.models import Clicks, collate

    single.eval()
    with torch.no_grad():
        want = torch.cat(
            [torch.sigmoid(single(kjt)) for kjt, _ in DataLoader(Clicks(16), batch_size=4, collate_fn=collate)]
        )
    torch.testing.assert_close(results[0]["preds"], want, atol=1e-6, rtol=0)


def _model_checkpoint_job(rank: int, ws: int, out: str) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = _Model(plan=MIXED_2)
    mc = ModelCheckpoint(dirpath=out, monitor="train_loss", mode="max", save_top_k=1, save_last=True, every_n_epochs=1)
    trainer = _trainer(ws, 3, callbacks=[mc], enable_checkpointing=True)
    trainer.fit(model)
    best = mc.best_model_path
    listing = sorted(os.listdir(out))
    # evaluation from a checkpoint directory loads the weights (and changes nothing else)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    trainer.validate(model, ckpt_path=best, verbose=False)
    restored = full_state_dict(model)
    fresh = _Model()
    ckpt.load(best, fresh)
    return {
        "listing": listing,
        "best": os.path.basename(best),
        "restored": restored if rank == 0 else None,
        "want": fresh.state_dict(),
    }


def test_model_checkpoint_keeps_top_k_directories_and_validate_loads_them(tmp_path) -> None:
    res = run_distributed(_model_checkpoint_job, 2, str(tmp_path), init_process_group=False, timeout_s=240)[0]
    assert res["listing"] == sorted([res["best"], "last.ckpt"]), res["listing"]
    assert res["best"].startswith("epoch=")
    for k, v in res["want"].items():
        assert torch.equal(res["restored"][k], v), k
