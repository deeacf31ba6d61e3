"""Managed collision against a plain-Python reference: hashing, LRU / LFU remapping, resize, state, errors."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from lightning_rec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from lightning_rec.mc import (
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
    MCHManagedCollisionModule,
    _remap,
)

M64 = (1 << 64) - 1


def py_splitmix(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def py_bucket(x: int, nb: int) -> int:
    return ((py_splitmix(x) >> 24) * nb) >> 40


class RefMCH:
    """The documented rules, one id at a time with dicts and lists."""

    def __init__(self, zch: int, nb: int, policy: str) -> None:
        self.zch, self.nb, self.policy = zch, nb, policy
        self.rows: list[int | None] = [None] * zch
        self.last, self.cnt, self.step = [0] * zch, [0] * zch, 0
        self.evicted = 0

    def remap(self, ids: list[int]) -> list[int]:
        self.step += 1
        bs = self.zch // self.nb
        occ = Counter(ids)
        slot_of = {i: r for r, i in enumerate(self.rows) if i is not None}
        out, touched = {}, set()
        for i in occ:
            if i in slot_of:
                r = slot_of[i]
                self.last[r], self.cnt[r] = self.step, self.cnt[r] + occ[i]
                out[i] = r
                touched.add(r)
        for b in range(self.nb):
            misses = sorted((i for i in occ if i not in out and py_bucket(i, self.nb) == b), key=lambda i: (-occ[i], i))
            if not misses:
                continue
            free = [r for r in range(b * bs, (b + 1) * bs) if r not in touched]
            if self.policy == "lru":
                free.sort(key=lambda r: (self.rows[r] is not None, self.last[r], r))
            else:
                free.sort(key=lambda r: (self.rows[r] is not None, self.cnt[r], self.last[r], r))
            for k, i in enumerate(misses):
                r = free[k] if k < len(free) else None
                admit = r is not None and (self.rows[r] is None or self.policy == "lru" or occ[i] > self.cnt[r])
                if admit:
                    self.evicted += self.rows[r] is not None
                    self.rows[r], self.last[r], self.cnt[r] = i, self.step, occ[i]
                    out[i] = r
                else:
                    out[i] = b * bs + py_splitmix(i) % bs
        return [out[i] for i in ids]


def test_hash_and_buckets_match_python_ints():
    ids = [0, 1, 2, 12345, 2**40 + 7, 2**62 + 3, 2**63 - 1]
    t = torch.tensor(ids)
    got = _remap.splitmix64(t).tolist()
    assert [g & M64 for g in got] == [py_splitmix(i) for i in ids]
    for nb in (1, 3, 768, 1536):
        assert _remap.bucket_of(t, nb).tolist() == [py_bucket(i, nb) for i in ids]
    many = torch.randint(0, 2**62, (5000,))
    # range bucketing: bucket b of n is buckets 2b, 2b+1 of 2n (what makes resizing local)
    assert torch.equal(_remap.bucket_of(many, 1536) // 2, _remap.bucket_of(many, 768))


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("zch,nb", [(16, 4), (24, 3), (8, 1)])
def test_remap_matches_reference(policy, zch, nb):
    rng = random.Random(zch * 7 + nb + len(policy))
    m = MCHManagedCollisionModule(
        zch, num_buckets=nb, eviction_policy=LRU_EvictionPolicy() if policy == "lru" else LFU_EvictionPolicy()
    )
    ref = RefMCH(zch, nb, policy)
    pool = [rng.randrange(2**62) for _ in range(3 * zch)]  # more ids than rows: evictions happen
    evicted = 0
    for _ in range(40):
        n = rng.randrange(0, 2 * zch)
        ids = [rng.choice(pool[: zch // 2]) if rng.random() < 0.5 else rng.choice(pool) for _ in range(n)]
        m.begin_step()
        res = m.remap(torch.tensor(ids, dtype=torch.int64))
        assert res.slots.tolist() == ref.remap(ids)
        evicted += res.evicted
        assert m._mch_raw_ids.tolist() == [-1 if r is None else r for r in ref.rows]
        assert m._mch_last_access.tolist() == ref.last and m._mch_counts.tolist() == ref.cnt
    assert evicted == ref.evicted > 0


def test_remap_is_independent_of_id_order():
    ids = torch.randint(0, 50, (200,))
    mods = [MCHManagedCollisionModule(16, num_buckets=4, eviction_policy=LFU_EvictionPolicy()) for _ in range(2)]
    for step in range(5):
        x = ids[step * 40 : (step + 1) * 40]
        perm = torch.randperm(x.numel())
        outs = []
        for m, v in zip(mods, (x, x[perm])):
            m.begin_step()
            outs.append(m.remap(v).slots)
        assert torch.equal(outs[0][perm], outs[1])
    assert torch.equal(mods[0]._mch_raw_ids, mods[1]._mch_raw_ids)


def _mc_ebc(zch=32, nb=4, policy=None, **kw):
    cfg = EmbeddingBagConfig(name="t.1", num_embeddings=zch, embedding_dim=4, feature_names=["f", "g"])
    ebc = EmbeddingBagCollection([cfg])
    mcc = ManagedCollisionCollection(
        {"t.1": MCHManagedCollisionModule(zch, num_buckets=nb, eviction_policy=policy)}, ebc.embedding_bag_configs()
    )
    return ManagedCollisionEmbeddingBagCollection(ebc, mcc, **kw)


def _kjt(f, g):
    return KeyedJaggedTensor(
        ["f", "g"], torch.tensor(f + g, dtype=torch.int64), lengths=torch.tensor([len(f), 0, len(g), 0])
    )


def test_ids_keep_rows_and_evicted_rows_are_reset():
    torch.manual_seed(0)
    m = _mc_ebc(zch=4, nb=1, return_remapped_features=True)
    w = m._embedding_module.embedding_bags["t.1"].weight
    opt = torch.optim.Adagrad(m.parameters(), lr=0.1)
    big = 2**62 + 11  # a raw id far outside the table
    _, r1 = m(_kjt([big, 5], [6]))
    rows = dict(zip([big, 5, 6], r1.values().tolist()))
    # admitted rows start at the hashed initial values
    cfg = m._embedding_module.embedding_bag_configs()[0]
    assert torch.equal(w[rows[big]], m._reinit_values("t.1", torch.tensor([big]), cfg)[0])
    for _ in range(3):
        opt.zero_grad()
        out, _ = m(_kjt([big, 5], [6]))
        out.values().sum().backward()
        opt.step()
    state = opt.state[w]["sum"]
    before = w.detach().clone()
    _, r2 = m(_kjt([big], [7, 8]))  # 7 takes the free row, 8 evicts the least recently used of {5, 6}
    assert r2.values()[0] == rows[big] and torch.equal(w[rows[big]], before[rows[big]])
    assert m.mc_stats()["t.1"] == {"lookups": 3, "hits": 1, "admitted": 2, "evicted": 1, "unadmitted": 0}
    row8 = int(r2.values()[2])
    assert row8 in (rows[5], rows[6])
    assert torch.all(state[row8] == 0) and torch.all(state[rows[big]] > 0)
    assert torch.equal(w[row8], m._reinit_values("t.1", torch.tensor([8]), cfg)[0])


def test_row_init_options_and_lfu_keeps_frequent_ids():
    m = _mc_ebc(zch=2, nb=1, policy=LFU_EvictionPolicy(), row_init="zeros", return_remapped_features=True)
    w = m._embedding_module.embedding_bags["t.1"].weight
    m(_kjt([1, 1, 1], [2]))
    with torch.no_grad():
        w.fill_(3.0)
    _, r = m(_kjt([3], []))  # seen once: does not beat id 2 (count 1) nor id 1 (count 3)
    assert m.mc_stats()["t.1"]["unadmitted"] == 1 and torch.all(w == 3.0)
    _, r = m(_kjt([3, 3], []))  # seen twice: evicts id 2
    assert m._managed_collision_collection.modules_by_table()["t.1"]._mch_raw_ids.tolist().count(3) == 1
    assert torch.all(w[r.values()[0]] == 0)


def test_embedding_collection_wrapper():
    ec = EmbeddingCollection([EmbeddingConfig(name="s", num_embeddings=8, embedding_dim=4, feature_names=["q"])])
    mcc = ManagedCollisionCollection({"s": MCHManagedCollisionModule(8, num_buckets=2)}, ec.embedding_configs())
    m = ManagedCollisionEmbeddingCollection(ec, mcc)
    kjt = KeyedJaggedTensor(["q"], torch.tensor([2**50, 3, 2**50]), lengths=torch.tensor([2, 1]))
    out, none = m(kjt)
    assert none is None
    v = out["q"].values()
    assert torch.equal(v[0], v[2]) and not torch.equal(v[0], v[1])


def _fill(m, n_steps=6, pool=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adagrad(m.parameters(), lr=0.1)
    for _ in range(n_steps):
        ids = torch.randint(0, 2**62, (pool,), generator=g)
        opt.zero_grad()
        out, _ = m(KeyedJaggedTensor(["f", "g"], ids, lengths=torch.tensor([pool // 2, 0, pool - pool // 2, 0])))
        out.values().sum().backward()
        opt.step()
    return opt


@pytest.mark.parametrize("policy", [LRU_EvictionPolicy(), LFU_EvictionPolicy()])
def test_resize_keeps_rows_and_optimizer_state(policy):
    m = _mc_ebc(zch=3072, nb=768, policy=policy)  # 4 rows per bucket
    opt = _fill(m, n_steps=3, pool=2000)
    mch = m._managed_collision_collection.modules_by_table()["t.1"]
    w = m._embedding_module.embedding_bags["t.1"].weight
    prev = 768
    for nb in (1536, 384, 768):
        before = {int(i): r for r, i in enumerate(mch._mch_raw_ids.tolist()) if i >= 0}
        rows_before, sum_before = w.detach().clone(), opt.state[w]["sum"].clone()
        meta_before = (mch._mch_last_access.clone(), mch._mch_counts.clone())
        ids = torch.tensor(sorted(before))
        expect_buckets = _remap.bucket_of(ids, nb)
        evicted = m.resize(nb)["t.1"]
        after = {int(i): r for r, i in enumerate(mch._mch_raw_ids.tolist()) if i >= 0}
        assert len(after) == len(before) - evicted and set(after) <= set(before)
        bs = 3072 // nb
        # every survivor sits in its new bucket with its row, optimizer state and metadata
        for i, b in zip(ids.tolist(), expect_buckets.tolist()):
            if i in after:
                assert after[i] // bs == b
                assert torch.equal(w[after[i]], rows_before[before[i]])
                assert torch.equal(opt.state[w]["sum"][after[i]], sum_before[before[i]])
                assert mch._mch_last_access[after[i]] == meta_before[0][before[i]]
                assert mch._mch_counts[after[i]] == meta_before[1][before[i]]
        # evictions only where a new bucket received more ids than it has rows, and then the policy's worst
        per_bucket = Counter(expect_buckets.tolist())
        assert evicted == sum(max(0, c - bs) for c in per_bucket.values())
        if nb < prev:
            assert evicted == 0  # merging never evicts
        else:
            assert evicted > 0  # this load overflows some half-buckets: the policy chose
        prev = nb
        _fill(m, n_steps=1, pool=500, seed=nb)  # keeps training after a resize


def test_state_dict_reloads_into_another_bucket_count():
    a = _mc_ebc(zch=3072, nb=768)
    _fill(a, n_steps=3, pool=1500)
    b = _mc_ebc(zch=3072, nb=384)
    b.load_state_dict(a.state_dict())
    a.resize(384)
    # the migration runs on b's next forward; it equals a's explicit resize
    probe = KeyedJaggedTensor(["f", "g"], torch.zeros(0, dtype=torch.int64), lengths=torch.zeros(4, dtype=torch.int64))
    a.remap(probe)
    b.remap(probe)
    for k, v in a.state_dict().items():
        if not k.endswith("_mch_generation"):
            assert torch.equal(v, b.state_dict()[k]), k


def test_errors_are_clear():
    with pytest.raises(ValueError, match="divisor of zch_size=10"):
        MCHManagedCollisionModule(10, num_buckets=4, name="u")
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", num_embeddings=8, embedding_dim=4, feature_names=["f"])])
    with pytest.raises(ValueError, match="zch_size=16 but the table has num_embeddings=8"):
        ManagedCollisionCollection({"t": MCHManagedCollisionModule(16, num_buckets=4)}, ebc.embedding_bag_configs())
    with pytest.raises(ValueError, match="no config"):
        ManagedCollisionCollection({"x": MCHManagedCollisionModule(8, num_buckets=4)}, ebc.embedding_bag_configs())
    m = _mc_ebc(zch=48, nb=4)
    with pytest.raises(ValueError, match="non-negative"):
        m(_kjt([-1], []))
    with pytest.raises(ValueError, match="multiple or a divisor"):
        m.resize(6)
    with pytest.raises(ValueError, match="row_init"):
        _mc_ebc(row_init="gaussian")


def test_eval_mode_reads_only():
    m = _mc_ebc(zch=8, nb=2, return_remapped_features=True)
    _, r = m(_kjt([11, 12], [13]))
    state = {k: v.clone() for k, v in m.state_dict().items()}
    m.eval()
    _, r2 = m(_kjt([11, 99], [13]))  # 99 is new: its fallback row, nothing admitted or changed
    assert r2.values()[0] == r.values()[0] and r2.values()[2] == r.values()[2]
    assert m.mc_stats()["t.1"]["unadmitted"] == 1
    for k, v in m.state_dict().items():
        assert torch.equal(v, state[k]), k
    m.train()
    m(_kjt([99], []))
    assert 99 in m._managed_collision_collection.modules_by_table()["t.1"]._mch_raw_ids.tolist()


@pytest.mark.parametrize("sparse", [False, True], ids=["dense-grad", "sparse-grad"])
def test_a_row_given_to_a_new_id_forgets_the_gradient_kept_for_the_old_one(sparse: bool) -> None:
    cfg = EmbeddingBagConfig(name="t.1", num_embeddings=2, embedding_dim=4, feature_names=["f", "g"])
    ebc = EmbeddingBagCollection([cfg], sparse_grad=sparse)
    mcc = ManagedCollisionCollection(
        {"t.1": MCHManagedCollisionModule(2, num_buckets=1, eviction_policy=LRU_EvictionPolicy())},
        ebc.embedding_bag_configs(),
    )
    m = ManagedCollisionEmbeddingBagCollection(ebc, mcc, return_remapped_features=True)
    w = m._embedding_module.embedding_bags["t.1"].weight
    out, r1 = m(_kjt([11], [12]))  # micro-batch 1: ids 11 and 12 take both rows
    out.values().sum().backward()
    rows1 = dict(zip([11, 12], r1.values().tolist()))
    _, r2 = m(_kjt([12], [13]))  # micro-batch 2: 13 evicts 11 (least recently used), before its own backward
    taken = int(r2.values()[1])
    assert taken == rows1[11]
    grad = w.grad.to_dense() if sparse else w.grad
    assert torch.all(grad[taken] == 0), "the evicted id's kept gradient stayed on the row its successor took"
    assert torch.all(grad[rows1[12]] == 1)  # the staying id keeps its gradient (the sum of its bag's output)
