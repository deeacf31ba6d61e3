"""The input dist's payload (bucketing by row block, route order, weight bits) against a loop over routes and
bags, on one process: no process group is needed to build what a rank sends."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_rec import KeyedJaggedTensor
from lightning_rec.pipeline import input_dist as dists
from lightning_rec.pipeline import input_payload as payloads
from lightning_rec.pipeline.input_payload import PayloadKind, build_bucketing, payload_kind
from lightning_rec.pipeline.routing import build_routing
from lightning_rec.plans.shard_geometry import ShardMeta


def _expected(kjt: KeyedJaggedTensor, weights, routing):
    """Per route: (bag lengths, local ids, weights, positions in the feature's ids), by plain loops."""
    b, lengths, values = kjt.stride(), kjt.lengths().tolist(), kjt.values().tolist()
    opk = kjt.offset_per_key()
    out = []
    for r in routing.all_routes:
        lo, hi = r.shard.row_offset, r.shard.row_offset + r.shard.rows
        lens, ids, ws, pos, i = [], [], [], [], opk[r.feature]
        for bag in range(b):
            n = 0
            for _ in range(lengths[r.feature * b + bag]):
                if lo <= values[i] < hi:
                    ids.append(values[i] - lo)
                    pos.append(i - opk[r.feature])
                    ws.append(None if weights is None else float(weights[i]))
                    n += 1
                i += 1
            lens.append(n)
        out.append((lens, ids, ws, pos))
    return out


def _case(seed: int):
    rng = random.Random(seed)
    n_tables, ws = rng.randint(1, 4), rng.randint(2, 4)
    shards, feature_table = [], []
    for t in range(n_tables):
        rows = rng.randint(1, 12)
        kind = rng.choice(["table", "rows", "rows", "grid", "grid", "dp"])
        if kind == "dp":
            shards.append(None)
        elif kind == "table":
            shards.append([ShardMeta(0, rows, 0, 4, rng.randrange(ws))])
        else:  # every shard of a table on its own rank
            cols = [(0, 4)] if kind == "rows" or ws < 2 else [(0, 2), (2, 2)]
            cuts = sorted(
                rng.randint(0, rows) for _ in range(rng.randint(min(1, ws // len(cols) - 1), ws // len(cols) - 1))
            )
            blocks = [(a, b - a) for a, b in zip([0, *cuts], [*cuts, rows])]
            ranks = iter(rng.sample(range(ws), len(blocks) * len(cols)))
            shards.append([ShardMeta(o, n, c, w, next(ranks)) for o, n in blocks for c, w in cols])
        feature_table += [t] * rng.randint(1, 2)
    tables_rows = [max((s.row_offset + s.rows for s in sh), default=1) if sh else rng.randint(1, 9) for sh in shards]
    b = rng.randint(0, 4)
    lengths = torch.tensor([rng.randint(0, 3) for _ in range(len(feature_table) * b)], dtype=torch.long)
    ids = [
        rng.randrange(tables_rows[feature_table[f]])
        for f in range(len(feature_table))
        for _ in range(int(lengths[f * b : (f + 1) * b].sum()))
    ]
    kjt = KeyedJaggedTensor(
        [f"f{i}" for i in range(len(feature_table))], torch.tensor(ids, dtype=torch.long), lengths=lengths
    )
    local = [t for t, sh in enumerate(shards) if sh and any(s.rank == 0 and s.rows for s in sh)]
    routing = build_routing(feature_table, [4] * len(feature_table), shards, local, 0, ws)
    return kjt, torch.rand(len(ids), dtype=torch.float64), routing


@pytest.mark.parametrize("seed", range(40))
def test_payload_matches_a_loop_over_routes_and_bags(seed: int) -> None:
    kjt, weights, routing = _case(seed)
    want = _expected(kjt, weights, routing)
    bk = build_bucketing(routing)
    # one row block from row 0 per routed table: exactly when no id needs bucketing
    whole = all(r.shard.row_offset == 0 for r in routing.all_routes)
    assert bk.single_block == whole
    assert bk.route_features == tuple(r.feature for r in routing.all_routes)
    if bk.single_block:
        kind = payload_kind(bk, True, False, "cpu")
        in_order = [r.feature for r in routing.all_routes] == list(range(len(kjt.keys())))
        assert kind is (PayloadKind.KJT if in_order else PayloadKind.FEATURE_SLICES)
        outs = [
            payloads.build_payload(kind, kjt, weights, bk, True, {}),
            payloads.route_payload(kjt, weights, bk),
        ]
    else:  # torch's one-sort path, its general one and fbgemm's bucketize must all agree
        torch_kind = payload_kind(bk, False, False, "cpu")
        # one sort by route where no row block of a feature is read by two routes (column shards of one block)
        blocks = {(r.feature, r.shard.row_offset) for r in routing.all_routes}
        assert (bk.bucket_route_rel is None) == (len(blocks) < len(routing.all_routes))
        assert torch_kind is (PayloadKind.BUCKET_SORT if bk.bucket_route_rel is None else PayloadKind.ROUTE_SORT)
        outs = [
            payloads.build_payload(torch_kind, kjt, weights, bk, True, {}),
            payloads.bucketed_payload(kjt, weights, bk, with_positions=True),
            payloads.fbgemm_payload(kjt, weights, bk, with_positions=True),
        ]
        # unweighted and without positions, fbgemm's kernel skips the order: the same ids and lengths
        bare = payloads.fbgemm_payload(kjt, None, bk, with_positions=False)
        assert [x.tolist() for x in bare.per_route(kjt.stride())[1]] == [w[1] for w in want]
        assert [x.tolist() for x in bare.per_route(kjt.stride())[0]] == [w[0] for w in want]
    for out in outs:
        assert out.sent == [len(w[1]) for w in want]
        lengths, values, ws = out.flat(kjt.stride(), torch.device("cpu"))
        assert lengths.tolist() == [n for w in want for n in w[0]]
        assert values.tolist() == [i for w in want for i in w[1]]
        assert ws.tolist() == [x for w in want for x in w[2]]
        by_route = out.per_route(kjt.stride())
        assert [x.tolist() for x in by_route[1]] == [w[1] for w in want]
        assert [x.tolist() for x in by_route[0]] == [w[0] for w in want]
        for pos, w in zip(out.positions, want):
            assert (list(range(len(w[3]))) if pos is None else pos.tolist()) == w[3]


def test_fbgemm_bucketize_keeps_the_weights_gradient() -> None:
    # fbgemm's own bucketized weights have no gradient (FBGEMM_CPU.md F13): ours are gathered by its order
    shards = [[ShardMeta(0, 3, 0, 4, 0), ShardMeta(3, 4, 0, 4, 1)]]
    bk = build_bucketing(build_routing([0], [4], shards, [0], 0, 2))
    kjt = KeyedJaggedTensor(["a"], torch.tensor([5, 1, 6, 2]), lengths=torch.tensor([3, 1]))
    w = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    out = payloads.fbgemm_payload(kjt, w, bk, with_positions=False)
    assert [x.tolist() for x in out.pieces[2]] == [[2.0, 4.0], [1.0, 3.0]]
    assert [x.tolist() for x in out.pieces[1]] == [[1, 2], [2, 3]]
    sum(p.sum() * (k + 1) for k, p in enumerate(out.pieces[2])).backward()
    assert w.grad.tolist() == [2.0, 1.0, 2.0, 1.0]


def test_weights_travel_as_their_bits_exactly() -> None:
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        w = torch.tensor([0.1, -3.5, float("inf"), 1e-30, float("nan")]).to(dtype)
        back = dists.from_int64(dists.as_int64(w), dtype)
        assert back.dtype == dtype and torch.equal(back.view(torch.uint8), w.view(torch.uint8))


def test_one_rank_group_returns_its_own_payload_with_its_batch_size() -> None:
    routing = build_routing([0], [4], [[ShardMeta(0, 5, 0, 4, 0)]], [0], 0, 1)
    kjt = KeyedJaggedTensor(["a"], torch.tensor([1, 4, 0]), lengths=torch.tensor([2, 1]))
    input_dist = dists.InputDist(routing, None, torch.device("cpu"))
    got = input_dist.start_input_dist(kjt, None).wait()
    assert got.batches == (2,) and got.values.tolist() == [1, 4, 0] and got.lengths.tolist() == [2, 1]
    with pytest.raises(dists.InputRejected):
        input_dist.start_input_dist(kjt, None, rejected=True)
