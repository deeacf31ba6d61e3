"""Fast readers against a plain-Python reference; Parquet / npy conversion; block shuffle; resumable loaders."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from lightning_rec.cli import main as cli_main
from lightning_rec.data import (
    CRITEO_CARDINALITIES,
    ClickDataModule,
    ClickLoader,
    CriteoNpy,
    CriteoParquet,
    CriteoTSV,
    SyntheticClicks,
)
from lightning_rec.data._hashing import hash_into
from lightning_rec.data.convert import convert

CARDS = [5, 1000, 7, 100000] * 6 + [3, 11]


def write_lines(path, n: int, seed: int, hex_len=8) -> list[list[str]]:
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        ints = ["" if rng.random() < 0.2 else str(int(rng.integers(-5, 10**6))) for _ in range(13)]
        cats = []
        for _ in range(26):
            k = hex_len if hex_len else int(rng.integers(1, 17))
            v = "" if rng.random() < 0.15 else "".join(rng.choice(list("0123456789abcdefABCDEF"), k))
            cats.append(v)
        lines.append([str(int(rng.integers(0, 2))), *ints, *cats])
    path.write_text("".join("\t".join(f) + "\n" for f in lines))
    return lines


def reference(lines: list[list[str]], cards=CARDS):
    """Plain Python: dense log1p(max(x, 0)), per-feature hash of int(hex, 16), missing id = empty bag."""
    dense = np.log1p(np.maximum([[int(v) if v else 0 for v in f[1:14]] for f in lines], 0)).astype(np.float32)
    ids = [
        [int(hash_into(np.asarray([int(f[14 + j], 16)], dtype=np.uint64), j, cards[j])[0]) for f in lines if f[14 + j]]
        for j in range(26)
    ]
    lengths = [[1 if f[14 + j] else 0 for f in lines] for j in range(26)]
    return dense, ids, lengths, [float(f[0]) for f in lines]


def flat(batches):
    dense = torch.cat([b.dense for b in batches]).numpy()
    ids = [torch.cat([b.sparse[f"cat_{j}"].values() for b in batches]).tolist() for j in range(26)]
    lengths = [torch.cat([b.sparse[f"cat_{j}"].lengths() for b in batches]).tolist() for j in range(26)]
    return dense, ids, lengths, torch.cat([b.labels for b in batches]).tolist()


def assert_same(got, want) -> None:
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert got[1:] == want[1:]


@pytest.mark.parametrize("hex_len", [8, 0])  # Criteo's 8-digit ids (fast path) and 1-16 digits of mixed case
def test_tsv_parser_matches_plain_python(tmp_path, hex_len: int) -> None:
    lines = write_lines(tmp_path / "a", 700, seed=hex_len, hex_len=hex_len)  # several index blocks of 256 lines
    lines += write_lines(tmp_path / "b", 300, seed=9, hex_len=hex_len)
    assert_same(flat(list(CriteoTSV(str(tmp_path), 96, cardinalities=CARDS))), reference(lines))
    # a window crossing the file boundary, read in odd-sized batches, and a shard of it
    assert_same(
        flat(list(CriteoTSV(str(tmp_path), 37, cardinalities=CARDS, start=650, num_rows=200))),
        reference(lines[650:850]),
    )


def test_tsv_ranks_read_only_their_rows_and_last_line_without_newline(tmp_path) -> None:
    lines = write_lines(tmp_path / "d", 530, seed=3)
    (tmp_path / "d").write_text((tmp_path / "d").read_text().rstrip("\n"))
    ws, bs = 3, 16
    single = CriteoTSV(str(tmp_path / "d"), bs, cardinalities=CARDS)
    shards = [CriteoTSV(str(tmp_path / "d"), bs, cardinalities=CARDS, rank=r, world_size=ws) for r in range(ws)]
    assert len({len(s) for s in shards}) == 1
    rows = [set(map(int, ids)) for s in shards for ids in s.remaining_row_ids()]
    assert sorted(r for s in rows for r in s) == list(range(530))
    got = [flat(list(s)) for s in shards]
    assert sorted(x for g in got for x in g[3]) == sorted(reference(lines)[3])
    assert_same(flat(list(single)), reference(lines))


def test_convert_to_parquet_and_npy_reads_the_same_rows(tmp_path) -> None:
    (tmp_path / "tsv").mkdir()
    lines = write_lines(tmp_path / "tsv" / "day_0", 300, seed=5)
    lines += write_lines(tmp_path / "tsv" / "day_1", 120, seed=6)
    seen = []
    assert (
        convert(
            str(tmp_path / "tsv"),
            str(tmp_path / "pq"),
            "parquet",
            chunk_rows=100,
            progress=lambda d, t, s: seen.append((d, t)),
        )
        == 420
    )
    assert seen[-1] == (420, 420) and len(seen) == 5  # 3 + 2 chunks
    tsv = CriteoTSV(str(tmp_path / "tsv"), 64, cardinalities=CARDS, shuffle=True, shuffle_block=50, seed=1)
    pq_ = CriteoParquet(str(tmp_path / "pq"), 64, cardinalities=CARDS, shuffle=True, shuffle_block=50, seed=1)
    assert_same(flat(list(pq_)), flat(list(tsv)))
    assert_same(flat(list(CriteoParquet(str(tmp_path / "pq"), 64, cardinalities=CARDS))), reference(lines))
    dm = ClickDataModule(
        source="criteo_parquet",
        path=str(tmp_path / "pq"),
        batch_size=32,
        train_rows=None,
        val_rows=20,
        test_rows=0,
        cardinalities=CARDS,
    )
    assert_same(flat(list(dm.val_dataloader())), reference(lines[400:]))
    assert sorted(flat(list(dm.train_dataloader()))[3]) == sorted(reference(lines[:400])[3])
    assert (
        cli_main(
            [
                "convert",
                str(tmp_path / "tsv"),
                "--out",
                str(tmp_path / "npy"),
                "--format",
                "npy",
                "--chunk-rows",
                "128",
                "--quiet",
            ]
        )
        == 0
    )
    npy = flat(list(CriteoNpy(str(tmp_path / "npy"), 64)))
    want = reference([f[:14] + [v or "0" for v in f[14:]] for f in lines], cards=CRITEO_CARDINALITIES)
    assert_same(npy, want)  # npy has no empty bags: a missing id is the hash of 0


def test_convert_stops_at_a_bad_line_and_leaves_nothing(tmp_path, capsys) -> None:
    write_lines(tmp_path / "d", 50, seed=1)
    text = (tmp_path / "d").read_text().split("\n")
    text[40] = text[40].replace("\t", "\tzz", 1)  # column 2 (integer feature 0) becomes zz...
    (tmp_path / "d").write_text("\n".join(text))
    assert cli_main(["convert", str(tmp_path / "d"), "--out", str(tmp_path / "o"), "--chunk-rows", "16"]) == 2
    err = capsys.readouterr().err
    assert "d:41: column 2 (integer feature 0)" in err and "convert: 32/50 rows" in err
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


@pytest.mark.parametrize("reader", ["tsv", "npy"])
def test_block_shuffle_is_a_seeded_permutation_per_epoch_and_resumes_at_any_world_size(tmp_path, reader) -> None:
    n = 1000
    if reader == "tsv":
        write_lines(tmp_path / "d", n, seed=2)

        def make(**kw):
            return CriteoTSV(str(tmp_path / "d"), cardinalities=CARDS, **{"shuffle": True, "shuffle_block": 64, **kw})
    else:
        rng = np.random.default_rng(0)
        for name, a in (
            ("X_int", rng.integers(0, 9, (n, 13))),
            ("X_cat", rng.integers(0, 9, (n, 26))),
            ("y", rng.integers(0, 2, n)),
        ):
            np.save(tmp_path / f"{name}.npy", a)

        def make(**kw):
            return CriteoNpy(str(tmp_path), **{"shuffle": True, "shuffle_block": 64, **kw})

    def order(ds, epoch, position=0):
        ds.set_position(epoch, position)
        return [int(r) for ids in ds.remaining_row_ids() for r in ids]

    e0, e1 = order(make(batch_size=30), 0), order(make(batch_size=30), 1)
    assert sorted(e0) == sorted(e1) == list(range(n)) and e0 != e1 and e0 != list(range(n))
    assert e0 == order(make(batch_size=30, seed=0), 0) != order(make(batch_size=30, seed=1), 0)
    # 2 ranks read 5 global batches of 2 x 30 rows, then 3 ranks (batch 17) read the rest: each row once
    done = make(batch_size=30, world_size=2)
    done.set_position(1)
    position = done.position_after(5)
    assert position == 300
    first = [
        r for rank in range(2) for r in order(make(batch_size=30, rank=rank, world_size=2), 1) if e1.index(r) < position
    ]
    rest = [r for rank in range(3) for r in order(make(batch_size=17, rank=rank, world_size=3), 1, position)]
    assert Counter(first + rest) == Counter(range(n))
    # the rows a rank reads are the rows the shuffled order says
    ds = make(batch_size=30)
    ds.set_position(1)
    got = torch.cat([b.labels for b in ds]).tolist()
    want = make(batch_size=n, shuffle=False)
    labels = torch.cat([b.labels for b in want]).numpy()
    assert got == labels[e1].tolist()


@pytest.mark.parametrize("workers", [0, 2])
def test_click_loader_resumes_at_the_next_batch(tmp_path, workers: int) -> None:
    write_lines(tmp_path / "d", 400, seed=4)

    def loader():
        ds = CriteoTSV(str(tmp_path / "d"), 24, cardinalities=CARDS, shuffle=True, shuffle_block=40, seed=3)
        return ClickLoader(ds, num_workers=workers)

    full = loader()
    epochs = [[b.labels.tolist() + b.sparse.values().tolist() for b in full] for _ in range(2)]
    assert epochs[0] != epochs[1] and len(epochs[0]) == len(full) == 17
    for stop in (5, 17):  # mid-epoch, and after the last batch of the epoch
        first = loader()
        it = iter(first)
        seen = [next(it) for _ in range(stop)]
        assert [b.labels.tolist() + b.sparse.values().tolist() for b in seen] == epochs[0][:stop]
        state = first.state_dict()
        resumed = loader()
        resumed.load_state_dict(state)
        rest = [b.labels.tolist() + b.sparse.values().tolist() for b in resumed]
        if stop < 17:
            assert rest == epochs[0][stop:]
            rest = [b.labels.tolist() + b.sparse.values().tolist() for b in resumed]
        assert rest == epochs[1]
    other = ClickLoader(CriteoTSV(str(tmp_path / "d"), 24, cardinalities=CARDS, shuffle=True, shuffle_block=40, seed=4))
    with pytest.raises(ValueError, match="saved for other data"):
        other.load_state_dict(state)


def test_synthetic_train_rows_are_fresh_each_epoch_and_validation_rows_fixed() -> None:
    cards = [50] * 26
    train = ClickLoader(SyntheticClicks(64, 16, seed=1, cardinalities=cards))
    e0, e1 = [torch.cat([b.dense for b in train]) for _ in range(2)]
    assert not torch.equal(e0, e1)
    # epoch 0 is the rows of old; epoch 1 is new rows of the same task, a pure function of (seed, epoch)
    assert torch.equal(e0, torch.cat([b.dense for b in SyntheticClicks(64, 16, seed=1, cardinalities=cards)]))
    again = SyntheticClicks(64, 16, seed=1, cardinalities=cards)
    again.set_position(1)
    assert torch.equal(e1, torch.cat([b.dense for b in again]))
    val = ClickLoader(SyntheticClicks(64, 16, seed=1, cardinalities=cards, split="val"))
    assert torch.equal(*[torch.cat([b.dense for b in val]) for _ in range(2)])


def test_click_loader_starts_an_epoch_only_when_a_batch_is_taken() -> None:
    loader = ClickLoader(SyntheticClicks(32, 16, seed=2, cardinalities=[50] * 26))
    iter(loader)  # a probe, as Lightning's iterable check does: no epoch consumed
    assert loader.state_dict()["epoch"] == 0
    first = [b.dense for b in loader]
    assert (loader.state_dict()["epoch"], loader.state_dict()["position"]) == (0, 32)  # epoch 0 read whole
    again = SyntheticClicks(32, 16, seed=2, cardinalities=[50] * 26)
    assert all(torch.equal(a, b.dense) for a, b in zip(first, again))


def test_loader_state_is_the_same_on_every_rank_and_resumes_at_another_world_size(tmp_path) -> None:
    write_lines(tmp_path / "d", 230, seed=8)

    def ds(rank: int, world: int, batch: int) -> CriteoTSV:
        return CriteoTSV(
            str(tmp_path / "d"),
            batch,
            cardinalities=CARDS,
            rank=rank,
            world_size=world,
            shuffle=True,
            shuffle_block=16,
            seed=5,
        )

    old = [ClickLoader(ds(r, 2, 10)) for r in range(2)]
    taken = []
    for loader in old:
        it = iter(loader)
        for _ in range(4):  # 4 global batches of 2 x 10 rows
            next(it)
        taken += [int(r) for ids in ds(old.index(loader), 2, 10).remaining_row_ids()[:4] for r in ids]
    states = [loader.state_dict() for loader in old]
    assert states[0] == states[1] and (states[0]["position"], states[0]["batches"]) == (80, 4)
    rest = []
    for r in range(3):
        new = ClickLoader(ds(r, 3, 7))
        # 4 batches taken + 8 left at 3 ranks > the 11 batches of an epoch at 3 ranks: Lightning's counter would
        # end the epoch early, and the loader says so
        with pytest.warns(UserWarning, match="ends this epoch after 7 of them"):
            new.load_state_dict(states[0])
        rows = sum(len(b) for b in new)  # reads from the loaded position on
        new.stream.set_position(0, 80)
        ids = [int(x) for batch in new.stream.remaining_row_ids() for x in batch]
        assert rows == len(ids)
        rest += ids
    assert Counter(taken + rest) == Counter(range(230))  # no row skipped, none read twice
