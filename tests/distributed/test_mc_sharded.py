"""Sharded managed collision == one process on the global batch, bit for bit: remaps, evictions, weights.

Also: resize mid-training (per-rank, no communication) equals the single-process resize, and a checkpoint
written at one world size / bucket count loads at another.
"""

from __future__ import annotations

import pytest
import torch

from lightning_rec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    ShardingPlan,
    transport,
)
from lightning_rec import checkpoint as ckpt
from lightning_rec.mc import (
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
    MCHManagedCollisionModule,
)
from lightning_rec.sharding import (
    column_wise,
    data_parallel,
    full_state_dict,
    fused_optimizer,
    row_wise,
    shard_modules,
    table_wise,
)
from lightning_rec.testing import run_distributed

FEATURES = ["f", "g", "h"]
BAGS = 12  # global bags per feature and step (divisible by 1..4)
STEPS = 6
RESIZE_AT = {2: 16, 4: 4}  # step -> new bucket count (table "a": 8 -> 16 -> 4 buckets)
LR = 0.25  # a power of two: with a sum loss the updates are exact, whatever the order of the sum


def _model(return_remapped: bool = True, meta: str | None = None) -> ManagedCollisionEmbeddingBagCollection:
    """``meta``: built on the meta device, by ``"arguments"`` (TorchRec's ``device=``) or in a ``"context"``."""
    torch.manual_seed(0)
    if meta == "context":
        with torch.device("meta"):
            return _model(return_remapped)
    device = "meta" if meta == "arguments" else None
    tables = [
        EmbeddingBagConfig(name="a", num_embeddings=64, embedding_dim=4, feature_names=["f", "g"]),
        EmbeddingBagConfig(name="b.x", num_embeddings=32, embedding_dim=4, feature_names=["h"], pooling="mean"),
    ]
    ebc = EmbeddingBagCollection(tables, device=device)
    mcc = ManagedCollisionCollection(
        {
            "a": MCHManagedCollisionModule(64, device, num_buckets=8, eviction_policy=LRU_EvictionPolicy()),
            "b.x": MCHManagedCollisionModule(32, device, num_buckets=8, eviction_policy=LFU_EvictionPolicy()),
        },
        tables,
    )
    return ManagedCollisionEmbeddingBagCollection(ebc, mcc, return_remapped_features=return_remapped)


def _global_batch(step: int) -> dict[str, list[list[int]]]:
    g = torch.Generator().manual_seed(1000 + step)
    hot = torch.randint(0, 2**62, (40,), generator=torch.Generator().manual_seed(7))
    out = {}
    for f in FEATURES:
        bags = []
        for _ in range(BAGS):
            n = int(torch.randint(0, 5, (1,), generator=g))
            fresh = torch.randint(0, 2**62, (n,), generator=g)
            pick = hot[torch.randint(0, 40, (n,), generator=g)]
            bags.append(torch.where(torch.rand(n, generator=g) < 0.6, pick, fresh).tolist())
        out[f] = bags
    return out


def _kjt(bags: dict[str, list[list[int]]]) -> KeyedJaggedTensor:
    lengths = torch.tensor([len(b) for f in FEATURES for b in bags[f]])
    values = torch.tensor([i for f in FEATURES for b in bags[f] for i in b], dtype=torch.int64)
    return KeyedJaggedTensor(FEATURES, values, lengths=lengths)


def _slice(bags, rank: int, ws: int):
    per = BAGS // ws
    return {f: b[rank * per : (rank + 1) * per] for f, b in bags.items()}


def _train(model, rank: int, ws: int, evictions: list | None = None) -> list[list[int]]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    remaps = []
    for step in range(STEPS):
        if step in RESIZE_AT:
            model.resize(RESIZE_AT[step])
        opt.zero_grad()
        out, remapped = model(_kjt(_slice(_global_batch(step), rank, ws)))
        out.values().sum().backward()
        opt.step()
        remaps.append(remapped.values().tolist() if remapped is not None else [])
        if evictions is not None:
            evictions += [s["evicted"] for s in model.mc_stats().values()]
    return remaps


def _full_state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in full_state_dict(model).items() if not k.endswith("_mch_generation")}


def _plan(kind: str, ws: int) -> ShardingPlan:
    # row blocks hold whole buckets at every bucket count used (8, 16, 4 buckets of 64 rows)
    a_rows = {1: [64], 2: [32, 32], 3: [16, 32, 16], 4: [16, 16, 16, 16]}[ws]
    if kind == "rw":
        plan = {"a": row_wise(a_rows), "b.x": row_wise({1: [32], 2: [16, 16], 3: [8, 16, 8], 4: [8, 8, 8, 8]}[ws])}
    elif kind == "mixed":
        plan = {"a": row_wise(a_rows), "b.x": table_wise(1)}
    else:
        plan = {"a": table_wise(ws - 1), "b.x": table_wise(0)}
    return ShardingPlan({"_embedding_module": plan})


def _sharded_job(rank: int, ws: int, kind: str):
    model = shard_modules(_model(), _plan(kind, ws))
    remaps = _train(model, rank, ws)
    return remaps, _full_state(model)


def _reference():
    model = _model()
    evictions: list[int] = []
    remaps = _train(model, 0, 1, evictions)
    assert sum(evictions) > 20  # the capacity is smaller than the ids seen: the policies chose
    return remaps, {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_mch_generation")}


def _per_rank(values: list[int], step: int, rank: int, ws: int) -> list[int]:
    """The part of the single-process remap that belongs to rank ``rank``'s bags."""
    bags = _global_batch(step)
    it = iter(values)
    full = {f: [[next(it) for _ in b] for b in bags[f]] for f in FEATURES}
    mine = _slice(full, rank, ws)
    return [i for f in FEATURES for b in mine[f] for i in b]


@pytest.mark.parametrize(
    "kind,ws",
    [
        ("rw", 2),
        ("tw", 2),
        pytest.param("rw", 1, marks=pytest.mark.slow),
        pytest.param("mixed", 3, marks=pytest.mark.slow),
        pytest.param("rw", 4, marks=pytest.mark.slow),
    ],
)
def test_sharded_matches_single_process(kind, ws):
    ref_remaps, ref_state = _reference()
    results = run_distributed(_sharded_job, ws, kind)
    for rank, (remaps, state) in enumerate(results):
        for step in range(STEPS):
            assert remaps[step] == _per_rank(ref_remaps[step], step, rank, ws), (rank, step)
        assert state.keys() == ref_state.keys()
        for k in ref_state:
            assert torch.equal(state[k], ref_state[k]), (rank, k)
    assert int(ref_state["_managed_collision_collection._managed_collision_modules.a._mch_num_buckets"]) == 4


def _meta_job(rank: int, ws: int, meta: str):
    model = _model(meta=meta)
    assert next(model.parameters()).device.type == "meta"  # the tables are deferred, the remap state is not
    model = shard_modules(model, _plan("rw", ws))
    remaps = _train(model, rank, ws)
    return remaps, {k: v for k, v in _full_state(model).items() if "_mch_" in k}


@pytest.mark.parametrize("meta", ["arguments", "context"])
def test_a_meta_built_model_remaps_as_one_process(meta: str) -> None:
    # tables built on the meta device are filled at shard time; the remap state starts as a CPU-built one's
    ref_remaps, ref_state = _reference()
    for rank, (remaps, state) in enumerate(run_distributed(_meta_job, 2, meta)):
        for step in range(STEPS):
            assert remaps[step] == _per_rank(ref_remaps[step], step, rank, 2), (rank, step)
        assert state.keys() == {k for k in ref_state if "_mch_" in k}
        for k in state:
            assert torch.equal(state[k], ref_state[k]), (rank, k)


def _save_job(rank: int, ws: int, path: str):
    model = shard_modules(_model(), _plan("rw", ws))
    opt = torch.optim.Adagrad(model.parameters(), lr=LR)
    for step in range(3):
        opt.zero_grad()
        out, _ = model(_kjt(_slice(_global_batch(step), rank, ws)))
        out.values().sum().backward()
        opt.step()
    ckpt.save(path, model, [opt])
    return _full_state(model)


def _load_job(rank: int, ws: int, path: str):
    model = _model()
    for m in model._managed_collision_collection.modules_by_table().values():
        m.set_target_num_buckets(4)  # configured with another bucket count than the checkpoint's 8
    model = shard_modules(model, _plan("rw", ws))
    opt = torch.optim.Adagrad(model.parameters(), lr=LR)
    _, _ = model(_kjt(_slice(_global_batch(0), rank, ws)))  # warm the optimizer state's shapes
    opt.step()
    ckpt.load(path, model, [opt])
    empty = KeyedJaggedTensor(
        FEATURES, torch.zeros(0, dtype=torch.int64), lengths=torch.zeros(3 * (BAGS // ws), dtype=torch.int64)
    )
    model(empty)  # the migration to 4 buckets runs here
    return _full_state(model)


def test_checkpoint_loads_at_another_world_size_and_bucket_count(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_save_job, 2, path)[0]
    # what one process gets from the same state: load, then resize to 4 buckets
    ref = _model()
    ref.load_state_dict(saved, strict=False)
    ref.resize(4)
    ref_state = {k: v for k, v in ref.state_dict().items() if not k.endswith("_mch_generation")}
    for state in run_distributed(_load_job, 3, path):
        for k in ref_state:
            if k.endswith("_mch_step"):
                continue  # the load job ran one extra (empty) step
            assert torch.equal(state[k], ref_state[k]), k


FUSED = {"kind": "rowwise_adagrad", "lr": 0.5}


def _fused_job(rank: int, ws: int):
    """Fused kernels: a taken row is re-initialised in the kernel's table and its row-wise state zeroed."""
    model = shard_modules(_model(), _plan("rw", ws), embedding_optimizer=FUSED)
    opt = fused_optimizer(model)
    for step in range(3):
        out, _ = model(_kjt(_slice(_global_batch(step), rank, ws)))
        out.values().sum().backward()
        opt.step()
    coll = model._embedding_module
    (kernel,) = coll.fused_kernels()
    state = kernel.optimizer_states()["a"]["sum"]
    trained = state.clone()
    # one new id per bag of "f": every one is admitted (LRU), most by evicting a trained row
    new = {
        "f": [[2**61 + 97 * (rank * 100 + i)] for i in range(BAGS // ws)],
        "g": [[]] * (BAGS // ws),
        "h": [[]] * (BAGS // ws),
    }
    kjt = _kjt(new)
    remapped = model.remap(kjt)
    rows = remapped.values()
    offset = _local_offset(coll, "a")
    pooled = model._embedding_module(remapped)
    mine = [int(r) - offset for r in _owned_rows(rows, ws, rank)]
    cfg = coll.tables[0]
    expect = model._reinit_values("a", torch.tensor(new["f"]).flatten(), cfg)
    got_pooled = pooled.values()[:, :4]
    return {
        "reset": all(float(state[r]) == 0.0 for r in mine),
        "was_trained": sum(float(trained[r]) > 0 for r in mine),
        "lookup_is_reinit": torch.equal(got_pooled, expect),
        "stats": model.mc_stats()["a"],
    }


def _local_offset(coll, table):
    return next(s.row_offset for ti, s in coll.local_shards if coll.tables[ti].name == table)


def _owned_rows(rows, ws, rank):
    size = {2: 32, 4: 16}[ws]
    return [r for r in rows.tolist() if r // size == rank]


def test_fused_kernels_reset_rows_on_eviction():
    results = run_distributed(_fused_job, 2)
    for r in results:
        assert r["reset"] and r["lookup_is_reinit"], r
    assert sum(r["was_trained"] for r in results) > 0
    assert sum(r["stats"]["evicted"] for r in results) > 0


def _ec_model(return_remapped: bool = True) -> ManagedCollisionEmbeddingCollection:
    torch.manual_seed(0)
    tables = [EmbeddingConfig(name="s", num_embeddings=32, embedding_dim=4, feature_names=["f", "g", "h"])]
    mcc = ManagedCollisionCollection({"s": MCHManagedCollisionModule(32, num_buckets=8)}, tables)
    return ManagedCollisionEmbeddingCollection(
        EmbeddingCollection(tables), mcc, return_remapped_features=return_remapped
    )


def _ec_run(model, rank: int, ws: int):
    out = []
    for step in range(3):
        embs, remapped = model(_kjt(_slice(_global_batch(step), rank, ws)))
        out.append(
            (
                remapped.values().tolist() if remapped is not None else None,
                torch.cat([embs[f].values() for f in FEATURES]).detach(),
            )
        )
    return out


def _ec_job(rank: int, ws: int, return_remapped: bool = True):
    model = shard_modules(_ec_model(return_remapped), ShardingPlan({"_embedding_module": {"s": row_wise([16, 16])}}))
    return _ec_run(model, rank, ws), _full_state(model)


@pytest.mark.parametrize("return_remapped", [True, False], ids=["separate", "folded"])
def test_sharded_embedding_collection_matches_single_process(return_remapped):
    ref_model = _ec_model()
    ref = _ec_run(ref_model, 0, 1)
    ref_state = {k: v for k, v in ref_model.state_dict().items() if not k.endswith("_mch_generation")}
    for rank, (steps, state) in enumerate(run_distributed(_ec_job, 2, return_remapped)):
        for step, ((remap, embs), (ref_remap, ref_embs)) in enumerate(zip(steps, ref)):
            mine = _per_rank(ref_remap, step, rank, 2)
            assert remap == (mine if return_remapped else None)
            # per-id embeddings: the single-process ones of this rank's bags, bit for bit
            pos = _per_rank(list(range(ref_embs.shape[0])), step, rank, 2)
            assert torch.equal(embs, ref_embs[torch.tensor(pos, dtype=torch.int64)])
        for k in ref_state:
            assert torch.equal(state[k], ref_state[k]), k


def _errors_job(rank: int, ws: int, return_remapped: bool = True) -> list[str]:
    """Bad input on one rank, and plans managed collision cannot follow: every rank raises, none hangs."""
    msgs = []
    model = shard_modules(_ec_model(return_remapped), ShardingPlan({"_embedding_module": {"s": row_wise([16, 16])}}))
    bags = _slice(_global_batch(0), rank, ws)
    if rank == 1:
        bags["g"][0] = [-5]
    for kjt in (_kjt(bags), _kjt(_slice(_global_batch(1), rank, ws))):
        try:
            model(kjt)
            msgs.append("ok")
        except ValueError as e:
            msgs.append(str(e))
    good = _kjt(_slice(_global_batch(2), rank, ws))
    # remapping on the owners refuses the first two at sharding (its stage hook's attach), the third at the step
    for plan in ({"s": column_wise([0, 1])}, {"s": data_parallel()}, {"s": row_wise([14, 18])}):
        try:
            shard_modules(_ec_model(return_remapped), ShardingPlan({"_embedding_module": plan}))(good)
            msgs.append("ok")
        except ValueError as e:
            msgs.append(str(e))
    return msgs


@pytest.mark.parametrize("return_remapped", [True, False], ids=["separate", "folded"])
def test_errors_reach_every_rank(return_remapped):
    r0, r1 = run_distributed(_errors_job, 2, return_remapped)
    if return_remapped:
        assert "non-negative" in r1[0] and "rank(s) [1]" in r0[0]
    else:  # the collection's own input check: the feature, its table and the id
        assert "feature 'g' (table 's') has id -5" in r1[0] and "ranks [1] rejected their input" in r0[0]
    assert r0[1] == r1[1] == "ok"  # the next step runs normally
    for msgs in (r0, r1):
        assert "split by columns" in msgs[2]
        assert "data-parallel" in msgs[3]
        assert "split a bucket of 4 rows" in msgs[4]


# -- remapping folded into the collection's input dist (return_remapped_features=False) ---------------------


def _count_all_to_all(monkeypatch_target):
    calls = [0]
    real = monkeypatch_target.all_to_all_single

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch_target.all_to_all_single = counting
    return calls, real


def _fold_job(rank: int, ws: int, kind: str, fold: bool = True, fused: bool = False):
    model = shard_modules(_model(return_remapped=False), _plan(kind, ws), embedding_optimizer=FUSED if fused else None)
    model._fold_remap = fold
    calls, real = _count_all_to_all(transport)
    try:
        if fused:
            opt = fused_optimizer(model)
            for step in range(STEPS):
                if step in RESIZE_AT:
                    model.resize(RESIZE_AT[step])
                out, _ = model(_kjt(_slice(_global_batch(step), rank, ws)))
                out.values().sum().backward()
                opt.step()
        else:
            _train(model, rank, ws)
    finally:
        transport.all_to_all_single = real
    stats = [model.mc_stats()]
    return _full_state(model), calls[0], stats


@pytest.mark.parametrize(
    "kind,ws",
    [
        ("rw", 2),
        ("tw", 2),
        pytest.param("mixed", 3, marks=pytest.mark.slow),
        pytest.param("rw", 4, marks=pytest.mark.slow),
    ],
)
def test_folded_remap_matches_single_process_without_extra_all_to_all(kind, ws):
    _, ref_state = _reference()
    folded = run_distributed(_fold_job, ws, kind, True)
    separate = run_distributed(_fold_job, ws, kind, False)
    for (state, calls, _), (sep_state, sep_calls, _) in zip(folded, separate):
        assert state.keys() == ref_state.keys()
        for k in ref_state:
            assert torch.equal(state[k], ref_state[k]), k
            assert torch.equal(sep_state[k], ref_state[k]), k
        # the separate remap costs 3 all-to-alls per step (counts, ids, rows back); the fold none
        assert sep_calls - calls == 3 * STEPS, (sep_calls, calls)


def _fused_fold_states(rank: int, ws: int, fold: bool):
    state, _, stats = _fold_job(rank, ws, "rw", fold, fused=True)
    return state, stats


def test_folded_remap_with_fused_kernels_matches_separate_remap():
    # the separate remap is checked against one process above; with fused kernels the fold must agree with it
    folded = run_distributed(_fused_fold_states, 2, True)
    separate = run_distributed(_fused_fold_states, 2, False)
    for (state, stats), (sep_state, sep_stats) in zip(folded, separate):
        assert stats == sep_stats
        for k in sep_state:
            assert torch.equal(state[k], sep_state[k]), k
