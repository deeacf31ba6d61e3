"""lightning_rec.data: sharding rule, synthetic clicks, Criteo readers, the DataModule."""

from __future__ import annotations

import math
import warnings
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_rec.data import (
    CRITEO_CARDINALITIES,
    Batch,
    ClickDataModule,
    CriteoNpy,
    CriteoTSV,
    SyntheticClicks,
    collate,
    rank_batch_ranges,
)
from tests.lightning.models import QUIET_TRAINER

# -- helpers -----------------------------------------------------------------------------------------------


def rows_of(batch: Batch) -> list[tuple]:
    """One hashable tuple per row: dense values, each feature's ids, label."""
    b = len(batch)
    per_feature = [jt.to_dense() for jt in (batch.sparse[k] for k in batch.sparse.keys())]  # noqa: SIM118 (a KJT)
    return [
        (tuple(batch.dense[i].tolist()), tuple(tuple(f[i].tolist()) for f in per_feature), float(batch.labels[i]))
        for i in range(b)
    ]


def all_rows(batches) -> list[tuple]:
    return [r for b in batches for r in rows_of(b)]


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    pos, neg = scores[labels == 1][:, None], scores[labels == 0][None, :]
    return float(((pos > neg) + 0.5 * (pos == neg)).mean())


SMALL = [50, 7, 3, 20, 11] * 5 + [9]  # 26 small tables for fast tests

# -- the sharding rule ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("drop_last", [False, True])
def test_rank_batch_ranges_cover_every_row_once_with_equal_batch_counts(drop_last: bool) -> None:
    for n in range(70):
        for bs in (1, 3, 8):
            for ws in (1, 2, 3, 4):
                if 0 < n < ws and not drop_last:
                    with pytest.raises(ValueError, match=f"{n} rows cannot be split over {ws} ranks"):
                        rank_batch_ranges(n, bs, 0, ws, drop_last)
                    continue
                per_rank = [rank_batch_ranges(n, bs, r, ws, drop_last) for r in range(ws)]
                rows = [i for ranges in per_rank for a, b in ranges for i in range(a, b)]
                want = n - n % (bs * ws) if drop_last else n
                assert sorted(rows) == list(range(want)), (n, bs, ws)
                assert len({len(r) for r in per_rank}) == 1, (n, bs, ws)  # same number of batches
                sizes = [b - a for ranges in per_rank for a, b in ranges]
                assert all(1 <= s <= bs + 1 for s in sizes), (n, bs, ws, sizes)
                if drop_last:
                    assert set(sizes) <= {bs}


# -- synthetic clicks ----------------------------------------------------------------------------------------


def test_synthetic_is_deterministic_and_independent_of_batching() -> None:
    a = all_rows(SyntheticClicks(100, 16, seed=3, cardinalities=SMALL))
    assert len(a) == 100
    assert a == all_rows(SyntheticClicks(100, 16, seed=3, cardinalities=SMALL))
    assert a == all_rows(SyntheticClicks(100, 7, seed=3, cardinalities=SMALL))  # rows don't depend on batch size
    assert a != all_rows(SyntheticClicks(100, 16, seed=4, cardinalities=SMALL))
    val = all_rows(SyntheticClicks(100, 16, seed=3, cardinalities=SMALL, split="val"))
    assert not set(a) & set(val)


@pytest.mark.parametrize("n, ws", [(103, 1), (103, 2), (103, 3), (97, 4), (9, 4)])
def test_synthetic_ranks_read_disjoint_rows_and_lose_none(n: int, ws: int) -> None:
    single = all_rows(SyntheticClicks(n, 8, seed=1, cardinalities=SMALL))
    shards = [list(SyntheticClicks(n, 8, seed=1, rank=r, world_size=ws, cardinalities=SMALL)) for r in range(ws)]
    assert len({len(s) for s in shards}) == 1  # every rank runs the same number of steps
    assert all(len(b) > 0 for s in shards for b in s)
    got = [row for s in shards for row in all_rows(s)]
    assert len(got) == n and Counter(got) == Counter(single)
    assert [len(s) for s in shards] == [
        len(SyntheticClicks(n, 8, rank=r, world_size=ws, cardinalities=SMALL)) for r in range(ws)
    ]


def test_synthetic_dataloader_workers_keep_order() -> None:
    ds = SyntheticClicks(200, 16, seed=2, cardinalities=SMALL)
    one = all_rows(DataLoader(ds, batch_size=None))
    two = all_rows(DataLoader(ds, batch_size=None, num_workers=2))
    assert one == two and len(one) == 200


def test_synthetic_shape_and_statistics() -> None:
    ds = SyntheticClicks(4096, 4096, size=1e-3, multi_hot={"cat_1": 6})
    assert ds.cardinalities == [min(c, max(16, math.ceil(c * 1e-3))) for c in CRITEO_CARDINALITIES]
    assert ds.feature_names == [f"cat_{i}" for i in range(26)] and ds.num_dense == 13
    (batch,) = list(ds)
    assert batch.dense.shape == (4096, 13) and batch.dense.dtype == torch.float32
    assert batch.labels.dtype == torch.float32 and set(batch.labels.unique().tolist()) == {0.0, 1.0}
    assert 0.1 < float(batch.labels.mean()) < 0.5
    assert float(batch.dense.min()) >= 0  # log1p of counts
    lengths = batch.sparse.lengths().view(26, 4096)
    assert set(lengths[1].unique().tolist()) == set(range(7))  # multi-hot: 0..6 ids, empty bags included
    assert bool((lengths[[i for i in range(26) if i != 1]] == 1).all())
    for i, name in enumerate(ds.feature_names):
        ids = batch.sparse[name].values()
        assert int(ids.min()) >= 0 and int(ids.max()) < ds.cardinalities[i], name
    # Zipf: the most frequent id of a big table is far above its uniform share
    big = batch.sparse["cat_0"].values()
    assert int(torch.bincount(big).max()) > 50 * 4096 / ds.cardinalities[0]


def test_synthetic_is_learnable() -> None:
    ds = SyntheticClicks(6000, 6000, seed=0, cardinalities=SMALL)
    train = next(iter(ds))
    test = next(iter(SyntheticClicks(4000, 4000, seed=0, cardinalities=SMALL, split="test")))
    # logistic regression: dense features plus a scalar weight per (feature, id)
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(sum(SMALL)))
    lin = torch.nn.Linear(13, 1)
    shift = torch.tensor(np.cumsum([0] + SMALL[:-1]))

    def features(b: Batch) -> tuple:
        bag = torch.repeat_interleave(torch.arange(26 * len(b)), b.sparse.lengths())  # key-major bag of each id
        return b.dense, b.sparse.values() + shift[bag // len(b)], bag % len(b)

    def logits(dense, ids, row) -> torch.Tensor:
        return lin(dense).squeeze(1) + torch.zeros(len(dense)).index_add(0, row, w[ids])

    opt = torch.optim.Adam([w, *lin.parameters()], lr=0.05)
    train_x = features(train)
    for _ in range(60):
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits(*train_x), train.labels)
        loss.backward()
        opt.step()
    with torch.no_grad():
        learned = auc(logits(*features(test)).numpy(), test.labels.numpy())
    best = SyntheticClicks(4000, 4000, seed=0, cardinalities=SMALL, split="test").achievable_auc()
    print(f"logistic regression AUC {learned:.3f}, achievable {best:.3f}")
    assert learned > 0.6, learned
    assert best > 0.7 and best > learned - 0.02, (best, learned)


# -- Criteo readers --------------------------------------------------------------------------------------------


def write_tsv(path, n: int, seed: int) -> list[list[str]]:
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        label = str(int(rng.integers(0, 2)))
        ints = ["" if rng.random() < 0.2 else str(int(rng.integers(-2, 500))) for _ in range(13)]
        cats = ["" if rng.random() < 0.2 else f"{int(rng.integers(0, 6)):08x}" for _ in range(26)]
        lines.append([label, *ints, *cats])
    path.write_text("".join("\t".join(f) + "\n" for f in lines))
    return lines


def test_criteo_tsv_parses_lines(tmp_path) -> None:
    lines = write_tsv(tmp_path / "day_0", 23, seed=0)
    cards = [5, 1000] * 13
    batches = list(CriteoTSV(str(tmp_path / "day_0"), 10, cardinalities=cards))
    assert [len(b) for b in batches] == [10, 10, 3]
    labels = torch.cat([b.labels for b in batches])
    dense = torch.cat([b.dense for b in batches])
    assert labels.tolist() == [float(f[0]) for f in lines]
    want = np.log1p(np.maximum([[int(v) if v else 0 for v in f[1:14]] for f in lines], 0))
    np.testing.assert_allclose(dense.numpy(), want, rtol=1e-6)
    seen: dict[tuple[int, str], int] = {}
    for b_i, b in enumerate(batches):
        for j, name in enumerate(b.sparse.keys()):
            bags = b.sparse[name].to_dense()
            for r, ids in enumerate(bags):
                raw = lines[b_i * 10 + r][14 + j]
                assert len(ids) == (1 if raw else 0)  # a missing id is an empty bag
                if raw:
                    assert 0 <= int(ids[0]) < cards[j]
                    assert seen.setdefault((j, raw), int(ids[0])) == int(ids[0])  # same string, same id
    # a big table keeps distinct hex strings apart
    big = {raw: i for (j, raw), i in seen.items() if j == 1}
    assert len(big) > 3 and len(set(big.values())) == len(big)


@pytest.mark.parametrize("ws", [1, 2, 3])
def test_criteo_tsv_shards_several_files_without_overlap_or_loss(tmp_path, ws: int) -> None:
    write_tsv(tmp_path / "day_0", 17, seed=1)
    write_tsv(tmp_path / "day_1", 12, seed=2)
    single = all_rows(CriteoTSV(str(tmp_path), 4))
    assert len(single) == 29
    shards = [list(CriteoTSV(str(tmp_path / "day_*"), 4, rank=r, world_size=ws)) for r in range(ws)]
    assert len({len(s) for s in shards}) == 1
    assert Counter(row for s in shards for row in all_rows(s)) == Counter(single)
    window = all_rows(CriteoTSV([str(tmp_path / "day_0"), str(tmp_path / "day_1")], 4, start=15, num_rows=5))
    assert window == single[15:20]  # a window across the file boundary


@pytest.mark.parametrize(
    "bad, message",
    [
        ("1\t2\t3\n", r"day_1:3: expected 40 tab-separated columns .* got 3"),
        (
            "\t".join(["0"] + ["1"] * 13 + ["abc"] * 5 + ["xyz1"] + ["a"] * 20) + "\n",
            r"day_1:3: column 20 \(categorical feature cat_5\) must be a hex id .*b'xyz1'",
        ),
        ("\t".join(["0"] + ["1.5"] + ["1"] * 12 + ["a"] * 26) + "\n", r"day_1:3: column 2 \(integer feature 0\)"),
        ("\t".join(["2"] + ["1"] * 13 + ["a"] * 26) + "\n", r"day_1:3: column 1 \(label\) must be 0 or 1"),
    ],
)
def test_criteo_tsv_bad_lines_name_file_line_and_column(tmp_path, bad: str, message: str) -> None:
    write_tsv(tmp_path / "day_0", 6, seed=3)
    write_tsv(tmp_path / "day_1", 6, seed=4)
    with open(tmp_path / "day_1") as f:
        lines = f.readlines()
    lines[2] = bad  # global row 8: inside rank 0's second batch for batch_size 2, world 2
    (tmp_path / "day_1").write_text("".join(lines))
    # rank 0 owns the row and raises at its third batch; rank 1 reads only its own rows (under ClickLoader in a
    # process group it raises the same error at the same step: tests/distributed/test_data_agreement.py)
    loader = iter(CriteoTSV(str(tmp_path), 2, rank=0, world_size=2))
    next(loader), next(loader)  # global batches 0 and 1 (rows 0-7) are fine
    with pytest.raises(ValueError, match=message):
        next(loader)
    assert len(list(CriteoTSV(str(tmp_path), 2, rank=1, world_size=2))) == 3


def test_criteo_tsv_refuses_missing_files_and_short_data(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no Criteo file found"):
        CriteoTSV(str(tmp_path / "nope*"), 4)
    write_tsv(tmp_path / "d", 5, seed=0)
    with pytest.raises(ValueError, match=r"asked for rows \[2, 12\) but the data has 5 rows"):
        CriteoTSV(str(tmp_path / "d"), 4, start=2, num_rows=10)
    with pytest.raises(ValueError, match="cardinalities must be 26 positive ints"):
        CriteoTSV(str(tmp_path / "d"), 4, cardinalities=[3, 4])


def npy_arrays(n: int, seed: int):
    rng = np.random.default_rng(seed)
    return (
        rng.integers(-1, 300, (n, 13)).astype(np.int32),
        rng.integers(0, 40, (n, 26)).astype(np.int32),
        rng.integers(0, 2, n).astype(np.int8),
    )


@pytest.mark.parametrize("layout", ["dir", "npz"])
def test_criteo_npy_reads_and_shards(tmp_path, layout: str) -> None:
    x_int, x_cat, y = npy_arrays(21, seed=5)
    if layout == "dir":
        for name, a in (("X_int", x_int), ("X_cat", x_cat), ("y", y)):
            np.save(tmp_path / f"{name}.npy", a)
        path = str(tmp_path)
    else:
        path = str(tmp_path / "processed.npz")
        np.savez(path, X_int=x_int, X_cat=x_cat, y=y)
    cards = [7, 100] * 13
    batches = list(CriteoNpy(path, 8, cardinalities=cards))
    assert [len(b) for b in batches] == [8, 8, 5]
    np.testing.assert_allclose(torch.cat([b.dense for b in batches]).numpy(), np.log1p(np.maximum(x_int, 0)), rtol=1e-6)
    assert torch.cat([b.labels for b in batches]).tolist() == y.astype(float).tolist()
    for j, name in enumerate(batches[0].sparse.keys()):
        ids = torch.cat([b.sparse[name].values() for b in batches]).numpy()
        np.testing.assert_array_equal(ids, x_cat[:, j] % cards[j])
    single = all_rows(batches)
    shards = [list(CriteoNpy(path, 4, cardinalities=cards, rank=r, world_size=3)) for r in range(3)]
    assert len({len(s) for s in shards}) == 1
    assert Counter(row for s in shards for row in all_rows(s)) == Counter(single)


def test_criteo_npy_bad_arrays_name_file_row_and_feature(tmp_path) -> None:
    x_int, x_cat, y = npy_arrays(10, seed=6)
    np.save(tmp_path / "X_int.npy", x_int[:, :12])
    np.save(tmp_path / "X_cat.npy", x_cat)
    np.save(tmp_path / "y.npy", y)
    with pytest.raises(ValueError, match=r"X_int.npy has shape \(10, 12\), expected \(10, 13\)"):
        CriteoNpy(str(tmp_path), 4)
    np.save(tmp_path / "X_int.npy", x_int)
    x_cat[6, 3] = -4
    np.save(tmp_path / "X_cat.npy", x_cat)
    for rank in (1,):  # row 6 is rank 1's in the second global batch (every rank stops under ClickLoader)
        loader = iter(CriteoNpy(str(tmp_path), 2, rank=rank, world_size=2))
        next(loader)
        with pytest.raises(ValueError, match=r"X_cat.npy row 6 \(0-based\), feature cat_3: id -4 is negative"):
            next(loader)
    x_cat[6, 3] = 1
    np.save(tmp_path / "X_cat.npy", x_cat)
    y[9] = 3
    np.save(tmp_path / "y.npy", y)
    with pytest.raises(ValueError, match=r"y.npy row 9 \(0-based\): label 3 is not 0 or 1"):
        list(CriteoNpy(str(tmp_path), 4))
    np.savez(tmp_path / "p.npz", X_int=x_int, y=y)
    with pytest.raises(ValueError, match=r"lacks arrays \['X_cat'\]"):
        CriteoNpy(str(tmp_path / "p.npz"), 4)


# -- Batch, collate, DataModule ----------------------------------------------------------------------------------


def test_batch_to_len_and_collate() -> None:
    samples = [([1.0, 2.0], {"a": [3, 4], "b": [5]}, 1), ([0.0, 1.0], {"b": [6]}, 0)]
    batch = collate(samples, keys=["a", "b"])
    assert len(batch) == 2 and batch.labels.tolist() == [1.0, 0.0]
    assert batch.sparse.lengths().tolist() == [2, 0, 1, 1] and batch.sparse.values().tolist() == [3, 4, 5, 6]
    moved = batch.to("cpu")
    assert torch.equal(moved.dense, batch.dense) and moved.sparse.keys() == ["a", "b"]
    with pytest.raises(ValueError, match="same batch size"):
        Batch(torch.zeros(3, 2), batch.sparse, torch.zeros(2))
    if torch.cuda.is_available():
        pinned = batch.pin_memory()
        assert pinned.dense.is_pinned() and pinned.sparse.values().is_pinned() and pinned.labels.is_pinned()
        on_gpu = pinned.to("cuda")  # non-blocking from pinned memory; the values arrive all the same
        assert torch.equal(on_gpu.dense.cpu(), batch.dense) and torch.equal(
            on_gpu.sparse.values().cpu(), batch.sparse.values()
        )


def test_datamodule_synthetic_shards_by_trainer_rank() -> None:
    dm = ClickDataModule(batch_size=8, train_rows=50, val_rows=21, test_rows=9, size=1e-4)
    assert dm.num_dense == 13 and dm.feature_names == [f"cat_{i}" for i in range(26)]
    configs = dm.table_configs(embedding_dim=4)
    assert [c.num_embeddings for c in configs] == dm.cardinalities and [c.feature_names for c in configs] == [
        [f] for f in dm.feature_names
    ]
    single = {s: all_rows(dm.dataset(s)) for s in ("train", "val", "test", "predict")}
    assert single["predict"] == single["test"] and len(single["val"]) == 21
    for ws in (2, 3):
        loaders = []
        for rank in range(ws):
            dm.trainer = SimpleNamespace(global_rank=rank, world_size=ws)
            loaders.append(dm.val_dataloader())
        assert len({len(dl) for dl in loaders}) == 1
        assert Counter(r for dl in loaders for r in all_rows(dl)) == Counter(single["val"])
    dm.trainer = None
    dropped = ClickDataModule(batch_size=8, train_rows=50, val_rows=21, size=1e-4, drop_last=True)
    assert len(all_rows(dropped.train_dataloader())) == 48 and len(all_rows(dropped.val_dataloader())) == 21


def test_datamodule_criteo_windows_and_errors(tmp_path) -> None:
    write_tsv(tmp_path / "day_0", 30, seed=7)
    dm = ClickDataModule(
        source="criteo_tsv",
        path=str(tmp_path / "day_0"),
        batch_size=4,
        train_rows=None,
        val_rows=6,
        test_rows=4,
        size=1e-4,
    )
    every = all_rows(CriteoTSV(str(tmp_path / "day_0"), 4, cardinalities=dm.cardinalities))
    assert all_rows(dm.train_dataloader()) == every[:20]
    assert all_rows(dm.val_dataloader()) == every[20:26] and all_rows(dm.test_dataloader()) == every[26:]
    with pytest.raises(ValueError, match=r"has 30 rows, fewer than train_rows \+ val_rows \+ test_rows = 25 \+ 6 \+ 4"):
        ClickDataModule(
            source="criteo_tsv", path=str(tmp_path / "day_0"), train_rows=25, val_rows=6, test_rows=4
        ).train_dataloader()
    with pytest.raises(ValueError, match="source must be one of"):
        ClickDataModule(source="criteo")
    with pytest.raises(ValueError, match="needs `path`"):
        ClickDataModule(source="criteo_npy")
    with pytest.raises(FileNotFoundError, match="no Criteo"):
        ClickDataModule(source="criteo_tsv", path=str(tmp_path / "missing"))


class _Tiny(__import__("lightning").LightningModule):
    def __init__(self, dm: ClickDataModule) -> None:
        super().__init__()
        from lightning_rec import EmbeddingBagCollection
        from lightning_rec.metrics import rec_metrics

        self.ebc = EmbeddingBagCollection(dm.table_configs(embedding_dim=2))
        self.head = torch.nn.Linear(dm.num_dense + 2 * len(dm.feature_names), 1)
        self.metrics = rec_metrics("val_")
        self.seen: list[type] = []

    def forward(self, b: Batch) -> torch.Tensor:
        return self.head(torch.cat([b.dense, self.ebc(b.sparse).values()], 1)).squeeze(1)

    def training_step(self, b: Batch, _) -> torch.Tensor:
        self.seen.append(type(b))
        return torch.nn.functional.binary_cross_entropy_with_logits(self(b), b.labels)

    def validation_step(self, b: Batch, _) -> None:
        self.metrics.update(torch.sigmoid(self(b)), b.labels)
        self.log_dict(self.metrics, on_epoch=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_datamodule_feeds_a_lightning_trainer() -> None:
    import lightning as L

    dm = ClickDataModule(batch_size=32, train_rows=96, val_rows=40, test_rows=0, size=1e-5)
    model = _Tiny(dm)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        **QUIET_TRAINER,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, dm)
    assert model.seen == [Batch] * 3
    noisy = [str(w.message) for w in caught if "workers" in str(w.message) or "IterableDataset" in str(w.message)]
    assert not noisy, noisy  # ClickLoader: no "does not have many workers" / "IterableDataset has __len__" warnings
    assert set(trainer.callback_metrics) == {"val_auroc", "val_ne", "val_calibration", "val_logloss"}
