"""The shared-memory transport moves the same bytes as gloo: randomized against gloo's own collectives.

Every collective here runs twice, once through ``transport`` (shared memory on this host) and once through
torch.distributed's gloo, and the results are compared bit for bit (sums: same bits on every rank, and
close to gloo's, which adds in another order).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.distributed as dist

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, ShardingPlan, transport
from lightning_rec.sharding import (
    column_wise,
    data_parallel,
    full_state_dict,
    fused_optimizer,
    row_wise,
    shard_modules,
    table_row_wise,
    table_wise,
)
from lightning_rec.testing import run_distributed
from lightning_rec.transport import shm

pytestmark = pytest.mark.skipif(shm._wanted() is False, reason="shared-memory transport needs Linux x86-64")

DTYPES = (torch.float32, torch.int64, torch.bfloat16, torch.uint8, torch.float64)


def _gloo_all_to_all(x, out_splits, in_splits, group):
    out = torch.empty(sum(out_splits), *x.shape[1:], dtype=x.dtype)
    wire = torch.float32 if x.dtype == torch.bfloat16 else x.dtype  # gloo has no bfloat16
    got = torch.empty_like(out, dtype=wire)
    dist.all_to_all_single(got, x.to(wire), out_splits, in_splits, group=group)
    return got.to(x.dtype)


def _random_job(rank: int, ws: int, seed: int) -> list[str]:
    """Many collectives of random sizes (0 rows to several MB, growing the buffers) on the world and a subgroup."""
    sub = dist.new_group([0, ws - 1])
    assert transport.shared_group(None) is not None
    rng = random.Random(seed)
    checked = []
    for step in range(40):
        group = sub if step % 3 == 2 else None
        n = 2 if group is not None else ws
        # every rank draws the same numbers, also for a step it sits out; sizes[s][d]: rows rank s sends rank d
        dtype = DTYPES[rng.randrange(len(DTYPES))]
        width = rng.choice([1, 3, 64])
        big = rng.random() < 0.2
        sizes = [[rng.choice([0, 1, 7, 300] + ([5_000] if big else [])) for _ in range(n)] for _ in range(n)]
        rows = rng.choice([0, 1, 5000])
        if group is not None and rank not in (0, ws - 1):
            continue
        me = dist.get_rank(group)
        x = (torch.randn(sum(sizes[me]), width) * 100 + me).to(dtype)
        in_splits, out_splits = sizes[me], [sizes[s][me] for s in range(n)]
        out = torch.full((sum(out_splits), width), 7, dtype=dtype)
        assert transport.all_to_all_single(out, x, out_splits, in_splits, group) is None
        ref = _gloo_all_to_all(x, out_splits, in_splits, group)
        assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8)), (step, dtype, sizes)

        y = (torch.randn(rows, width) + me).to(dtype)
        gathered = torch.empty(n * rows, width, dtype=dtype)
        transport.all_gather_single(gathered, y, group)
        wire = torch.float32 if dtype == torch.bfloat16 else dtype
        ref = torch.empty(n * rows, width, dtype=wire)
        dist.all_gather_into_tensor(ref, y.to(wire), group=group)
        assert torch.equal(gathered, ref.to(dtype)), (step, dtype)

        if dtype in (torch.float32, torch.float64, torch.int64):
            z = (torch.randn(rows, width) * 10 + me).to(dtype)
            mine, theirs = z.clone(), z.clone()
            transport.all_reduce_sum(mine, group)
            dist.all_reduce(theirs, group=group)
            same = torch.empty(n * mine.numel(), dtype=dtype)
            dist.all_gather_into_tensor(same, mine.reshape(-1), group=group)
            assert all(torch.equal(p, mine.reshape(-1)) for p in same.chunk(n)), "ranks disagree"
            assert torch.allclose(mine, theirs, rtol=1e-5, atol=1e-4), (step, dtype)
        checked.append(f"{step}:{dtype}")
    return checked


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_random_collectives_match_gloo(ws: int) -> None:
    results = run_distributed(_random_job, ws, 11 + ws)
    assert results[0] and all(len(r) > 0 for r in results)


def _views_job(rank: int, ws: int, seed: int, shm: str) -> int:
    """all_to_all_views between strided views, against gloo's all-to-all of the same bytes made contiguous.
    ``shm="pairwise"``: through gloo as point-to-point messages (``pairwise=True``)."""
    pairwise = shm == "pairwise"
    os.environ["LIGHTNING_REC_SHM"] = "0" if pairwise else shm
    group = dist.new_group(list(range(ws)))  # set up under this rank's LIGHTNING_REC_SHM
    assert (transport.shared_group(group) is not None) == (shm == "1")
    rng = random.Random(seed)
    checked = 0
    for step in range(25):
        dtype = DTYPES[rng.randrange(len(DTYPES))]
        # rows[s][d] x width[s][d]: the message from rank s to rank d, sent as one or two strided pieces
        rows = [[rng.choice([0, 1, 5, 300, 20_000 if step % 7 == 3 else 2]) for _ in range(ws)] for _ in range(ws)]
        width = [[rng.choice([1, 3, 8]) for _ in range(ws)] for _ in range(ws)]
        split = [[rng.random() < 0.5 for _ in range(ws)] for _ in range(ws)]

        def pieces(t: torch.Tensor, two: bool) -> list[torch.Tensor]:
            return [t[: t.shape[0] // 2], t[t.shape[0] // 2 :]] if two else [t]

        sends, expected = [], []
        for d in range(ws):
            r, w = rows[rank][d], width[rank][d]
            base = (torch.randn(r, 2 * w + 1) * 100 + rank).to(dtype)
            piece = base[:, 1 : 1 + 2 * w : 2]  # every other column: not contiguous
            sends.append(pieces(piece, split[rank][d]))
            expected.append(piece.clone(memory_format=torch.contiguous_format).view(-1).view(torch.uint8))
        targets, recvs = [], []
        for s in range(ws):
            r, w = rows[s][rank], width[s][rank]
            target = torch.full((3 * w, r), 7, dtype=dtype)
            # [r, w], transposed: strided the other way; every third step one contiguous tensor (received in place)
            view = torch.full((r, w), 7, dtype=dtype) if step % 3 == 0 else target[w : 2 * w].t()
            targets.append(view)
            recvs.append(pieces(view, split[s][rank] != (step % 2 == 0)))  # split differently than sent
        transport.all_to_all_views(sends, recvs, group, pairwise=pairwise)
        send = torch.cat(expected)
        ref = torch.empty(sum(v.numel() * v.element_size() for v in targets), dtype=torch.uint8)
        dist.all_to_all_single(
            ref, send, [v.numel() * v.element_size() for v in targets], [e.numel() for e in expected], group=group
        )
        got = torch.cat([v.clone(memory_format=torch.contiguous_format).view(-1).view(torch.uint8) for v in targets])
        assert torch.equal(got, ref), (step, dtype)
        checked += 1
    if shm != "1":  # (gloo itself has no size check of its own that would not hang a peer)
        dist.destroy_process_group(group)
        return checked
    bad = [[torch.zeros(3)] for _ in range(ws)]
    try:
        transport.all_to_all_views(bad, [[torch.zeros(4 if rank == 0 else 3)] for _ in range(ws)], group)
    except RuntimeError as e:
        assert rank == 0 and "expected 16 bytes" in str(e), e
    else:
        assert rank != 0, "a size mismatch went unnoticed"
    dist.destroy_process_group(group)
    return checked


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("shm", ["1", "0", "pairwise"])
def test_views_between_strided_tensors_match_gloo(ws: int, shm: str) -> None:
    assert run_distributed(_views_job, ws, 5 + ws, shm) == [25] * ws


def _pieces_job(rank: int, ws: int, seed: int, shm: str) -> int:
    """all_to_all_pieces, its consumer reordering what arrived, against gloo's all-to-all of the same pieces.
    ``shm="pairwise"``: through gloo as point-to-point messages (``pairwise=True``)."""
    pairwise = shm == "pairwise"
    os.environ["LIGHTNING_REC_SHM"] = "0" if pairwise else shm
    group = dist.new_group(list(range(ws)))
    assert (transport.shared_group(group) is not None) == (shm == "1")
    rng = random.Random(seed)
    checked = 0
    for step in range(20):
        dtype = DTYPES[rng.randrange(len(DTYPES))]
        # sizes[s][d]: the numels of the pieces rank s sends rank d (every rank draws the same table)
        n_pieces = rng.choice([0, 1, 3, 26])
        sizes = [
            [[rng.choice([0, 1, 7, 2000, 90_000 if step % 5 == 2 else 3]) for _ in range(n_pieces)] for _ in range(ws)]
            for _ in range(ws)
        ]
        sends = [[(torch.randn(n) * 100 + rank).to(dtype) for n in sizes[rank][d]] for d in range(ws)]
        async_op = step % 2 == 1

        def piece_major(got: list[list[torch.Tensor]]) -> torch.Tensor:  # piece k of every source, then k + 1
            parts = [got[s][k] for k in range(n_pieces) for s in range(ws)]
            return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)

        pending = transport.all_to_all_pieces(
            sends,
            [sizes[s][rank] for s in range(ws)],
            piece_major,
            group,
            torch.device("cpu"),
            async_op=async_op,
            pairwise=pairwise,
        )
        send = torch.cat([t for lst in sends for t in lst]) if n_pieces else torch.zeros(0, dtype=dtype)
        out_splits = [sum(sizes[s][rank]) for s in range(ws)]
        ref = torch.empty(sum(out_splits), dtype=dtype)
        got = pending.wait()
        dist.all_to_all_single(ref, send, out_splits, [sum(sizes[rank][d]) for d in range(ws)], group=group)
        chunks = [list(torch.split(c, sizes[s][rank])) for s, c in enumerate(torch.split(ref, out_splits))]
        assert torch.equal(got, piece_major(chunks)), (step, dtype)
        assert pending.wait() is got  # computed once
        checked += 1
    dist.destroy_process_group(group)
    return checked


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("shm", ["1", "0", "pairwise"])
def test_pieces_reordered_on_arrival_match_gloo(ws: int, shm: str) -> None:
    assert run_distributed(_pieces_job, ws, 3 + ws, shm) == [20] * ws


def _no_names_job(rank: int, ws: int) -> tuple[bool, list[str]]:
    x = torch.arange(4.0) + rank
    transport.all_reduce_sum(x, None)
    dist.barrier()
    shared = transport.shared_group(None)
    assert shared is not None
    return True, sorted(n for n in os.listdir("/dev/shm") if shared.tag in n) if os.path.isdir("/dev/shm") else []


def test_segments_leave_no_names_behind() -> None:
    for shared, names in run_distributed(_no_names_job, 2):
        assert shared
        assert names == []  # anonymous memory files: nothing is ever in /dev/shm, so nothing stays after a crash


def _opt_out_job(rank: int, ws: int) -> tuple[bool, list[float]]:
    if rank == 1:
        os.environ["LIGHTNING_REC_SHM"] = "0"  # one rank opting out keeps the whole group on gloo
    x = torch.arange(3.0) + rank
    transport.all_reduce_sum(x, None)
    return transport.shared_group(None) is not None, x.tolist()


def test_one_rank_opting_out_keeps_the_group_on_gloo() -> None:
    (s0, x0), (s1, x1) = run_distributed(_opt_out_job, 2)
    assert not s0 and not s1
    assert x0 == x1 == [1.0, 3.0, 5.0]


def _fallback_job(rank: int, ws: int) -> list[bool]:
    """Rank 1 cannot grow its buffer (a full /dev/shm): that collective runs through gloo on every rank."""
    shared = transport.shared_group(None)
    assert shared is not None
    real = shm._File.grow
    if rank == 1:

        def full(self, nbytes):
            raise OSError(28, "No space left on device")

        shm._File.grow = full
    ok = []
    try:
        for rows in (10, 600_000, 10):  # 600k x 4 B: past the 1 MB a buffer starts with
            x = torch.arange(ws * rows, dtype=torch.float32) + 1000 * rank
            out = torch.empty_like(x)
            transport.all_to_all_single(out, x, [rows] * ws, [rows] * ws, None)
            ref = torch.empty_like(x)
            dist.all_to_all_single(ref, x, [rows] * ws, [rows] * ws)
            ok.append(torch.equal(out, ref))
    finally:
        shm._File.grow = real  # the process serves later tests
    return ok


def test_a_rank_without_room_sends_everyone_through_gloo() -> None:
    for ok in run_distributed(_fallback_job, 2):
        assert ok == [True, True, True]


def _leave_job(rank: int, ws: int) -> str:
    transport.all_reduce_sum(torch.ones(2), None)
    if rank == 1:
        transport.close_all()  # as after an exception: it will not join the next collective
        return "left"
    try:
        transport.all_reduce_sum(torch.ones(2), None)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_rank_that_leaves_makes_its_peers_raise_not_hang() -> None:
    r0, r1 = run_distributed(_leave_job, 2, timeout_s=60)
    assert r1 == "left"
    # "left the group", not the group timeout's message: the peer noticed the departure, it did not time out
    assert "rank 1" in r0 and "left the group" in r0, r0


def _model_job(rank: int, ws: int, shm: bool, kind: str, fused: bool, ids: torch.dtype = torch.long) -> dict:
    """A few steps of a sharded bag collection, through shared memory or gloo."""
    os.environ["LIGHTNING_REC_SHM"] = "1" if shm else "0"
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=40, feature_names=[f"f{i}"]) for i in range(3)
    ]
    plans = {
        "table_wise": lambda i: table_wise(i % ws),
        "row_wise": lambda i: row_wise([20, 20]),
        "column_wise": lambda i: column_wise([0, ws - 1]),
        "table_row_wise": lambda i: table_row_wise(0),
        "data_parallel": lambda i: data_parallel(),
    }
    plan = ShardingPlan({"": {f"t{i}": plans[kind](i) for i in range(3)}})
    model = shard_modules(
        EmbeddingBagCollection(tables), plan, embedding_optimizer={"kind": "sgd", "lr": 0.1} if fused else None
    )
    opt = fused_optimizer(model) if fused else torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(4):
        lengths = torch.randint(0, 4, (3 * 5,), generator=g)
        values = torch.randint(0, 40, (int(lengths.sum()),), generator=g)
        kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=values.to(ids), lengths=lengths.to(ids))
        out = model(kjt).values()
        (out * torch.arange(out.numel()).view_as(out)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert (transport.shared_group(model.shard_group) is not None) == shm
    return {k: v.clone() for k, v in full_state_dict(model).items()}


@pytest.mark.parametrize("kind", ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"])
def test_training_is_the_same_through_either_transport(kind: str) -> None:
    for fused in (False, True):
        via_shm = run_distributed(_model_job, 2, True, kind, fused)
        via_gloo = run_distributed(_model_job, 2, False, kind, fused)
        for a, b in zip(via_shm, via_gloo):
            assert a.keys() == b.keys() and a
            for k in a:
                if kind == "data_parallel" and not fused:  # a gradient all-reduce: sums in another order
                    torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-6)
                else:
                    assert torch.equal(a[k], b[k]), (kind, fused, k)


@pytest.mark.parametrize("kind", ["table_wise", "row_wise", "column_wise", "table_row_wise"])
def test_int32_ids_and_lengths_train_as_int64_ones(kind: str) -> None:
    """The input dist moves raw bytes of int64 buffers: narrower ids must be widened on the way, not reinterpreted."""
    for a, b in zip(
        run_distributed(_model_job, 2, True, kind, True, torch.int32),
        run_distributed(_model_job, 2, True, kind, True, torch.long),
    ):
        assert a.keys() == b.keys() and a
        assert all(torch.equal(a[k], b[k]) for k in a), kind


def _wire_job(rank: int, ws: int, big_raw_id: bool) -> tuple[list[torch.dtype], list[float]]:
    """The dtypes the input dist hands torch.distributed, and what a raw-id (managed-collision) step computes."""
    from lightning_rec.mc import (
        ManagedCollisionCollection,
        ManagedCollisionEmbeddingBagCollection,
        MCHManagedCollisionModule,
    )

    os.environ["LIGHTNING_REC_SHM"] = "0"
    tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=16, feature_names=["f"])]
    torch.manual_seed(0)
    mcc = ManagedCollisionCollection({"t": MCHManagedCollisionModule(16, num_buckets=2)}, tables)
    model = shard_modules(
        ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables), mcc, return_remapped_features=False),
        ShardingPlan({"_embedding_module": {"t": row_wise([8, 8])}}),
    )
    raw = [3, 2**40 + 7 if big_raw_id and rank == 1 else 9, 1 << 20]
    seen, orig = [], dist.all_to_all_single

    def spy(out, inp, *a, **kw):
        seen.append(inp.dtype)
        return orig(out, inp, *a, **kw)

    dist.all_to_all_single = spy
    try:
        out, _ = model(KeyedJaggedTensor(["f"], torch.tensor(raw), lengths=torch.tensor([2, 1])))
    finally:
        dist.all_to_all_single = orig
    return seen, out.values().flatten().tolist()


def test_ids_travel_as_int32_through_gloo_only_when_every_rank_s_fit() -> None:
    small = run_distributed(_wire_job, 2, False)
    big = run_distributed(_wire_job, 2, True)
    for seen, _ in small:
        assert torch.int32 in seen, seen  # the payload, narrowed (the header stays int64)
    for seen, _ in big:
        assert torch.int32 not in seen, seen  # rank 1's raw id needs int64, so every rank sends int64
    # the raw id that differs is rank 1's: rank 0's pooled rows are the same either way, rank 1's are not
    assert small[0][1] == big[0][1] and small[1][1] != big[1][1]


def _fd_job(rank: int, ws: int, shm: str) -> int:
    """Groups come and go (every shard_modules makes one): their descriptors go with them."""
    os.environ["LIGHTNING_REC_SHM"] = shm
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        group = dist.new_group(list(range(ws)))
        transport.all_reduce_sum(torch.ones(3), group)
        dist.destroy_process_group(group)
    transport.close_all()
    return len(os.listdir("/proc/self/fd")) - before


def test_closed_groups_release_their_descriptors() -> None:
    gloo = run_distributed(_fd_job, 2, "0")  # gloo itself keeps a descriptor or so per group
    for with_shm, without in zip(run_distributed(_fd_job, 2, "1"), gloo):
        assert with_shm <= without, (with_shm, without)


def _diverge_job(rank: int, ws: int) -> str:
    x = torch.ones(4)
    try:
        if rank == 0:
            transport.all_reduce_sum(x, None)
        else:  # the same byte count through another collective: without identities, silent garbage
            out = torch.empty(4 * ws)
            transport.all_gather_single(out, x, None)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_ranks_running_different_collectives_all_raise_naming_both() -> None:
    for msg in run_distributed(_diverge_job, 3, timeout_s=60):
        assert "different collectives" in msg, msg
        assert "all_reduce_sum of torch.float32, 16 bytes" in msg and "all_gather of torch.float32, 16 bytes" in msg


def _fail_job(rank: int, ws: int) -> str:
    transport.all_reduce_sum(torch.ones(2), None)  # the group is set up
    real = shm._SharedGroup._write
    if rank == 1:

        def broken(self, pieces, ranges):
            raise MemoryError("simulated failure while writing")

        shm._SharedGroup._write = broken
    try:
        transport.all_reduce_sum(torch.ones(2), None)
    except (RuntimeError, MemoryError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        shm._SharedGroup._write = real
    return "no error"


def test_a_collective_that_fails_on_one_rank_fails_on_every_rank() -> None:
    msgs = run_distributed(_fail_job, 3, timeout_s=60)
    assert msgs[1].startswith("MemoryError"), msgs
    for r in (0, 2):  # they learn it from the published status, not from the timeout or rank 1 leaving
        assert "rank 1 failed in collective" in msgs[r], msgs[r]


def _sum_order_job(rank: int, ws: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(10_000, generator=g) * 10 ** torch.randint(-3, 4, (10_000,), generator=g)
    shared, ref = x.clone(), x.clone()
    transport.all_reduce_sum(shared, None)
    dist.all_reduce(ref)  # gloo's own order
    xs = []
    for r in range(ws):
        gr = torch.Generator().manual_seed(r)
        xs.append(torch.randn(10_000, generator=gr) * 10 ** torch.randint(-3, 4, (10_000,), generator=gr))
    return {
        "shared": shared,
        "gloo": ref,
        "rank_order": sum(xs[1:], xs[0].clone()),
        "exact": sum(v.double() for v in xs),
        "magnitude": sum(v.double().abs() for v in xs),
    }


@pytest.mark.parametrize("ws", [3, 4])
def test_the_sum_all_reduce_agrees_bitwise_across_ranks_and_with_gloo_within_rounding(ws: int) -> None:
    results = run_distributed(_sum_order_job, ws)
    for r in results:
        # every rank adds in rank order: the same bits everywhere, the single-process left-to-right sum
        assert torch.equal(r["shared"], results[0]["shared"])
        assert torch.equal(r["shared"], r["rank_order"])
        # gloo adds in its own order: each is within float32 summation's rounding bound of the exact sum
        # ((ranks - 1) units of rounding of the summands' magnitude), so they differ by rounding only
        for got in (r["shared"], r["gloo"]):
            assert bool(((got.double() - r["exact"]).abs() <= (ws - 1) * 2**-24 * r["magnitude"] * 1.01).all())
