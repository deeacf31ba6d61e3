"""DLRM and the two-tower retrieval model: one process vs sharded Trainer runs, and the DLRM main job end to end."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_rec import (
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    RecShardedStrategy,
    ShardingPlan,
    column_wise,
    data_parallel,
    full_state_dict,
    row_wise,
    table_wise,
)
from lightning_rec.models import DLRM, InteractionArch, SyntheticSessions, TwoTowerRetrieval
from lightning_rec.testing import run_distributed
from tests.lightning.models import QUIET_TRAINER

STEPS, BATCH, DENSE, DIM = 4, 6, 3, 4
# names with dots and spaces: tables are user data
CARDS = {"user id": 23, "item": 31, "geo.city": 7, "hist": 17}
DLRM_PLAN = ShardingPlan(
    {
        "sparse_arch.embedding_bag_collection": {
            "user id": row_wise(),
            "item": table_wise(rank=1),
            "geo.city": column_wise(ranks=[1, 0]),
            "hist": data_parallel(),
        }
    }
)


def _trainer(**kw) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        **QUIET_TRAINER,
        use_distributed_sampler=False,
        **kw,
    )


# -- DLRM ------------------------------------------------------------------------------------------------


def _clicks(rank: int, step: int) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.cat([torch.randint(0, 4 if f == "hist" else 2, (BATCH,), generator=g) for f in CARDS])
    values = torch.cat(
        [
            torch.randint(0, n, (int(lengths[i * BATCH : (i + 1) * BATCH].sum()),), generator=g)
            for i, n in enumerate(CARDS.values())
        ]
    )
    return (
        torch.randn(BATCH, DENSE, generator=g),
        KeyedJaggedTensor(list(CARDS), values, lengths=lengths),
        (torch.rand(BATCH, generator=g) < 0.4).float(),
    )


def _concat(batches: list[tuple]) -> tuple:
    """The global batch: samples of rank 0, then rank 1, ... (KJT bags concatenated key by key)."""
    keys = batches[0][1].keys()
    jts = [{k: b[1][k] for k in keys} for b in batches]
    kjt = KeyedJaggedTensor(
        keys,
        torch.cat([j[k].values() for k in keys for j in jts]),
        lengths=torch.cat([j[k].lengths() for k in keys for j in jts]),
    )
    return torch.cat([b[0] for b in batches]), kjt, torch.cat([b[2] for b in batches])


def _dlrm(**kw) -> DLRM:
    torch.manual_seed(0)
    args = {
        "num_dense": DENSE,
        "feature_names": list(CARDS),
        "num_embeddings_per_feature": list(CARDS.values()),
        "embedding_dim": DIM,
        "dense_arch_layer_sizes": [8, DIM],
        "over_arch_layer_sizes": [8, 1],
        "dense_lr": 0.01,
        "embedding_lr": 0.1,
    }
    return DLRM(**{**args, **kw})


def _dlrm_job(rank: int, ws: int, optimizer: str) -> dict:
    model = _dlrm(embedding_optimizer=optimizer, plan=DLRM_PLAN)
    data = [_clicks(rank, s) for s in range(STEPS)]
    trainer = _trainer(devices=ws, strategy=RecShardedStrategy(embedding_grad="mean"))
    trainer.fit(
        model,
        train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None),
        val_dataloaders=torch.utils.data.DataLoader(data[:2], batch_size=None),
    )
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    preds = trainer.predict(model, torch.utils.data.DataLoader(data[:1], batch_size=None))
    return {"state": full_state_dict(model), "metrics": metrics, "preds": preds[0]}


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adagrad", "sgd"])
def test_dlrm_sharded_matches_single_process(optimizer: str) -> None:
    results = run_distributed(_dlrm_job, 2, optimizer, init_process_group=False, timeout_s=240)
    ref = _dlrm(embedding_optimizer=optimizer)
    data = [_concat([_clicks(r, s) for r in range(2)]) for s in range(STEPS)]
    trainer = _trainer(devices=1, strategy="auto")
    trainer.fit(
        ref,
        train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None),
        val_dataloaders=torch.utils.data.DataLoader(data[:2], batch_size=None),
    )
    want = ref.state_dict()
    got = results[0]["state"]
    assert set(got) == set(want)
    moved = 0
    init = _dlrm().state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
        moved += not torch.equal(want[k], init[k])
    assert moved == len(want), "every parameter, every table included, must have trained"
    # validation metrics: each rank saw its half of the global batches; synced values equal one process
    for k in ("val_auroc", "val_ne", "val_loss"):
        assert results[0]["metrics"][k] == results[1]["metrics"][k]
        assert results[0]["metrics"][k] == pytest.approx(float(trainer.callback_metrics[k]), abs=1e-5), k
    with torch.no_grad():
        dense, kjt, _ = data[0]
        want_preds = torch.sigmoid(ref(dense, kjt))
    torch.testing.assert_close(torch.cat([r["preds"] for r in results]), want_preds, atol=1e-5, rtol=0)


def test_interaction_is_every_pairwise_dot() -> None:
    g = torch.Generator().manual_seed(0)
    dense, sparse = torch.randn(5, 3, generator=g), torch.randn(5, 4, 3, generator=g)
    out = InteractionArch(4)(dense, sparse)
    vecs = [dense] + [sparse[:, i] for i in range(4)]
    dots = [(vecs[i] * vecs[j]).sum(1) for i, j in itertools.combinations(range(5), 2)]
    torch.testing.assert_close(out, torch.cat([dense, torch.stack(dots, 1)], 1))


def test_dlrm_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"table 'b' has embedding_dim 8 but the bottom MLP ends with 4"):
        DLRM(
            num_dense=2,
            dense_arch_layer_sizes=[4],
            tables=[
                EmbeddingBagConfig(name="a", num_embeddings=3, embedding_dim=4, feature_names=["a"]),
                EmbeddingBagConfig(name="b", num_embeddings=3, embedding_dim=8, feature_names=["b"]),
            ],
        )
    with pytest.raises(ValueError, match="2 feature names but 1 table sizes"):
        DLRM(feature_names=["a", "b"], num_embeddings_per_feature=[3])
    with pytest.raises(ValueError, match="must end with 1"):
        _dlrm(over_arch_layer_sizes=[8, 2])
    with pytest.raises(ValueError, match="embedding_optimizer must be one of"):
        _dlrm(embedding_optimizer="adam")
    model = _dlrm()
    dense, kjt, _ = _clicks(0, 0)
    with pytest.raises(ValueError, match=r"dense features must be \[batch, 3\], got \(6, 2\)"):
        model(dense[:, :2], kjt)
    with pytest.raises(ValueError, match="missing"):
        model(dense, KeyedJaggedTensor(["item"], torch.tensor([1]), lengths=torch.tensor([1] + [0] * 5)))


# -- two-tower retrieval ----------------------------------------------------------------------------------

USERS, ITEMS = 40, 90
RETRIEVAL_PLAN = ShardingPlan({"embeddings": {"users": data_parallel(), "items": row_wise()}})


def _sessions(**kw) -> SyntheticSessions:
    return SyntheticSessions(batch_size=8, num_users=USERS, num_items=ITEMS, num_clusters=6, max_history=5, **kw)


def _retrieval(**kw) -> TwoTowerRetrieval:
    torch.manual_seed(0)
    return TwoTowerRetrieval(num_users=USERS, num_items=ITEMS, embedding_dim=DIM, max_history=4, tower_sizes=[8], **kw)


def _retrieval_job(rank: int, ws: int) -> dict:
    model = _retrieval(plan=RETRIEVAL_PLAN)
    trainer = _trainer(devices=ws, strategy=RecShardedStrategy(embedding_grad="mean"), limit_val_batches=2)
    trainer.fit(
        model,
        train_dataloaders=torch.utils.data.DataLoader(_sessions(num_batches=2 * STEPS), batch_size=None),
        val_dataloaders=torch.utils.data.DataLoader(_sessions(num_batches=4, seed=1), batch_size=None),
    )
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if n.startswith("embeddings.")}
    return {
        "state": full_state_dict(model),
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "shapes": shapes,
    }


@pytest.mark.slow
def test_retrieval_sharded_matches_single_process() -> None:
    results = run_distributed(_retrieval_job, 2, init_process_group=False, timeout_s=240)
    # the reference: each rank's loss is over its own in-batch negatives, so one process averages the
    # per-rank losses (what DDP and embedding_grad="mean" do to the gradients)
    ref = _retrieval()
    opt = ref.configure_optimizers()
    ranks = [list(_sessions(num_batches=2 * STEPS, rank=r, world_size=2)) for r in range(2)]
    for step in range(STEPS):
        opt.zero_grad()
        torch.stack([ref.loss(ranks[r][step]) for r in range(2)]).mean().backward()
        opt.step()
    want = ref.state_dict()
    for k in want:
        torch.testing.assert_close(
            results[0]["state"][k], want[k], atol=1e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}"
        )
    items = "embeddings.embeddings.items.weight"
    assert not torch.equal(want[items], _retrieval().state_dict()[items]), "the sequence table must have trained"
    # items row-wise: 45 rows each; users replicated
    assert results[1]["shapes"] == {
        "embeddings.embeddings.users.weight": (USERS, DIM),
        "embeddings.embeddings.items.weight": (ITEMS // 2, DIM),
    }
    assert results[0]["metrics"]["val_recall"] == results[1]["metrics"]["val_recall"]


def test_retrieval_learns_from_history() -> None:
    # one process: recall@3 among 8 in-batch candidates is 3/8 by chance; the clusters make it learnable
    model = _retrieval(lr=0.01, embedding_lr=0.1, recall_k=3)
    opt = model.configure_optimizers()
    for kjt in _sessions(num_batches=300):
        opt.zero_grad()
        model.loss(kjt).backward()
        opt.step()
    hits = []
    with torch.no_grad():
        for kjt in _sessions(num_batches=50, seed=7):
            s = model.scores(kjt)
            hits.append(((s > s.diagonal().unsqueeze(1)).sum(1) < 3).float().mean())
    assert float(torch.stack(hits).mean()) > 0.6


def test_sessions_are_deterministic_and_split_over_ranks() -> None:
    a, b = list(_sessions(num_batches=5)), list(_sessions(num_batches=5))
    assert all(torch.equal(x.values(), y.values()) and torch.equal(x.lengths(), y.lengths()) for x, y in zip(a, b))
    r0, r1 = list(_sessions(num_batches=5, rank=0, world_size=2)), list(_sessions(num_batches=5, rank=1, world_size=2))
    assert len(r0) == len(r1) == 2  # the fifth batch is dropped: every rank runs the same number of steps
    assert [torch.equal(x.values(), y.values()) for x, y in zip(r0 + r1, [a[0], a[2], a[1], a[3]])] == [True] * 4
    kjt = copy.copy(a[0])
    with pytest.raises(ValueError, match="feature 'candidate' must have exactly one id per sample; sample 0 has 2"):
        lengths = kjt.lengths().clone()
        lengths[16] = 2
        _retrieval()(KeyedJaggedTensor(kjt.keys(), torch.cat([kjt.values(), torch.tensor([0])]), lengths=lengths))


# -- the main job (examples/dlrm.py) end to end -------------------------------------------------------------

TINY = """
trainer:
  default_root_dir: {root}
  logger: false
  val_check_interval: 1.0
  callbacks:
    - class_path: lightning_rec.lightning.callbacks.ShardingSummary
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: {root}/checkpoints, filename: dlrm-final}}
model:
  embedding_dim: 8
  dense_arch_layer_sizes: [32, 8]
  over_arch_layer_sizes: [32, 1]
data:
  batch_size: 256
  train_rows: 16384
  val_rows: 4096
  size: 0.0001
"""


def _example_job(rank: int, ws: int, config: str, *more: str) -> dict:
    import contextlib
    import io
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import dlrm

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        metrics = dlrm.main(["--config", config, *more])
    return {"metrics": metrics, "stdout": out.getvalue()}


@pytest.mark.slow
def test_main_job_learns_on_two_processes(tmp_path) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY.format(root=tmp_path))
    r0, r1 = run_distributed(_example_job, 2, str(config), init_process_group=False, timeout_s=300)
    assert r0["metrics"]["val_auroc"] > 0.6, r0["metrics"]
    assert r0["metrics"]["val_auroc"] == r1["metrics"]["val_auroc"]  # synced over ranks
    assert 0 < r0["metrics"]["val_ne"] < 1, "NE below 1: better than predicting the base rate"
    final = [line for line in r0["stdout"].splitlines() if line.startswith("final: ")]
    assert final and f"val AUC {r0['metrics']['val_auroc']:.4f}" in final[-1] and "achievable AUC" in final[-1]
    assert not [line for line in r1["stdout"].splitlines() if line.startswith("final: ")]  # rank 0 prints it
    assert (tmp_path / "checkpoints" / "dlrm-final.ckpt").exists()


def test_main_job_takes_the_hand_written_mixed_plan(tmp_path) -> None:
    """examples/plan_mixed_1gpu.yaml (the plan of the GPU run) stays valid and is the plan the job trains with."""
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY.format(root=tmp_path))
    mixed = str(Path(__file__).resolve().parents[2] / "examples" / "plan_mixed_1gpu.yaml")
    # the tiny sizes on top of the mixed plan (a later --config wins where both set a key)
    (r,) = run_distributed(_summary_job, 1, mixed, "--config", str(config), init_process_group=False, timeout_s=300)
    assert r["metrics"]["val_auroc"] > 0.55, r["metrics"]
    # the plan was the file's, for all 26 tables; on one process a row-, column- or table-row-wise table is one
    # shard, which the summary labels as table-wise
    assert r["summary"].count("[fixed]") == 26, r["summary"]
    assert "data_parallel" in r["summary"] and "table_wise" in r["summary"]


def _summary_job(rank: int, ws: int, *args: str) -> dict:
    """The main job's metrics and what ShardingSummary logged (Lightning's rank-zero logger)."""
    import logging

    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(handler)
    try:
        out = _example_job(rank, ws, *args)
    finally:
        logger.removeHandler(handler)
    return {"metrics": out["metrics"], "summary": "\n".join(m for m in logged if "Sharding summary" in m)}
