"""Fabric(strategy="rec_sharded"): a hand-written loop trains like one process, and its checkpoints resume under
the Trainer (and the Trainer's under Fabric) at other world sizes and plans."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, Dataset

from lightning_rec import (
    RecShardedFabricStrategy,
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
from lightning_rec.distributed import RowWiseAdagrad
from lightning_rec.testing import run_distributed
from tests.lightning.models import KEYS, QUIET_TRAINER, ClickModule, Clicks, collate

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks
LR = 0.2
MIXED = ShardingPlan({"ebc": {"user": row_wise(), "item": table_wise(rank=1), "geo": data_parallel()}})
OTHERS = ShardingPlan({"ebc": {"user": column_wise([0, 1]), "item": table_row_wise(0), "geo": grid_shard([0])}})


def _batch(step: int, ws: int, rank: int):
    """Rank ``rank``'s share of global batch ``step`` (every ``ws``-th sample of the global batch)."""
    ids = range(step * GLOBAL_BATCH + rank, (step + 1) * GLOBAL_BATCH, ws)
    clicks = Clicks(10_000)
    return collate([clicks[i] for i in ids])


def _loss(model, batch):
    kjt, y = batch
    return torch.nn.functional.binary_cross_entropy_with_logits(model(kjt), y)


def _torch_optimizer(kind: str, params):
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=LR)
    return torch.optim.SGD(params, lr=LR)


def _reference(steps: int, kind: str, clip: float | None = None, fused: str | None = None) -> dict:
    """One process, unsharded, on the global batches."""
    model = ClickModule()
    tables = [p for n, p in model.named_parameters() if n.startswith("ebc.")]
    dense = [p for n, p in model.named_parameters() if not n.startswith("ebc.")]
    opts = [_torch_optimizer(kind, dense)]
    rowwise = fused == "rowwise_adagrad"  # the fused spec's eps
    opts.append(RowWiseAdagrad(tables, lr=LR, eps=1e-8) if rowwise else _torch_optimizer(kind, tables))
    for s in range(steps):
        _loss(model, _batch(s, 1, 0)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for o in opts:
            o.step()
            o.zero_grad()
    return model.state_dict()


def _fabric(ws: int, **kw) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=ws, strategy=RecShardedFabricStrategy(embedding_grad="mean", **kw))
    fabric.launch()
    return fabric


def _train(fabric: Fabric, model, opt, start: int, steps: int, clip: float | None = None) -> None:
    for s in range(start, start + steps):
        fabric.backward(_loss(model, _batch(s, fabric.world_size, fabric.global_rank)))
        if clip:
            fabric.clip_gradients(model, opt, max_norm=clip)
        opt.step()
        opt.zero_grad()


CASES = [  # plan, optimizer kind, clipping, fused kind
    (MIXED, "sgd", None, None),
    (OTHERS, "adagrad", 0.05, None),
    (MIXED, "sgd", None, "sgd"),
    (MIXED, "sgd", None, "rowwise_adagrad"),
]


def _equivalence_job(rank: int, ws: int) -> list[dict]:
    out = []
    for plan, kind, clip, fused in CASES:
        spec = None if fused is None else {"kind": fused, "lr": LR}
        fabric = _fabric(ws, plan=plan, embedding_optimizer=spec)
        model = fabric.setup_module(ClickModule())
        opt = fabric.setup_optimizers(_torch_optimizer(kind, model.parameters()))
        _train(fabric, model, opt, 0, 3, clip)
        out.append(full_state_dict(model))
    return out


def test_fabric_loop_equals_one_process() -> None:
    results = run_distributed(_equivalence_job, 2, init_process_group=False, timeout_s=300)
    for (_, kind, clip, fused), got in zip(CASES, results[0]):
        want = _reference(3, kind, clip, fused)
        before = ClickModule().state_dict()
        assert set(got) == set(want)
        for k in want:
            torch.testing.assert_close(
                got[k], want[k], atol=1e-5, rtol=0, msg=lambda m: f"{kind} clip={clip} fused={fused} {k}: {m}"
            )
            assert not torch.equal(got[k], before[k]), f"{k} did not train"


def _two_node_2d_job(rank: int, ws: int) -> dict:
    import torch.distributed as dist

    strategy = RecShardedFabricStrategy(
        embedding_grad="mean", plan=MIXED, model_parallel_size=2, data_parallel_size=2, replicas_within_host=True
    )
    fabric = Fabric(accelerator="cpu", devices=2, num_nodes=2, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(ClickModule())
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))
    _train(fabric, model, opt, 0, 3)
    mesh = strategy.mesh_info
    assert mesh is not None
    return {
        "state": full_state_dict(model),
        "shard_group": dist.get_process_group_ranks(mesh.shard_group),
        "replica_group": dist.get_process_group_ranks(mesh.replica_group),
    }


def test_fabric_2d_with_replicas_within_each_node_equals_one_process() -> None:
    results = run_distributed(_two_node_2d_job, 4, init_process_group=False, ranks_per_node=2, timeout_s=300)
    want = _reference(3, "sgd")
    for k in want:
        torch.testing.assert_close(results[0]["state"][k], want[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
    for rank, r in enumerate(results):
        node = rank // 2
        assert r["replica_group"] == [2 * node, 2 * node + 1] and r["shard_group"] == [rank % 2, rank % 2 + 2]


def _accumulate_job(rank: int, ws: int, fused: str) -> dict:
    fabric = _fabric(ws, plan=MIXED, embedding_optimizer={"kind": fused, "lr": LR})
    model = fabric.setup_module(ClickModule())
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))
    for s in range(2):  # two steps of two micro-batches: global batches 2s and 2s + 1
        for micro in (2 * s, 2 * s + 1):
            with fabric.no_backward_sync(model, enabled=micro % 2 == 0):
                fabric.backward(_loss(model, _batch(micro, ws, rank)) / 2)
        opt.step()
        opt.zero_grad()
    return full_state_dict(model)


@pytest.mark.parametrize("fused", ["sgd", "rowwise_adagrad"])
def test_accumulation_under_no_backward_sync_with_a_fused_optimizer(fused: str) -> None:
    got = run_distributed(_accumulate_job, 2, fused, init_process_group=False, timeout_s=240)[0]
    model = ClickModule()
    tables = [p for n, p in model.named_parameters() if n.startswith("ebc.")]
    dense = [p for n, p in model.named_parameters() if not n.startswith("ebc.")]
    opts = [
        torch.optim.SGD(dense, lr=LR),
        RowWiseAdagrad(tables, lr=LR, eps=1e-8) if fused == "rowwise_adagrad" else torch.optim.SGD(tables, lr=LR),
    ]
    for s in range(2):
        for micro in (2 * s, 2 * s + 1):
            (_loss(model, _batch(micro, 1, 0)) / 2).backward()
        for o in opts:
            o.step()
            o.zero_grad()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(got[k], v, atol=1e-6, rtol=0, msg=lambda m: f"{fused} {k}: {m}")


def _optimizer_before_sharding_job(rank: int, ws: int, held: str) -> str:
    fabric = _fabric(ws)
    model = ClickModule()
    if held == "meta":  # a dense layer built on the meta device: set-up gives it new, initialised parameters
        model.head = torch.nn.Linear(4 * len(KEYS), 1, device="meta")
    opt = torch.optim.SGD(model.parameters() if held == "tables" else model.head.parameters(), lr=LR)
    try:
        fabric.setup(model, opt)
    except ValueError as e:
        return str(e)
    return "no error"


def _meta_dense_job(rank: int, ws: int, how: str) -> list[float]:
    fabric = _fabric(ws)
    if how == "empty_init":  # everything on the meta device
        with fabric.init_module(empty_init=True):
            model = ClickModule()
        assert model.ebc.embedding_bags["user"].weight.device.type == "meta"
    else:
        model = ClickModule()
    torch.manual_seed(rank)  # different draws per rank: DDP must make the replicas equal
    model.head = torch.nn.Linear(4 * len(KEYS), 1, device="meta")
    model = fabric.setup_module(model)
    head = model.module.head
    assert head.weight.device.type == "cpu" and bool(torch.isfinite(head.weight).all())
    assert float(head.weight.abs().sum()) > 0  # reset_parameters() drew it: not zeros, not garbage
    for p in model.module.ebc.parameters():  # this rank's shards, filled from the tables' configs
        assert p.device.type == "cpu" and bool(torch.isfinite(p).all()) and (p.numel() == 0 or float(p.abs().sum()) > 0)
    return head.weight.detach().flatten().tolist()


@pytest.mark.parametrize("how", ["head", "empty_init"])
def test_a_meta_dense_layer_is_initialised_at_set_up(how: str) -> None:
    first, second = run_distributed(_meta_dense_job, 2, how, init_process_group=False)
    assert first == second


@pytest.mark.parametrize(("held", "named"), [("tables", "ebc.embedding_bags.user.weight"), ("meta", "head.weight")])
def test_an_optimizer_built_before_sharding_is_refused(held: str, named: str) -> None:
    for msg in run_distributed(_optimizer_before_sharding_job, 2, held, init_process_group=False):
        assert "built before sharding" in msg and named in msg, msg
        assert ("meta device" in msg) == (held == "meta"), msg
        assert "fabric.setup_module(model)" in msg


# -- checkpoints across front ends --------------------------------------------------------------------------


class _Batches(Dataset):
    def __init__(self, start: int, steps: int, ws: int, rank: int) -> None:
        self.batches = [_batch(s, ws, rank) for s in range(start, start + steps)]

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int):
        return self.batches[i]


class _Resumed(ClickModule):
    """The Trainer's side: Adagrad on every parameter, fed global batches ``start..`` (the loops start at zero:
    a Fabric checkpoint holds no Lightning loop state)."""

    def __init__(self, start: int = 0, plan=None) -> None:
        super().__init__(plan=plan, lr=LR)
        self.start = start

    def training_step(self, batch, _):
        return _loss(self, batch)

    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=LR)

    def train_dataloader(self):
        ds = _Batches(self.start, 2, self.trainer.world_size, self.trainer.global_rank)
        return DataLoader(ds, batch_size=None)


def _trainer(ws: int, plan) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=ws,
        max_steps=2,
        **QUIET_TRAINER,
        limit_val_batches=0,
        use_distributed_sampler=False,
        strategy=RecShardedStrategy(embedding_grad="mean", plan=plan),
    )


def _fabric_save_job(rank: int, ws: int, path: str) -> None:
    fabric = _fabric(ws, plan=MIXED)
    model = fabric.setup_module(ClickModule())
    opt = fabric.setup_optimizers(torch.optim.Adagrad(model.parameters(), lr=LR))
    _train(fabric, model, opt, 0, 2)
    fabric.save(path, {"model": model, "optimizer": opt, "step": 2})


def _trainer_resume_job(rank: int, ws: int, path: str) -> dict:
    model = _Resumed(start=2, plan=OTHERS if ws > 1 else None)
    _trainer(ws, OTHERS if ws > 1 else None).fit(model, ckpt_path=path)
    return full_state_dict(model)


def _trainer_save_job(rank: int, ws: int, path: str) -> None:
    model = _Resumed(start=0, plan=MIXED)
    trainer = _trainer(ws, MIXED)
    trainer.fit(model)
    trainer.save_checkpoint(path)


def _fabric_resume_job(rank: int, ws: int, path: str) -> dict:
    fabric = _fabric(ws, plan=OTHERS if ws > 1 else None)
    model = fabric.setup_module(ClickModule())
    opt = fabric.setup_optimizers(torch.optim.Adagrad(model.parameters(), lr=LR))
    state = {"model": model, "optimizer": opt, "step": 0}
    remainder = fabric.load(path, state)
    assert "global_step" in remainder  # what the Trainer saved beyond the model and optimizer comes back
    _train(fabric, model, opt, 2, 2)
    return full_state_dict(model)


@pytest.mark.parametrize("ws", [1, 3])
def test_fabric_checkpoint_resumes_under_the_trainer_and_back(tmp_path: Path, ws: int) -> None:
    want = _reference(4, "adagrad")
    run_distributed(_fabric_save_job, 2, str(tmp_path / "fabric"), init_process_group=False, timeout_s=240)
    got = run_distributed(_trainer_resume_job, ws, str(tmp_path / "fabric"), init_process_group=False, timeout_s=240)[0]
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0, msg=lambda m: f"Fabric -> Trainer {k}: {m}")
    run_distributed(_trainer_save_job, 2, str(tmp_path / "trainer"), init_process_group=False, timeout_s=240)
    got = run_distributed(_fabric_resume_job, ws, str(tmp_path / "trainer"), init_process_group=False, timeout_s=240)[0]
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0, msg=lambda m: f"Trainer -> Fabric {k}: {m}")
