"""Input pipelining of managed-collision models (``TrainPipelineSparseDist``, 2 gloo processes): batch i+1's raw ids
travel while batch i trains, its remap runs in its own forward, and everything is bitwise the plain loop's: losses,
outputs, tables, remap state (raw id per row, counts, last access, step, bucket count) and each step's stats
(evictions), with a resize, an evaluation forward and a state_dict between steps while a batch is in flight, a
pooled and a sequence collection, plain and fused tables. Also: the unfolded path is refused by name, and a batch
read ahead but never trained leaves the remap state alone."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_rec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from lightning_rec.data import Batch
from lightning_rec.distributed import TrainPipelineSparseDist
from lightning_rec.distributed.train_pipeline import InputPrefetcher
from lightning_rec.mc import (
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
    MCHManagedCollisionModule,
)
from lightning_rec.sharding import (
    ShardingPlan,
    data_parallel,
    full_state_dict,
    fused_optimizer,
    row_wise,
    shard_modules,
    sharded_collections,
    table_wise,
)
from lightning_rec.testing import run_distributed

FEATURES = ["f", "g", "h", "p", "e"]  # f, g -> "a"; h -> "b"; p -> "plain" (not managed); e -> "s" (sequence)
STEPS = 6
RESIZE_AT = 3  # before this step: the pooled tables to 16 buckets (a split), the sequence table to 2 (a merge)
EVAL_AT = 2  # an evaluation forward before this step (no admission)
SAVE_AT = 4  # a state_dict before this step (what a checkpoint takes: every rank's remap rows gathered)
HOT = torch.randint(0, 2**62, (30,), generator=torch.Generator().manual_seed(5))


class _Model(nn.Module):
    """A pooled and a sequence managed-collision collection and a dense layer; forward returns ``(loss, output)``."""

    def __init__(self, return_remapped: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        pooled = [
            EmbeddingBagConfig(name="a", num_embeddings=64, embedding_dim=4, feature_names=["f", "g"]),
            EmbeddingBagConfig(name="b", num_embeddings=32, embedding_dim=4, feature_names=["h"], pooling="mean"),
            EmbeddingBagConfig(name="plain", num_embeddings=10, embedding_dim=4, feature_names=["p"]),
        ]
        mcc = ManagedCollisionCollection(
            {
                "a": MCHManagedCollisionModule(64, num_buckets=8, eviction_policy=LRU_EvictionPolicy()),
                "b": MCHManagedCollisionModule(32, num_buckets=8, eviction_policy=LFU_EvictionPolicy()),
            },
            pooled,
        )
        self.ebc = ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(pooled), mcc, return_remapped_features=return_remapped
        )
        seq = [EmbeddingConfig(name="s", num_embeddings=32, embedding_dim=4, feature_names=["e"])]
        self.ec = ManagedCollisionEmbeddingCollection(
            EmbeddingCollection(seq),
            ManagedCollisionCollection({"s": MCHManagedCollisionModule(32, num_buckets=4)}, seq),
        )
        self.dense = nn.Linear(3, 4)
        self.losses: list[float] = []

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        pooled, _ = self.ebc(batch.sparse)
        seq, _ = self.ec(batch.sparse)
        b = batch.dense.shape[0]
        jt = seq["e"]
        summed = torch.zeros(b, 4).index_add(0, torch.repeat_interleave(torch.arange(b), jt.lengths()), jt.values())
        x = pooled.values().view(b, 4, 4).sum(1) + summed  # features f, g, h, p
        logits = (x * self.dense(batch.dense)).sum(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        if self.training:
            self.losses.append(loss.item())
        return loss, logits.detach()

    def resize(self) -> None:
        self.ebc.resize(16)
        self.ec.resize(2)

    def stats(self) -> dict:
        return {"ebc": self.ebc.mc_stats(), "ec": self.ec.mc_stats()}


def _batch(rank: int, step: int, size: int) -> Batch:
    g = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(0, 4, (len(FEATURES) * size,), generator=g)
    per_key = lengths.view(len(FEATURES), size).sum(1).tolist()
    ids = []
    for key, n in zip(FEATURES, per_key):
        if key == "p":
            ids.append(torch.randint(0, 10, (n,), generator=g))
        else:  # raw ids: a hot set that keeps hitting, fresh ones that compete for the rows
            fresh = torch.randint(0, 2**62, (n,), generator=g)
            hot = HOT[torch.randint(0, len(HOT), (n,), generator=g)]
            ids.append(torch.where(torch.rand(n, generator=g) < 0.5, hot, fresh))
    kjt = KeyedJaggedTensor(FEATURES, torch.cat(ids), lengths=lengths)
    return Batch(torch.randn(size, 3, generator=g), kjt, torch.randint(0, 2, (size,), generator=g).float())


def _batches(rank: int) -> list[Batch]:
    return [_batch(rank, step, 2 if step == STEPS - 1 else 4 + rank) for step in range(STEPS)]


def _sharded(ws: int, fused: bool, return_remapped: bool = False) -> tuple[_Model, torch.optim.Optimizer]:
    plan = ShardingPlan(
        {
            "ebc._embedding_module": {"a": row_wise([32, 32]), "b": table_wise(1 % ws), "plain": data_parallel()},
            "ec._embedding_module": {"s": row_wise([16, 16])},
        }
    )
    spec = {"kind": "rowwise_adagrad", "lr": 0.25} if fused else None
    model = shard_modules(_Model(return_remapped), plan, embedding_optimizer=spec)
    dense = list(model.dense.parameters())
    opt = torch.optim.SGD(dense if fused else list(model.parameters()), lr=0.25)
    fopt = fused_optimizer(model)
    if fopt is None:
        return model, opt

    class _Both(torch.optim.Optimizer):  # the dense optimizer and the fused one, stepped together
        def __init__(self) -> None:
            self.param_groups, self.optimizers = opt.param_groups, [opt, fopt]

        def zero_grad(self, set_to_none: bool = True) -> None:
            opt.zero_grad(set_to_none)

        def step(self, closure=None) -> None:
            opt.step()
            fopt.step()

    return model, _Both()


def _between_steps(model: _Model, step: int, rank: int) -> torch.Tensor | None:
    """What happens before ``step`` (with the next batch's ids already in flight when pipelined)."""
    if step == RESIZE_AT:
        model.resize()
    if step == SAVE_AT:
        model.state_dict()
    if step == EVAL_AT:
        model.eval()
        with torch.no_grad():
            _, out = model(_batch(rank, 100, 3))
        model.train()
        return out
    return None


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in full_state_dict(model).items() if not k.endswith("_mch_generation")}


def _plain(rank: int, ws: int, fused: bool) -> dict:
    model, opt = _sharded(ws, fused)
    outs, stats, evals = [], [], []
    for step, batch in enumerate(_batches(rank)):
        evals.append(_between_steps(model, step, rank))
        model.train()
        opt.zero_grad()
        loss, out = model(batch)
        loss.backward()
        opt.step()
        outs.append(out)
        stats.append(model.stats())
    return {"losses": model.losses, "outs": outs, "stats": stats, "evals": evals, "state": _state(model)}


def _pipelined(rank: int, ws: int, fused: bool) -> dict:
    model, opt = _sharded(ws, fused)
    started = []
    for _, coll in sharded_collections(model):
        original = coll.prefetch_input_dist

        def counting(features, original=original):
            started.append(features)
            return original(features)

        coll.prefetch_input_dist = counting
    pipeline = TrainPipelineSparseDist(model, opt, torch.device("cpu"))
    it = iter(_batches(rank))
    outs, stats, evals = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            evals.append(_between_steps(model, step, rank))  # from step 1 on, with this step's ids in flight
            outs.append(pipeline.progress(it))
            # batch step+1's ids are in flight, but its remap has not run: the stats are this step's
            stats.append(model.stats())
        with pytest.raises(StopIteration):
            pipeline.progress(it)
    assert len(started) == 2 * STEPS, len(started)  # every batch, for both collections, a step early
    assert not [w for w in caught if "TrainPipelineSparseDist" in str(w.message)]
    # a batch read ahead but never trained: its ids travel, its remap never runs
    before = {k: v.clone() for k, v in model.state_dict().items() if "_mch_" in k}
    prefetcher = InputPrefetcher(model)
    prefetcher.start(_batch(rank, 200, 4))
    prefetcher.clear()
    after = model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())
    return {"losses": model.losses, "outs": outs, "stats": stats, "evals": evals, "state": _state(model)}


def _job(rank: int, ws: int, fused: bool) -> None:
    want, got = _plain(rank, ws, fused), _pipelined(rank, ws, fused)
    assert got["losses"] == want["losses"]
    assert got["stats"] == want["stats"]
    assert sum(s["ebc"]["a"]["evicted"] + s["ec"]["s"]["evicted"] for s in want["stats"]) > 0  # rows changed hands
    for a, b in zip(got["outs"] + got["evals"], want["outs"] + want["evals"]):
        assert (a is None and b is None) or torch.equal(a, b)
    assert set(got["state"]) == set(want["state"])
    for k, v in want["state"].items():  # tables and remap state: bitwise
        assert torch.equal(got["state"][k], v), f"{k} differs on rank {rank}"
    assert int(want["state"]["ebc._managed_collision_collection._managed_collision_modules.a._mch_num_buckets"]) == 16
    assert int(want["state"]["ec._managed_collision_collection._managed_collision_modules.s._mch_num_buckets"]) == 2


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused"])
def test_pipelined_managed_collision_equals_the_plain_loop_bitwise(fused: bool) -> None:
    run_distributed(_job, 2, fused)


def _refused_job(rank: int, ws: int) -> str:
    model, opt = _sharded(ws, False, return_remapped=True)
    with pytest.raises(ValueError, match="return_remapped_features=False") as err:
        TrainPipelineSparseDist(model, opt, torch.device("cpu"))
    TrainPipelineSparseDist(model, opt, torch.device("cpu"), pipelined=False)  # the unpipelined loop is fine
    return str(err.value)


def test_remapping_before_the_input_dist_is_refused_by_name() -> None:
    for message in run_distributed(_refused_job, 2):
        # the pooled wrapper returns its remapped ids: named once (not its inner modules); the sequence one folds
        assert "['ebc']" in message and "cannot start a batch early" in message, message


def test_standalone_and_unsharded_managed_collision() -> None:
    # a module remapping in the model's own forward is refused; an unsharded wrapper has no input dist to start
    with pytest.raises(ValueError, match=r"\['0'\]"):
        InputPrefetcher(nn.Sequential(MCHManagedCollisionModule(zch_size=4, num_buckets=1)))
    InputPrefetcher(_Model(return_remapped=True))
    assert _Model().ebc.supports_input_pipelining
