"""Trainer(strategy="rec_sharded") on real CPU processes vs the same module on one process."""

from __future__ import annotations

import lightning as L
import pytest
import torch

import lightning_rec
from lightning_rec import (
    RecShardedStrategy,
    ShardingPlan,
    data_parallel,
    full_state_dict,
    grid_shard,
    row_wise,
    table_row_wise,
    table_wise,
)
from lightning_rec.testing import run_distributed
from tests.lightning.models import ClickModule

STEPS = 4


def _trainer(**kw) -> L.Trainer:
    return L.Trainer(accelerator="cpu", max_steps=STEPS, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     limit_val_batches=2, **kw)


def _fit_job(rank: int, ws: int, mp: int, plan: ShardingPlan | None) -> dict:
    model = ClickModule(batch_size=4, plan=plan)
    strategy = RecShardedStrategy(model_parallel_size=mp, embedding_grad="mean")
    trainer = _trainer(devices=ws, strategy=strategy, use_distributed_sampler=False)
    trainer.fit(model)
    train_loss = float(trainer.callback_metrics["train_loss"])
    state = full_state_dict(model)
    trainer.validate(model)  # evaluation after fit: same shards, no weight changes
    val_loss = float(trainer.callback_metrics["val_loss"])
    trainer.test(model)
    preds = trainer.predict(model)
    after = full_state_dict(model)
    assert all(torch.equal(after[k], state[k]) for k in state), "evaluation changed weights"
    assert len(preds) == 4 and all(p.shape == (4,) for p in preds)
    names = [n for n, _ in model.named_parameters()]
    mesh = model.device_mesh
    return {"state": state if rank == 0 else None, "params": names, "mesh": tuple(mesh.shape),
            "loss": train_loss, "val": val_loss}


def _reference(ws: int) -> dict:
    model = ClickModule(batch_size=4 * ws)
    _trainer(devices=1, strategy="auto").fit(model)
    return model.state_dict()


PLAN = ShardingPlan({"ebc": {"user": row_wise(), "item": table_wise(rank=1), "geo": data_parallel()}})


@pytest.mark.parametrize("ws, mp, plan", [(2, 2, PLAN), (2, 2, None), (4, 2, PLAN)],
                         ids=["2procs-plan", "2procs-auto", "2x2-replicas"])
def test_trainer_fit_matches_single_process(ws: int, mp: int, plan) -> None:
    results = run_distributed(_fit_job, ws, mp, plan, init_process_group=False, timeout_s=240)
    want = _reference(ws)
    got = results[0]["state"]
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
    assert results[0]["mesh"] == (ws // mp, mp)
    if plan is PLAN and ws == 2:
        # the plan put "item" on shard rank 1 only
        assert "ebc.embedding_bags.item.weight" not in results[0]["params"]
        assert "ebc.embedding_bags.item.weight" in results[1]["params"]
    # sync_dist logging reduced over ranks: every rank reports the same value
    assert len({r["loss"] for r in results}) == 1 and len({r["val"] for r in results}) == 1


def test_registered_name_and_errors() -> None:
    assert "rec_sharded" in L.pytorch.strategies.StrategyRegistry
    lightning_rec._register()  # registering twice is harmless
    with pytest.raises(ValueError, match="start_method='popen'"):
        RecShardedStrategy(start_method="spawn")
    with pytest.raises(ValueError, match="embedding_grad"):
        RecShardedStrategy(embedding_grad="avg")
    with pytest.raises(ValueError, match=r"data_parallel_size \(3\) x model_parallel_size \(2\) != world size \(4\)"):
        from lightning_rec.sharding.mesh import check_layout

        check_layout(4, 2, 3)


def _checkpoint_job(rank: int, ws: int, path: str, optimizer: str) -> dict:
    model = ClickModule(batch_size=4, plan=PLAN)
    if optimizer == "adagrad":
        model.configure_optimizers = lambda: torch.optim.Adagrad(model.parameters(), lr=0.1)
    trainer = _trainer(devices=ws, strategy=RecShardedStrategy(embedding_grad="mean"), use_distributed_sampler=False)
    trainer.fit(model)
    try:
        trainer.save_checkpoint(path)
    except ValueError as e:
        return {"error": str(e)}
    state = full_state_dict(model)  # collective: every rank calls it
    return {"state": state if rank == 0 else None}


def test_checkpoint_holds_full_tables_and_loads_into_one_process(tmp_path) -> None:
    path = str(tmp_path / "model.ckpt")
    results = run_distributed(_checkpoint_job, 2, path, "sgd", init_process_group=False, timeout_s=240)
    ckpt = torch.load(path, weights_only=False)
    single = ClickModule()
    single.load_state_dict(ckpt["state_dict"])
    for k, v in single.state_dict().items():
        assert torch.equal(v, results[0]["state"][k]), k


def test_checkpoint_refuses_to_drop_sharded_optimizer_state(tmp_path) -> None:
    results = run_distributed(_checkpoint_job, 2, str(tmp_path / "m.ckpt"), "adagrad", init_process_group=False,
                              timeout_s=240)
    assert "sharded embedding parameter 'ebc.embedding_bags.user.weight'" in results[0]["error"]


def _two_node_job(rank: int, ws: int) -> dict:
    import os

    plan = ShardingPlan({"ebc": {"user": table_row_wise(host_index=1), "item": grid_shard(host_indexes=[0, 1]),
                                 "geo": data_parallel()}})
    model = ClickModule(batch_size=4, plan=plan)
    strategy = RecShardedStrategy(model_parallel_size=4, embedding_grad="mean")
    trainer = _trainer(devices=2, num_nodes=2, strategy=strategy, use_distributed_sampler=False)
    trainer.fit(model)
    state = full_state_dict(model)
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    return {"node": int(os.environ["NODE_RANK"]), "rank": trainer.global_rank, "shapes": shapes,
            "state": state if rank == 0 else None}


def test_two_nodes_place_host_shards_on_the_right_hosts() -> None:
    results = run_distributed(_two_node_job, 4, init_process_group=False, ranks_per_node=2, timeout_s=300)
    for r in results:
        user = r["shapes"].get("ebc.embedding_bags.user.weight")
        # table_row_wise(host_index=1): rows split over node 1's ranks only
        assert (user is not None) == (r["node"] == 1), r
        # grid over hosts [0, 1]: column block 0 on node 0, block 1 on node 1, each row-split in its host
        assert r["shapes"]["ebc.embedding_bags.item.weight"] == [7 if r["rank"] % 2 == 0 else 6, 2]
    want = _reference(4)
    for k in want:
        torch.testing.assert_close(results[0]["state"][k], want[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")


def _fused_fit_job(rank: int, ws: int, mode: str) -> dict:
    from lightning_rec import CombinedOptimizer

    plan = ShardingPlan({"ebc": {"user": row_wise(), "item": table_wise(rank=1), "geo": table_wise(rank=0)}})
    model = ClickModule(batch_size=4, plan=plan)
    if mode == "scheduled":
        def configure_optimizers():
            opt = CombinedOptimizer([torch.optim.SGD(model.head.parameters(), lr=0.2), model.fused_optimizer()])
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        model.configure_optimizers = configure_optimizers
    strategy = RecShardedStrategy(embedding_grad="mean", embedding_optimizer={"kind": "sgd", "lr": 0.2})
    trainer = _trainer(devices=ws, strategy=strategy, use_distributed_sampler=False,
                       accumulate_grad_batches=2 if mode == "accumulate" else 1,
                       gradient_clip_val=1.0 if mode == "clip" else None)
    try:
        trainer.fit(model)
    except ValueError as e:
        return {"error": str(e)}
    state = full_state_dict(model)
    kernel_lrs = [m._fused.get_learning_rate() for m in model.modules() if getattr(m, "_fused", None) is not None]
    return {"state": state if rank == 0 else None, "kernel_lrs": kernel_lrs,
            "requires_grad": [n for n, p in model.named_parameters() if p.requires_grad]}


def test_fused_embedding_optimizer_matches_single_process() -> None:
    results = run_distributed(_fused_fit_job, 2, "plain", init_process_group=False, timeout_s=240)
    want = _reference(2)  # torch SGD (lr 0.2) on every parameter, one process
    for k in want:
        torch.testing.assert_close(results[0]["state"][k], want[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
    for r in results:  # tables are updated by the kernel: no autograd gradient, only the dense head trains by DDP
        assert r["requires_grad"] == ["head.weight", "head.bias"]


def test_lr_scheduler_drives_the_fused_kernel() -> None:
    results = run_distributed(_fused_fit_job, 2, "scheduled", init_process_group=False, timeout_s=240)
    # the same schedule on one process, torch SGD on every parameter: the kernel really used each lr
    ref = ClickModule(batch_size=8)

    def configure_optimizers():
        opt = torch.optim.SGD(ref.parameters(), lr=0.2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    ref.configure_optimizers = configure_optimizers
    _trainer(devices=1, strategy="auto").fit(ref)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(results[0]["state"][k], v, atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
    for r in results:
        # the kernel reads its group's lr at each lookup: 4 steps used 0.2, 0.1, 0.05, 0.025 and the scheduler
        # has since set 0.0125, which the kernel reports
        assert r["kernel_lrs"] and all(lr == pytest.approx(0.2 * 0.5**STEPS) for lr in r["kernel_lrs"]), r


def test_fused_refuses_gradient_accumulation() -> None:
    for r in run_distributed(_fused_fit_job, 2, "accumulate", init_process_group=False, timeout_s=240):
        assert "accumulate_grad_batches=2" in r["error"] and "inside each backward" in r["error"]


def test_fused_refuses_gradient_clipping() -> None:
    for r in run_distributed(_fused_fit_job, 2, "clip", init_process_group=False, timeout_s=240):
        assert "gradient_clip_val=1.0" in r["error"] and "never hold a gradient" in r["error"]


def _bf16_mixed_job(rank: int, ws: int) -> dict:
    model = ClickModule(batch_size=4, plan=PLAN)
    trainer = _trainer(devices=ws, strategy=RecShardedStrategy(embedding_grad="mean"), precision="bf16-mixed",
                       use_distributed_sampler=False)
    trainer.fit(model)
    return {"dtypes": {n: str(p.dtype) for n, p in model.named_parameters()},
            "leaf": all(p.is_leaf for p in model.parameters()), "state": full_state_dict(model)}


def test_bf16_mixed_keeps_fp32_tables_and_trains() -> None:
    results = run_distributed(_bf16_mixed_job, 2, init_process_group=False, timeout_s=240)
    want = _reference(2)
    for r in results:
        assert set(r["dtypes"].values()) == {"torch.float32"} and r["leaf"]
    for k in want:  # autocast computes the head in bf16: equal to the fp32 run within bf16 precision
        torch.testing.assert_close(results[0]["state"][k], want[k], atol=2e-2, rtol=0, msg=lambda m: f"{k}: {m}")


def _bf16_true_job(rank: int, ws: int) -> dict:
    model = ClickModule(batch_size=4, plan=PLAN)
    trainer = _trainer(devices=ws, strategy=RecShardedStrategy(embedding_grad="mean"), precision="bf16-true",
                       use_distributed_sampler=False)
    trainer.fit(model)
    return {"dtypes": {n: str(p.dtype) for n, p in model.named_parameters()},
            "shared": all(v.data_ptr() == dict(model.named_parameters())[k].data_ptr()
                          for k, v in model.state_dict().items() if k.startswith("head"))}


def test_bf16_true_converts_dense_but_tables_keep_their_config_dtype() -> None:
    for r in run_distributed(_bf16_true_job, 2, init_process_group=False, timeout_s=240):
        tables = {d for n, d in r["dtypes"].items() if n.startswith("ebc.")}
        assert tables == {"torch.float32"}, r["dtypes"]
        assert r["dtypes"]["head.weight"] == "torch.bfloat16" and r["shared"]


def _metrics_job(rank: int, ws: int) -> dict:
    import torchmetrics

    model = ClickModule(batch_size=4, plan=PLAN)
    model.seen = torchmetrics.SumMetric()

    def validation_step(batch, batch_idx=0):
        kjt, y = batch
        model.seen.update(torch.ones_like(y))
        model.log("seen", model.seen, on_epoch=True)

    model.validation_step = validation_step
    trainer = _trainer(devices=ws, strategy=RecShardedStrategy(), use_distributed_sampler=False)
    trainer.validate(model)
    return {"seen": float(trainer.callback_metrics["seen"])}


def test_torchmetrics_sync_across_ranks() -> None:
    # each rank validates 2 batches of 4 samples; the metric is reduced over both ranks
    assert [r["seen"] for r in run_distributed(_metrics_job, 2, init_process_group=False, timeout_s=240)] == [16.0, 16.0]
