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
from tests.lightning.models import QUIET_TRAINER, ClickModule

STEPS = 4


def _trainer(**kw) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        **QUIET_TRAINER,
        limit_val_batches=2,
        **kw,
    )


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
    return {
        "state": state if rank == 0 else None,
        "params": names,
        "mesh": tuple(mesh.shape),
        "loss": train_loss,
        "val": val_loss,
    }


def _reference(ws: int) -> dict:
    model = ClickModule(batch_size=4 * ws)
    _trainer(devices=1, strategy="auto").fit(model)
    return model.state_dict()


PLAN = ShardingPlan({"ebc": {"user": row_wise(), "item": table_wise(rank=1), "geo": data_parallel()}})


@pytest.mark.parametrize(
    "ws, mp, plan", [(2, 2, PLAN), (2, 2, None), (4, 2, PLAN)], ids=["2procs-plan", "2procs-auto", "2x2-replicas"]
)
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
        from lightning_rec.plans.mesh import check_layout

        check_layout(4, 2, 3)


def _two_node_job(rank: int, ws: int) -> dict:
    import os

    plan = ShardingPlan(
        {"ebc": {"user": table_row_wise(host_index=1), "item": grid_shard(host_indexes=[0, 1]), "geo": data_parallel()}}
    )
    model = ClickModule(batch_size=4, plan=plan)
    strategy = RecShardedStrategy(model_parallel_size=4, embedding_grad="mean")
    trainer = _trainer(devices=2, num_nodes=2, strategy=strategy, use_distributed_sampler=False)
    trainer.fit(model)
    state = full_state_dict(model)
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    return {
        "node": int(os.environ["NODE_RANK"]),
        "rank": trainer.global_rank,
        "shapes": shapes,
        "state": state if rank == 0 else None,
    }


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


def _two_node_2d_job(rank: int, ws: int, within: bool | str, plan: ShardingPlan | None, ckpt_dir: str) -> dict:
    import torch.distributed as dist

    model = ClickModule(batch_size=4, plan=plan)
    strategy = RecShardedStrategy(
        model_parallel_size=2,
        data_parallel_size=2,
        embedding_grad="mean",
        replicas_within_host=within,
        planner_host_link="1gbit",
    )
    trainer = _trainer(devices=2, num_nodes=2, strategy=strategy, use_distributed_sampler=False)
    trainer.fit(model)
    mesh = strategy.mesh_info
    assert mesh is not None and model.device_mesh is mesh.mesh
    state = full_state_dict(model)  # collective
    trainer.save_checkpoint(ckpt_dir)
    return {
        "state": state if rank == 0 else None,
        "within": mesh.replicas_within_host,
        "shard_group": dist.get_process_group_ranks(mesh.shard_group),
        "replica_group": dist.get_process_group_ranks(mesh.replica_group),
        "planner_within": None if strategy.planner is None else strategy.planner.topology.replicas_within_host,
    }


@pytest.mark.parametrize("within, plan", [(True, PLAN), ("auto", None)], ids=["replicas-within-node", "auto"])
def test_two_nodes_2d_in_either_arrangement_match_single_process(tmp_path, within: bool | str, plan) -> None:
    from lightning_rec import checkpoint as ckpt
    from lightning_rec.plans.planner import choose_arrangement

    path = str(tmp_path / "ckpt")
    results = run_distributed(
        _two_node_2d_job, 4, within, plan, path, init_process_group=False, ranks_per_node=2, timeout_s=300
    )
    want = _reference(4)
    one = ClickModule(batch_size=4)
    ckpt.load(path, one, [])  # the checkpoint the arrangement wrote, into one process
    for k in want:
        torch.testing.assert_close(results[0]["state"][k], want[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
        torch.testing.assert_close(one.state_dict()[k], want[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
    if within is True:
        expected = True
    else:  # what the planner estimates faster for this module, as the strategy asked it
        pick = choose_arrangement(ClickModule(batch_size=4), 2, 4, 2, batch_size=4, device="cpu", host_link="1gbit")
        expected = pick.replicas_within_host
        assert all(r["planner_within"] == expected for r in results)
    for rank, r in enumerate(results):
        assert r["within"] == expected
        node = rank // 2
        if expected:  # each node holds a replica group; each shard group one rank per node
            assert r["replica_group"] == [2 * node, 2 * node + 1] and r["shard_group"] == [rank % 2, rank % 2 + 2]
        else:
            assert r["shard_group"] == [2 * node, 2 * node + 1] and r["replica_group"] == [rank % 2, rank % 2 + 2]


def test_replicas_within_host_is_checked() -> None:
    with pytest.raises(ValueError, match="replicas_within_host must be False, True or 'auto', got 'yes'"):
        RecShardedStrategy(replicas_within_host="yes")
    with pytest.raises(ValueError, match="planner_host_link: expected a speed such as 1gbit"):
        RecShardedStrategy(planner_host_link="fast")


def _fused_fit_job(rank: int, ws: int, mode: str, mp: int | None = None, plan: ShardingPlan | None = None) -> dict:
    from lightning_rec import CombinedOptimizer

    plan = plan or ShardingPlan({"ebc": {"user": row_wise(), "item": table_wise(rank=1), "geo": table_wise(rank=0)}})
    model = ClickModule(batch_size=4, plan=plan)
    if mode == "scheduled":

        def configure_optimizers():
            opt = CombinedOptimizer([torch.optim.SGD(model.head.parameters(), lr=0.2), model.fused_optimizer()])
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        model.configure_optimizers = configure_optimizers
    strategy = RecShardedStrategy(
        model_parallel_size=mp, embedding_grad="mean", embedding_optimizer={"kind": "sgd", "lr": 0.2}
    )
    trainer = _trainer(
        devices=ws, strategy=strategy, use_distributed_sampler=False, gradient_clip_val=1.0 if mode == "clip" else None
    )
    try:
        trainer.fit(model)
    except ValueError as e:
        return {"error": str(e)}
    state = full_state_dict(model)
    kernel_lrs = [k.get_learning_rate() for m in model.modules() for k in getattr(m, "fused_kernels", list)()]
    tables = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("ebc.")}
    return {
        "state": state if rank == 0 else None,
        "kernel_lrs": kernel_lrs,
        "tables": tables,
        "requires_grad": [n for n, p in model.named_parameters() if p.requires_grad],
    }


@pytest.mark.parametrize("ws, mp, plan", [(2, None, None), (4, 2, PLAN)], ids=["2procs", "2x2-replicas-with-dp-table"])
def test_fused_embedding_optimizer_matches_single_process(ws: int, mp: int | None, plan) -> None:
    results = run_distributed(_fused_fit_job, ws, "plain", mp, plan, init_process_group=False, timeout_s=300)
    want = _reference(ws)  # torch SGD (lr 0.2) on every parameter, one process
    for k in want:
        torch.testing.assert_close(results[0]["state"][k], want[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
    for r in results:  # tables are updated by the kernel: no autograd gradient, only the dense head trains by DDP
        assert r["requires_grad"] == ["head.weight", "head.bias"]
    # replicas (same shard rank in each replica group; every rank for the data-parallel table) hold equal bits
    group = mp or ws
    for rank, r in enumerate(results):
        peer = results[rank % group]
        assert r["tables"].keys() == peer["tables"].keys()
        assert all(torch.equal(v, peer["tables"][n]) for n, v in r["tables"].items()), rank
        if plan is PLAN:
            assert torch.equal(
                r["tables"]["ebc.embedding_bags.geo.weight"], results[0]["tables"]["ebc.embedding_bags.geo.weight"]
            )


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


def test_fused_refuses_gradient_clipping() -> None:
    for r in run_distributed(_fused_fit_job, 2, "clip", init_process_group=False, timeout_s=240):
        assert "gradient_clip_val=1.0" in r["error"] and "never hold a gradient" in r["error"]


def _mixed_job(rank: int, ws: int, precision: str) -> dict:
    from lightning.pytorch.plugins import MixedPrecision

    model = ClickModule(batch_size=4, plan=PLAN)
    # fp16 autocast on CPU needs the plugin spelled out: Trainer(precision="16-mixed") swaps in bf16 there
    kw = {"plugins": [MixedPrecision("16-mixed", "cpu")]} if precision == "16-mixed" else {"precision": precision}
    trainer = _trainer(
        devices=ws, strategy=RecShardedStrategy(embedding_grad="mean"), use_distributed_sampler=False, **kw
    )
    trainer.fit(model)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return {
        "dtypes": {n: str(p.dtype) for n, p in model.named_parameters()},
        "precision": trainer.precision,
        "scaler": scaler is not None,
        "leaf": all(p.is_leaf for p in model.parameters()),
        "state": full_state_dict(model),
    }


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_keeps_fp32_tables_and_trains(precision: str) -> None:
    results = run_distributed(_mixed_job, 2, precision, init_process_group=False, timeout_s=240)
    want = _reference(2)
    for r in results:
        assert set(r["dtypes"].values()) == {"torch.float32"} and r["leaf"]
        assert r["precision"] == precision and r["scaler"] == (precision == "16-mixed")  # fp16: a GradScaler
    for k in want:  # autocast computes the head in bf16 / fp16: equal to the fp32 run within that precision
        torch.testing.assert_close(results[0]["state"][k], want[k], atol=2e-2, rtol=0, msg=lambda m: f"{k}: {m}")


def test_16_mixed_flag_on_cpu_is_bf16_and_fused_refuses_loss_scaling() -> None:
    from lightning.pytorch.plugins import MixedPrecision

    # Lightning 2.6 maps Trainer(accelerator="cpu", precision="16-mixed") to bf16-mixed, with a warning
    with pytest.warns(UserWarning, match="AMP with fp16 is not supported on CPU. Using `precision='bf16-mixed'`"):
        trainer = L.Trainer(
            strategy=RecShardedStrategy(), accelerator="cpu", devices=1, precision="16-mixed", logger=False
        )
    assert trainer.precision == "bf16-mixed"
    # a GradScaler would hand the fused kernel the scaled gradient: refused before anything runs
    trainer = L.Trainer(
        strategy=RecShardedStrategy(embedding_optimizer={"kind": "sgd", "lr": 0.1}),
        accelerator="cpu",
        devices=1,
        plugins=[MixedPrecision("16-mixed", "cpu")],
        logger=False,
    )
    with pytest.raises(ValueError, match="scales the loss with a GradScaler.*updated inside backward with the scaled"):
        trainer.strategy._check_fused_trainer(trainer)


def _uneven_job(rank: int, ws: int) -> list[str]:
    from datetime import timedelta

    from torch.utils.data import DataLoader

    from tests.lightning.models import Clicks, collate

    errors = []
    for stage in ("validate", "fit"):
        model = ClickModule(batch_size=4)
        n_train, n_val = (16, 4 * (2 + rank)) if stage == "validate" else (4 * (3 + rank), 8)
        model.train_dataloader = lambda n=n_train: DataLoader(Clicks(n), batch_size=4, collate_fn=collate)
        model.val_dataloader = lambda n=n_val: DataLoader(Clicks(n), batch_size=4, collate_fn=collate)
        # a short collective timeout: without the check, the rank with an extra batch would wait this long
        trainer = L.Trainer(
            accelerator="cpu",
            devices=ws,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
            strategy=RecShardedStrategy(timeout=timedelta(seconds=60)),
        )
        try:
            getattr(trainer, stage)(model)
            errors.append("")
        except ValueError as e:
            errors.append(str(e))
    return errors


@pytest.mark.slow
def test_ranks_with_different_batch_counts_get_a_clear_error_not_a_hang() -> None:
    # rank 0 has 2 validation / 3 training batches, rank 1 one more of each (no distributed sampler);
    # evaluation joins the longer rank's lookups (tests/lightning/test_user_paths.py), training refuses
    for errors in run_distributed(_uneven_job, 2, init_process_group=False, timeout_s=120):
        val, train = errors
        assert val == "", val
        assert "different numbers of training batches per epoch (by rank: [3, 4])" in train, train
        assert "use_distributed_sampler=True" in train


def _bf16_true_job(rank: int, ws: int) -> dict:
    model = ClickModule(batch_size=4, plan=PLAN)
    trainer = _trainer(
        devices=ws,
        strategy=RecShardedStrategy(embedding_grad="mean"),
        precision="bf16-true",
        use_distributed_sampler=False,
    )
    trainer.fit(model)
    return {
        "dtypes": {n: str(p.dtype) for n, p in model.named_parameters()},
        "shared": all(
            v.data_ptr() == dict(model.named_parameters())[k].data_ptr()
            for k, v in model.state_dict().items()
            if k.startswith("head")
        ),
    }


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
        _kjt, y = batch
        model.seen.update(torch.ones_like(y))
        model.log("seen", model.seen, on_epoch=True)

    model.validation_step = validation_step
    trainer = _trainer(devices=ws, strategy=RecShardedStrategy(), use_distributed_sampler=False)
    trainer.validate(model)
    return {"seen": float(trainer.callback_metrics["seen"])}


def test_torchmetrics_sync_across_ranks() -> None:
    # each rank validates 2 batches of 4 samples; the metric is reduced over both ranks
    assert [r["seen"] for r in run_distributed(_metrics_job, 2, init_process_group=False, timeout_s=240)] == [
        16.0,
        16.0,
    ]
