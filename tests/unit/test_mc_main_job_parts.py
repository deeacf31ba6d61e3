"""The parts of the main job's managed-collision option: raw-id data sources and the DLRM's MC wiring."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_rec import KeyedJaggedTensor, ManagedCollisionEmbeddingBagCollection
from lightning_rec.data import ClickDataModule, CriteoNpy, CriteoParquet, CriteoTSV, SyntheticClicks
from lightning_rec.data.convert import convert
from lightning_rec.models import DLRM
from lightning_rec.models.lightning_dlrm import bucket_aligned_rows, managed_tables, tables_from_cardinalities
from lightning_rec.plans.kinds import ShardingType
from tests.unit.test_data_readers import CARDS, flat, reference, write_lines


def raw_reference(lines):
    """Plain Python: the hex id's value itself (no hashing), missing id = empty bag."""
    dense, _, lengths, labels = reference(lines)
    ids = [[int(f[14 + j], 16) for f in lines if f[14 + j]] for j in range(26)]
    return dense, ids, lengths, labels


# -- Criteo readers ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hex_len", [8, 0])
def test_criteo_tsv_and_parquet_raw_ids_are_the_hex_values(tmp_path, hex_len: int) -> None:
    (tmp_path / "tsv").mkdir()
    lines = write_lines(tmp_path / "tsv" / "day_0", 300, seed=11 + hex_len, hex_len=hex_len)
    # ids of up to 16 digits may reach 2**63: keep them below for this test (the next one checks the error)
    for f in lines:
        f[14:] = [v if len(v) < 16 or int(v, 16) < 2**63 else "7" + v[1:] for v in f[14:]]
    (tmp_path / "tsv" / "day_0").write_text("".join("\t".join(f) + "\n" for f in lines))
    got = flat(list(CriteoTSV(str(tmp_path / "tsv"), 64, cardinalities=CARDS, raw_ids=True)))
    want = raw_reference(lines)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert got[1:] == want[1:]
    assert max(max(ids) for ids in got[1] if ids) >= max(CARDS)  # not folded into the tables
    convert(str(tmp_path / "tsv"), str(tmp_path / "pq"), "parquet", chunk_rows=100)
    pq_raw = flat(list(CriteoParquet(str(tmp_path / "pq"), 64, cardinalities=CARDS, raw_ids=True)))
    assert pq_raw[1:] == want[1:]
    # the hashed readers are unchanged, and the flag does not leak between instances
    hashed = flat(list(CriteoParquet(str(tmp_path / "pq"), 64, cardinalities=CARDS)))
    assert hashed[1:] == reference(lines)[1:]


def test_raw_ids_above_int64_are_refused_naming_the_feature_and_file(tmp_path) -> None:
    lines = write_lines(tmp_path / "d", 20, seed=4)
    lines[13][14 + 5] = "f" * 16
    (tmp_path / "d").write_text("".join("\t".join(f) + "\n" for f in lines))
    with pytest.raises(ValueError, match=r"CriteoTSV: .*d lines 1-20: feature cat_5 has raw id 0xffffffffffffffff"):
        list(CriteoTSV(str(tmp_path / "d"), 64, cardinalities=CARDS, raw_ids=True))
    assert len(flat(list(CriteoTSV(str(tmp_path / "d"), 64, cardinalities=CARDS)))[3]) == 20  # hashed: fine


def test_criteo_npy_raw_ids_are_not_folded(tmp_path) -> None:
    rng = np.random.default_rng(0)
    cat = rng.integers(0, 10**9, (40, 26))
    np.savez(tmp_path / "d.npz", X_int=rng.integers(0, 9, (40, 13)), X_cat=cat, y=rng.integers(0, 2, 40))
    raw = flat(list(CriteoNpy(str(tmp_path / "d.npz"), 16, cardinalities=CARDS, raw_ids=True)))
    hashed = flat(list(CriteoNpy(str(tmp_path / "d.npz"), 16, cardinalities=CARDS)))
    assert raw[1] == [cat[:, j].tolist() for j in range(26)]
    assert hashed[1] == [(cat[:, j] % CARDS[j]).tolist() for j in range(26)]


# -- synthetic raw ids -----------------------------------------------------------------------------------------


def test_synthetic_raw_ids_are_unbounded_drifting_and_shard_like_hashed_rows() -> None:
    cards = [16] * 26
    ds = SyntheticClicks(8192, 512, cardinalities=cards, raw_ids=True, multi_hot={}, raw_id_drift=1.0)
    _, _, values, labels, _ = ds.rows(0, 8192)
    ids = values.reshape(26, 8192)  # one id per row and feature
    assert values.min() >= 0 and values.dtype == np.int64
    early, late = set(ids[0, :1024].tolist()), set(ids[0, -1024:].tolist())
    assert len(set(ids[0].tolist())) > 4 * cards[0]  # far more ids than rows of the table
    assert len(late - early) > len(late) // 2  # new ids keep appearing
    # a pure function of the row: the same ids for any batch size / world size, and per epoch when fresh
    shards = [
        list(
            SyntheticClicks(
                8192, 256, cardinalities=cards, raw_ids=True, multi_hot={}, rank=r, world_size=2, raw_id_drift=1.0
            )
        )
        for r in range(2)
    ]
    first = torch.cat([shards[0][0].sparse.values().view(26, -1), shards[1][0].sparse.values().view(26, -1)], 1)
    assert torch.equal(first, torch.from_numpy(ids[:, :512]))
    ds.epoch = 1
    assert not np.array_equal(ds.read_rows(0, 64)[2], ds.rows(0, 64, 0)[2])
    # the labels follow the raw ids' effects: the hidden model is as good as in the hashed mode
    assert 0.1 < labels.mean() < 0.5 and ds.achievable_auc(8192) > 0.7
    # the hashed mode is untouched by the new flag
    hashed = SyntheticClicks(64, 64, cardinalities=cards, multi_hot={}).rows(0, 64)[2]
    assert hashed.max() < 16
    with pytest.raises(ValueError, match="raw_id_space must be >= 1"):
        SyntheticClicks(64, 8, raw_ids=True, raw_id_space=0.5)


def test_datamodule_passes_raw_ids_to_every_source(tmp_path) -> None:
    dm = ClickDataModule(batch_size=32, train_rows=64, val_rows=32, test_rows=0, size=1e-4, raw_ids=True)
    assert dm.raw_ids and dm.dataset("train").raw_ids and dm.dataset("val").raw_ids
    assert int(next(iter(dm.train_dataloader())).sparse.values().max()) > max(dm.cardinalities)
    write_lines(tmp_path / "d", 50, seed=1)
    dm = ClickDataModule(
        source="criteo_tsv",
        path=str(tmp_path / "d"),
        batch_size=8,
        train_rows=None,
        val_rows=10,
        test_rows=0,
        cardinalities=CARDS,
        raw_ids=True,
    )
    assert dm.dataset("train").raw_ids and dm.dataset("train").describe()["raw_ids"]


# -- the DLRM's managed-collision option -------------------------------------------------------------------------


def test_managed_tables_round_sizes_to_buckets_and_check_options() -> None:
    tables = tables_from_cardinalities(["a", "b", "c"], [1000, 5, 64], 8)
    out, mods = managed_tables(
        tables, {"num_buckets": 16, "zch_size": {"a": 1000}, "tables": ["a", "c"], "eviction_policy": "LFU"}
    )
    # a: 1000 rows -> 16 buckets of 63; b unmanaged; c: 64 rows, buckets of at least 16 rows -> 4 buckets
    assert [t.num_embeddings for t in out] == [1008, 5, 64]
    assert set(mods) == {"a", "c"} and mods["a"].num_buckets == 16 and mods["c"].num_buckets == 4
    _, small = managed_tables(tables, {"zch_size": {"b": 5}})
    assert small["b"].num_buckets == 1 and small["b"].zch_size == 5
    assert mods["a"].eviction_policy.name == "lfu"
    for bad, msg in (
        ({"buckets": 3}, "unknown keys"),
        ({"tables": ["x"]}, "not tables of the model"),
        ({"eviction_policy": "fifo"}, "eviction_policy must be one of"),
        ({"zch_size": {"b": 4}, "tables": ["a"]}, "not managed"),
        ({"zch_size": -3}, "zch_size must be positive"),
    ):
        with pytest.raises(ValueError, match=msg):
            managed_tables(tables, bad)
    assert bucket_aligned_rows(112, 16, 3) == [42, 35, 35]  # 6, 5, 5 buckets of 7 rows


def test_dlrm_raw_ids_trains_on_one_process_and_plans_whole_buckets() -> None:
    torch.manual_seed(0)
    model = DLRM(
        num_dense=3,
        feature_names=["u", "i"],
        num_embeddings_per_feature=[40, 8],
        embedding_dim=4,
        dense_arch_layer_sizes=[8, 4],
        over_arch_layer_sizes=[8, 1],
        raw_ids=True,
        managed_collision={"num_buckets": 4, "tables": ["u"]},
    )
    mc = model.sparse_arch.embedding_bag_collection
    assert isinstance(mc, ManagedCollisionEmbeddingBagCollection)
    assert any(
        k.startswith("sparse_arch.embedding_bag_collection._embedding_module.embedding_bags.u.")
        for k in model.state_dict()
    )
    opt = model.configure_optimizers()
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        u = torch.randint(0, 2**62, (6,), generator=g)
        i = torch.randint(0, 8, (6,), generator=g)
        kjt = KeyedJaggedTensor(["u", "i"], torch.cat([u, i]), lengths=torch.ones(12, dtype=torch.long))
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(model(torch.randn(6, 3), kjt), torch.ones(6)).backward()
        opt.step()
    stats = mc.mc_stats()["u"]
    assert stats["lookups"] == 6 and set(mc.mc_stats()) == {"u"}
    # the plan the strategy gets: managed tables row-wise in whole buckets, the others table-wise
    plan = model.configure_sharding().plan["sparse_arch.embedding_bag_collection._embedding_module"]
    assert plan["u"].sharding_type == ShardingType.ROW_WISE and plan["i"].sharding_type == ShardingType.TABLE_WISE
    # without raw ids and options: the plain model, no plan of its own
    plain = DLRM(num_dense=3, feature_names=["u"], num_embeddings_per_feature=[40], embedding_dim=4)
    assert plain.configure_sharding() is None and not plain._mc_modules
    with pytest.raises(TypeError, match="managed_collision must be a dict"):
        DLRM(
            num_dense=3, feature_names=["u"], num_embeddings_per_feature=[40], embedding_dim=4, managed_collision=["u"]
        )
