"""Input pipelining without Lightning: ``TrainPipelineSparseDist`` starts batch i+1's input dist before batch i
trains, and its weights are bitwise those of the plain loop (2 gloo processes, every sharding type, pooled and
sequence collections)."""

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
from lightning_rec.distributed.train_pipeline import InputPrefetcher, find_kjts
from lightning_rec.mc import MCHManagedCollisionModule
from lightning_rec.sharding import (
    ShardingPlan,
    column_wise,
    data_parallel,
    full_state_dict,
    fused_optimizer,
    row_wise,
    shard_modules,
    sharded_collections,
    table_wise,
)
from lightning_rec.testing import run_distributed

ROWS = (13, 11, 9, 7)
TABLES = ("tw", "rw", "cw", "dp")


class _Model(nn.Module):
    """Embeddings of every sharding type + a dense layer; forward returns ``(loss, output)`` as DLRMTrain does."""

    def __init__(self, weighted: bool, rebuild: bool = False) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(r, 8, name, [f"f_{name}"], pooling="mean" if name == "rw" else "sum")
                for r, name in zip(ROWS, TABLES)
            ],
            is_weighted=weighted,
        )
        self.dense = nn.Linear(3, 8)
        self.rebuild = rebuild

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        kjt = batch.sparse
        if self.rebuild:  # a KJT the loader never produced: nothing can be prefetched for it
            kjt = KeyedJaggedTensor(kjt.keys(), kjt.values(), weights=kjt.weights_or_none(), lengths=kjt.lengths())
        pooled = self.ebc(kjt).values()
        logits = (pooled.view(pooled.shape[0], len(TABLES), 8) * self.dense(batch.dense).unsqueeze(1)).sum((1, 2))
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, logits.detach()


def _batches(rank: int, weighted: bool, repeat: bool = False) -> list[Batch]:
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for size in (5 + rank, 5 + rank, 6, 2 + rank):  # ranks differ; the last batch is shorter
        lengths = torch.randint(0, 4, (len(TABLES) * size,), generator=g)
        ids = torch.cat(
            [
                torch.randint(0, ROWS[i], (int(n),), generator=g)
                for i, n in enumerate(lengths.view(len(TABLES), size).sum(1))
            ]
        )
        w = torch.rand(ids.numel(), generator=g) if weighted else None
        kjt = KeyedJaggedTensor([f"f_{t}" for t in TABLES], ids, weights=w, lengths=lengths)
        out.append(Batch(torch.randn(size, 3, generator=g), kjt, torch.randint(0, 2, (size,), generator=g).float()))
    if repeat:  # a loader handing out the same batch object twice in a row
        out[1] = out[0]
    return out


def _sharded(ws: int, weighted: bool, fused: bool, rebuild: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _Model(weighted, rebuild)
    plan = ShardingPlan(
        {"ebc": {"tw": table_wise(1 % ws), "rw": row_wise(), "cw": column_wise([0, 1 % ws]), "dp": data_parallel()}}
    )
    model = shard_modules(model, plan, embedding_optimizer={"kind": "sgd", "lr": 0.3} if fused else None)
    dense = [p for n, p in model.named_parameters() if not n.startswith("ebc.")]
    params = dense if fused else list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.3)
    return model, opt


def _plain_loop(ws: int, rank: int, weighted: bool, fused: bool, repeat: bool) -> dict[str, torch.Tensor]:
    model, opt = _sharded(ws, weighted, fused)
    fopt = fused_optimizer(model)
    for batch in _batches(rank, weighted, repeat):
        opt.zero_grad()
        loss, _ = model(batch)
        loss.backward()
        opt.step()
        if fopt is not None:
            fopt.step()
    return {k: v.clone() for k, v in full_state_dict(model).items()}


def _pipelined_loop(
    ws: int, rank: int, weighted: bool, fused: bool, rebuild: bool, repeat: bool
) -> tuple[dict, int, list[str]]:
    model, opt = _sharded(ws, weighted, fused, rebuild)
    fopt = fused_optimizer(model)

    class _Both(torch.optim.Optimizer):  # the dense optimizer and the fused one, stepped together
        def __init__(self) -> None:
            self.param_groups, self.optimizers = opt.param_groups, [opt, fopt]

        def zero_grad(self, set_to_none: bool = True) -> None:
            opt.zero_grad(set_to_none)

        def step(self, closure=None) -> None:
            opt.step()
            if fopt is not None:
                fopt.step()

    ((_, coll),) = sharded_collections(model)
    started = []
    original = coll.prefetch_input_dist

    def counting(features):
        started.append(features)
        return original(features)

    coll.prefetch_input_dist = counting
    pipeline = TrainPipelineSparseDist(model, _Both(), torch.device("cpu"))
    it = iter(_batches(rank, weighted, repeat))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        n = 0
        while True:
            try:
                pipeline.progress(it)
            except StopIteration:
                break
            n += 1
    assert n == 4
    messages = [str(w.message) for w in caught if "TrainPipelineSparseDist" in str(w.message)]
    return {k: v.clone() for k, v in full_state_dict(model).items()}, len(started), messages


def _job(rank: int, ws: int, weighted: bool, fused: bool, rebuild: bool, repeat: bool) -> None:
    want = _plain_loop(ws, rank, weighted, fused, repeat)
    got, n_started, messages = _pipelined_loop(ws, rank, weighted, fused, rebuild, repeat)
    assert n_started == 4, n_started  # every batch's input dist started a step early
    if rebuild:
        assert len(messages) == 1 and "not called with the batch's own" in messages[0], messages
    else:
        assert not messages, messages
    assert set(got) == set(want)
    for k in want:  # bitwise: the same operations on the same values, only started earlier
        assert torch.equal(got[k], want[k]), f"{k} differs on rank {rank}"
    # and the job trained something: the tables moved from their initial values
    model, _ = _sharded(ws, weighted, fused)
    assert any(not torch.equal(v, want[k]) for k, v in full_state_dict(model).items())


@pytest.mark.parametrize(
    ("weighted", "fused", "rebuild", "repeat"),
    [(False, True, False, False), (True, False, False, False), (False, False, True, False), (True, True, False, True)],
)
def test_pipelined_weights_equal_the_plain_loop_bitwise(
    weighted: bool, fused: bool, rebuild: bool, repeat: bool
) -> None:
    run_distributed(_job, 2, weighted, fused, rebuild, repeat)


class _SequenceModel(nn.Module):
    """A sequence collection of every sharding type, each sample's embeddings summed, times a dense layer."""

    def __init__(self) -> None:
        super().__init__()
        self.ec = EmbeddingCollection([EmbeddingConfig(r, 8, name, [f"f_{name}"]) for r, name in zip(ROWS, TABLES)])
        self.dense = nn.Linear(3, 8)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        b = batch.dense.shape[0]
        summed = torch.zeros(b, 8)
        for jt in self.ec(batch.sparse).values():
            summed = summed.index_add(0, torch.repeat_interleave(torch.arange(b), jt.lengths()), jt.values())
        logits = (summed * self.dense(batch.dense)).sum(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels), logits.detach()


def _sequence_job(rank: int, ws: int) -> None:
    def sharded() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        plan = {"tw": table_wise(1 % ws), "rw": row_wise(), "cw": column_wise([0, 1 % ws]), "dp": data_parallel()}
        model = shard_modules(_SequenceModel(), ShardingPlan({"ec": plan}))
        return model, torch.optim.SGD(model.parameters(), lr=0.3)

    model, opt = sharded()
    for batch in _batches(rank, False):
        opt.zero_grad()
        model(batch)[0].backward()
        opt.step()
    want = full_state_dict(model)
    model, opt = sharded()
    pipeline, it, steps = TrainPipelineSparseDist(model, opt, torch.device("cpu")), iter(_batches(rank, False)), 0
    while True:
        try:
            pipeline.progress(it)
        except StopIteration:
            break
        steps += 1
    got = full_state_dict(model)
    assert steps == 4
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs on rank {rank}"


def test_pipelined_sequence_collection_equals_the_plain_loop_bitwise() -> None:
    run_distributed(_sequence_job, 2)


def _modified_job(rank: int, ws: int) -> str:
    model, _ = _sharded(ws, False, False)
    batch = _batches(rank, False)[0]
    prefetcher = InputPrefetcher(model)
    started = prefetcher.start(batch)
    batch.sparse.values().add_(0)  # an in-place change after the ids left: the prefetched dist is stale
    with pytest.raises(ValueError, match="modified in place") as err, prefetcher.feeding(started):
        model(batch)
    assert prefetcher.clear() == 0 and not started[0].prefetched.pending  # dropped when refused
    return str(err.value)


def test_a_batch_modified_after_its_input_dist_started_is_refused() -> None:
    assert all("train without input pipelining" in m for m in run_distributed(_modified_job, 2))


def _handoff_job(rank: int, ws: int) -> None:
    model, _ = _sharded(ws, False, False)
    want = [model(b)[1] for b in _batches(rank, False)]
    b0, b1, b2, b3 = _batches(rank, False)
    prefetcher = InputPrefetcher(model, "handoff")
    started = [prefetcher.start(b)[0].prefetched for b in (b0, b1)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # only a forward inside feeding takes a started input dist: the one outside runs its own
        assert torch.equal(model(b0)[1], want[0]) and started[0].pending
        # a step reading its batch itself (no KJT in its arguments) is fed the oldest waiting batch
        with prefetcher.feeding_step(iter([b0])):
            assert torch.equal(model(b0)[1], want[0])
        # a step given its batch is fed that batch's
        with prefetcher.feeding_step({"batch": b1, "idx": 1}):
            assert torch.equal(model(b1)[1], want[1])
        assert not caught, [str(w.message) for w in caught]
        assert not started[0].pending and not started[1].pending
        # b2, which no step ran, is dropped (and said) when the step given b3 comes
        started = [prefetcher.start(b)[0].prefetched for b in (b2, b3)]
        with prefetcher.feeding_step([b3]):
            assert torch.equal(model(b3)[1], want[3])
        assert len(caught) == 1 and "no training step handed them" in str(caught[0].message)
        assert not started[0].pending and not started[1].pending and prefetcher.clear() == 0
        # a forward given another KJT than the one fed: its input dist dropped after the forward, and said
        prefetcher = InputPrefetcher(model, "handoff")
        started = [prefetcher.start(b0)[0].prefetched]
        with prefetcher.feeding_step(iter([])):
            assert torch.equal(model(b1)[1], want[1])
        assert len(caught) == 2 and "['ebc'] were not called" in str(caught[1].message)
    assert not started[0].pending and prefetcher.clear() == 0


def test_the_pipeline_hands_each_forward_its_own_batchs_input_dist() -> None:
    run_distributed(_handoff_job, 2)


def test_find_kjts_walks_mappings_sequences_dataclasses_and_objects() -> None:
    a = KeyedJaggedTensor(["x"], torch.tensor([1]), lengths=torch.tensor([1]))
    b = KeyedJaggedTensor(["y"], torch.tensor([2]), lengths=torch.tensor([1]))
    batch = Batch(torch.zeros(1, 1), a, torch.zeros(1))
    assert find_kjts(batch) == [a]
    assert find_kjts({"p": [batch, (b, a)], "q": torch.zeros(2)}) == [a, b]
    assert find_kjts(torch.zeros(3)) == [] and find_kjts("text") == []


def test_managed_collision_models_are_refused_with_a_clear_message() -> None:
    model = nn.Sequential(MCHManagedCollisionModule(zch_size=4, num_buckets=1))
    with pytest.raises(ValueError, match="managed-collision modules"):
        InputPrefetcher(model)
    with pytest.raises(ValueError, match="pipelined=False"):
        TrainPipelineSparseDist(model, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), "cpu")
