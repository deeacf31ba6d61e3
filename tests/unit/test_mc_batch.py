"""The one-pass remap over all tables (``_batch.remap_batch``) equals ``_remap.remap_step`` table by table;
resize with per-table bucket counts or a factor."""

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from lightning_rec.mc import (
    LFU_EvictionPolicy,
    ManagedCollisionCallback,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    MCHManagedCollisionModule,
    _batch,
    _remap,
)


def _state(zch: int, nb: int, lfu: bool) -> _batch.TableState:
    raw = torch.full((zch,), -1, dtype=torch.int64)
    return _batch.TableState(
        raw, torch.zeros(zch, dtype=torch.int64), torch.zeros(zch, dtype=torch.int64), _remap.SlotIndex(raw), nb, 0, lfu
    )


def _same(a: _remap.StepResult, b: _remap.StepResult) -> bool:
    return (
        torch.equal(a.slots, b.slots)
        and torch.equal(a.admitted_slots, b.admitted_slots)
        and torch.equal(a.admitted_ids, b.admitted_ids)
        and (a.lookups, a.hits, a.evicted, a.unadmitted) == (b.lookups, b.hits, b.evicted, b.unadmitted)
    )


table_spec = st.tuples(
    st.sampled_from([(4, 1), (4, 2), (8, 4), (12, 3), (16, 16), (6, 1)]), st.booleans(), st.integers(2, 60)
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(table_spec, min_size=1, max_size=4),
    steps=st.integers(1, 6),
    seed=st.integers(0, 2**31),
    evals=st.lists(st.booleans(), min_size=6, max_size=6),
)
def test_batched_remap_equals_per_table_reference(specs, steps, seed, evals):
    g = torch.Generator().manual_seed(seed)
    batched = [_state(z, nb, lfu) for (z, nb), lfu, _ in specs]
    ref = [copy.deepcopy(s) for s in batched]
    for step in range(1, steps + 1):
        update = not evals[step - 1]
        ids = []
        for (_, _, pool), s, r in zip(specs, batched, ref):
            n = int(torch.randint(0, 25, (1,), generator=g))
            # skewed draws from a small pool: repeats, hits, evictions and ties
            ids.append(torch.randint(0, pool, (n,), generator=g) ** 2 // pool)
            s.step = r.step = step
        got = _batch.remap_batch(ids, batched, update=update)
        for v, r, res in zip(ids, ref, got):
            want = _remap.remap_step(
                v,
                r.raw_ids,
                r.last_access,
                r.counts,
                r.index,
                r.num_buckets,
                r.step,
                "lfu" if r.lfu else "lru",
                update=update,
            )
            assert _same(res, want)
        for s, r in zip(batched, ref):
            assert torch.equal(s.raw_ids, r.raw_ids)
            assert torch.equal(s.last_access, r.last_access)
            assert torch.equal(s.counts, r.counts)
            assert torch.equal(s.index.keys, r.index.keys) and torch.equal(s.index.slots, r.index.slots)


# -- resize with per-table counts or a factor (tables whose bucket counts differ) -----------------------------------


def _two_table_mc(nb_a: int, nb_b: int) -> ManagedCollisionEmbeddingBagCollection:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=n, num_embeddings=64, embedding_dim=4, feature_names=[f"f{n}"]) for n in ("a", "b")
    ]
    mcc = ManagedCollisionCollection(
        {
            "a": MCHManagedCollisionModule(64, num_buckets=nb_a),
            "b": MCHManagedCollisionModule(64, num_buckets=nb_b, eviction_policy=LFU_EvictionPolicy()),
        },
        tables,
    )
    return ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables=tables), mcc)


def _feed(m, steps: int = 4) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 400, (60,), generator=g)
        m(KeyedJaggedTensor(["fa", "fb"], ids, lengths=torch.ones(60, dtype=torch.int64)))


def _mc_state(m) -> dict:
    return {k: v for k, v in m.state_dict().items() if not k.endswith("_mch_generation")}


def test_resize_by_factor_equals_per_table_counts_and_one_table_at_a_time():
    by_factor, by_counts, one_by_one = _two_table_mc(8, 2), _two_table_mc(8, 2), _two_table_mc(8, 2)
    for m in (by_factor, by_counts, one_by_one):
        _feed(m)
    with pytest.raises(ValueError, match="divisor of zch_size=64"):
        by_factor.resize(128)  # one count for both tables: 8 -> 128 is refused, and nothing moved
    assert by_factor.scaled_num_buckets(2) == {"a": 16, "b": 4}
    ev = by_factor.resize(by_factor.scaled_num_buckets(2))
    assert ev == by_counts.resize({"a": 16, "b": 4})
    one_by_one.resize({"a": 16})
    one_by_one.resize({"b": 4})
    assert [m.num_buckets for m in by_factor._managed_collision_collection.modules_by_table().values()] == [16, 4]
    for other in (by_counts, one_by_one):
        s, o = _mc_state(by_factor), _mc_state(other)
        assert s.keys() == o.keys() and all(torch.equal(s[k], o[k]) for k in s)
    assert by_factor.scaled_num_buckets(0.25) == {"a": 4, "b": 1}
    with pytest.raises(ValueError, match=r"table 'b': 4 buckets x 0.125 is not a whole bucket count"):
        by_factor.scaled_num_buckets(0.125)
    assert by_factor.scaled_num_buckets(0.125, skip_unfit=True) == {"a": 2}
    with pytest.raises(ValueError, match=r"table 'a': num_buckets=128 must be a positive divisor of zch_size=64"):
        by_factor.scaled_num_buckets(8)
    assert by_factor.scaled_num_buckets(4, skip_unfit=True) == {"a": 64, "b": 16}
    with pytest.raises(ValueError, match=r"tables \['c'\] are not managed tables"):
        by_factor.resize({"c": 2})
    with pytest.raises(ValueError, match="in both resize_at and resize_by"):
        ManagedCollisionCallback(resize_at={1: 2}, resize_by={1: 2.0})


@settings(max_examples=40, deadline=None)
@given(
    dim=st.integers(1, 70),
    sizes=st.lists(st.integers(0, 20), min_size=1, max_size=4),
    tables=st.lists(st.tuples(st.integers(1, 10**7), st.integers(0, 2**62), st.booleans()), min_size=4, max_size=4),
    seed=st.integers(0, 2**31),
)
def test_hashed_uniform_rows_equals_per_table_values(dim, sizes, tables, seed):
    """Re-initialised rows of several tables in one pass == each table's ``hashed_uniform``, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 2**62, (n,), generator=g) for n in sizes]
    # the default init range of a table of `rows` rows (±sqrt(1/rows)), or an asymmetric one
    ranges = [(-(rows**-0.5), rows**-0.5) if sym else (-(rows**-0.5), 3.0) for rows, _, sym in tables]
    want = torch.cat([_remap.hashed_uniform(v, dim, s, lo, hi) for v, (_, s, _), (lo, hi) in zip(ids, tables, ranges)])
    n = torch.tensor(sizes)

    def rows(xs, dtype):
        return torch.repeat_interleave(torch.tensor(xs[: len(sizes)], dtype=dtype), n)

    got = _remap.hashed_uniform_rows(
        torch.cat(ids),
        dim,
        rows([s for _, s, _ in tables], torch.int64),
        rows([lo for lo, _ in ranges], torch.float64),
        rows([hi for _, hi in ranges], torch.float64),
    )
    assert torch.equal(got, want)
    lo, hi = ranges[0]  # one range for every table: plain floats
    want = torch.cat([_remap.hashed_uniform(v, dim, s, lo, hi) for v, (_, s, _) in zip(ids, tables)])
    assert torch.equal(
        _remap.hashed_uniform_rows(torch.cat(ids), dim, rows([s for _, s, _ in tables], torch.int64), lo, hi), want
    )
