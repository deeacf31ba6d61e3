"""The one-pass remap over all tables (``_batch.remap_batch``) equals ``_remap.remap_step`` table by table."""

import copy

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_rec.mc import _batch, _remap


def _state(zch: int, nb: int, lfu: bool) -> _batch.TableState:
    raw = torch.full((zch,), -1, dtype=torch.int64)
    return _batch.TableState(raw, torch.zeros(zch, dtype=torch.int64), torch.zeros(zch, dtype=torch.int64),
                             _remap.SlotIndex(raw), nb, 0, lfu)


def _same(a: _remap.StepResult, b: _remap.StepResult) -> bool:
    return (torch.equal(a.slots, b.slots) and torch.equal(a.admitted_slots, b.admitted_slots)
            and torch.equal(a.admitted_ids, b.admitted_ids)
            and (a.lookups, a.hits, a.evicted, a.unadmitted) == (b.lookups, b.hits, b.evicted, b.unadmitted))


table_spec = st.tuples(st.sampled_from([(4, 1), (4, 2), (8, 4), (12, 3), (16, 16), (6, 1)]), st.booleans(),
                       st.integers(2, 60))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(table_spec, min_size=1, max_size=4), steps=st.integers(1, 6), seed=st.integers(0, 2**31),
       evals=st.lists(st.booleans(), min_size=6, max_size=6))
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
            want = _remap.remap_step(v, r.raw_ids, r.last_access, r.counts, r.index, r.num_buckets, r.step,
                                     "lfu" if r.lfu else "lru", update=update)
            assert _same(res, want)
        for s, r in zip(batched, ref):
            assert torch.equal(s.raw_ids, r.raw_ids)
            assert torch.equal(s.last_access, r.last_access)
            assert torch.equal(s.counts, r.counts)
            assert torch.equal(s.index.keys, r.index.keys) and torch.equal(s.index.slots, r.index.slots)
