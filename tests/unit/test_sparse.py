"""KeyedJaggedTensor / JaggedTensor / KeyedTensor: construction, accessors, transforms and validation."""

from __future__ import annotations

import pytest
import torch

from lightning_rec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor, kjt_is_equal


def _t(xs, dtype=torch.long):
    return torch.tensor(xs, dtype=dtype)


# Two keys, batch of 3:   f1: [10 11] [] [12]     f2: [20] [21 22 23] [24]
KEYS = ["f1", "f2"]
LENGTHS = [2, 0, 1, 1, 3, 1]
VALUES = [10, 11, 12, 20, 21, 22, 23, 24]
WEIGHTS = [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0]
OFFSETS = [0, 2, 2, 3, 4, 7, 8]


@pytest.fixture
def kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(KEYS, _t(VALUES), _t(LENGTHS), weights=_t(WEIGHTS, torch.float32))


def test_from_lengths_sync_accessors(kjt: KeyedJaggedTensor) -> None:
    assert kjt.keys() == KEYS
    assert kjt.values().tolist() == VALUES
    assert kjt.lengths().tolist() == LENGTHS
    assert kjt.offsets().tolist() == OFFSETS
    assert kjt.weights().tolist() == WEIGHTS
    assert kjt.weights_or_none() is kjt.weights()
    assert kjt.stride() == 3
    assert kjt.length_per_key() == [3, 5]
    assert kjt.offset_per_key() == [0, 3, 8]
    assert kjt.device == torch.device("cpu")
    assert kjt.lengths().dtype == torch.long and kjt.offsets().dtype == torch.long


def test_from_offsets_sync_matches_from_lengths() -> None:
    a = KeyedJaggedTensor.from_offsets_sync(KEYS, _t(VALUES), _t(OFFSETS))
    assert a.keys() == KEYS
    assert a.lengths().tolist() == LENGTHS
    assert a.offsets().tolist() == OFFSETS
    assert a.stride() == 3
    assert a.length_per_key() == [3, 5]
    assert a.weights_or_none() is None
    with pytest.raises(ValueError, match="no weights"):
        a.weights()


def test_int32_lengths_and_offsets_are_accepted() -> None:
    a = KeyedJaggedTensor.from_lengths_sync(KEYS, _t(VALUES, torch.int32), _t(LENGTHS, torch.int32))
    b = KeyedJaggedTensor.from_offsets_sync(KEYS, _t(VALUES, torch.int32), _t(OFFSETS, torch.int32))
    assert a.offsets().tolist() == OFFSETS
    assert b.lengths().tolist() == LENGTHS
    assert a.values().dtype == torch.int32  # ids keep their dtype


def test_lengths_and_offsets_together_must_agree() -> None:
    ok = KeyedJaggedTensor(KEYS, _t(VALUES), lengths=_t(LENGTHS), offsets=_t(OFFSETS))
    assert ok.offsets().tolist() == OFFSETS
    bad = list(OFFSETS)
    bad[2] = 1
    with pytest.raises(ValueError, match="offsets.*do not match.*lengths"):
        KeyedJaggedTensor(KEYS, _t(VALUES), lengths=_t(LENGTHS), offsets=_t(bad))


def test_explicit_stride_must_match() -> None:
    assert KeyedJaggedTensor.from_lengths_sync(KEYS, _t(VALUES), _t(LENGTHS), stride=3).stride() == 3
    with pytest.raises(ValueError, match=r"stride=2 .*batch size of 3"):
        KeyedJaggedTensor.from_lengths_sync(KEYS, _t(VALUES), _t(LENGTHS), stride=2)


def test_getitem_and_to_dict(kjt: KeyedJaggedTensor) -> None:
    jt = kjt["f2"]
    assert isinstance(jt, JaggedTensor)
    assert jt.values().tolist() == [20, 21, 22, 23, 24]
    assert jt.lengths().tolist() == [1, 3, 1]
    assert jt.offsets().tolist() == [0, 1, 4, 5]
    assert jt.weights().tolist() == [2.0, 2.5, 3.0, 3.5, 4.0]
    assert [b.tolist() for b in jt.to_dense()] == [[20], [21, 22, 23], [24]]
    with pytest.raises(KeyError, match="nope"):
        kjt["nope"]
    d = kjt.to_dict()
    assert list(d) == KEYS
    assert d["f1"].values().tolist() == [10, 11, 12]
    assert d["f1"].lengths().tolist() == [2, 0, 1]
    assert d["f1"].weights().tolist() == [0.5, 1.0, 1.5]


def test_split(kjt: KeyedJaggedTensor) -> None:
    a, b, c = kjt.split([1, 0, 1])
    assert a.keys() == ["f1"] and b.keys() == [] and c.keys() == ["f2"]
    assert a.values().tolist() == [10, 11, 12] and a.lengths().tolist() == [2, 0, 1]
    assert a.weights().tolist() == [0.5, 1.0, 1.5]
    assert c.values().tolist() == [20, 21, 22, 23, 24] and c.lengths().tolist() == [1, 3, 1]
    assert c.offsets().tolist() == [0, 1, 4, 5]
    assert a.stride() == b.stride() == c.stride() == 3
    assert b.values().numel() == 0 and b.length_per_key() == []
    (whole,) = kjt.split([2])
    assert whole.values().tolist() == VALUES and whole.lengths().tolist() == LENGTHS
    with pytest.raises(ValueError, match="sum to 2"):
        kjt.split([1])
    with pytest.raises(ValueError, match="non-negative"):
        kjt.split([3, -1])


def test_permute_reorders_and_repeats(kjt: KeyedJaggedTensor) -> None:
    p = kjt.permute([1, 0])
    assert p.keys() == ["f2", "f1"]
    assert p.values().tolist() == [20, 21, 22, 23, 24, 10, 11, 12]
    assert p.lengths().tolist() == [1, 3, 1, 2, 0, 1]
    assert p.weights().tolist() == [2.0, 2.5, 3.0, 3.5, 4.0, 0.5, 1.0, 1.5]
    assert p.stride() == 3


def test_permute_with_repeated_keys() -> None:
    # TorchRec semantics: an index may repeat, giving the same key (and its bags) several times; the
    # sharding input dist relies on this to send one feature to several shards.
    base = KeyedJaggedTensor.from_lengths_sync(
        ["a", "b", "c"], _t([1, 2, 3, 4, 5, 6]), _t([1, 1, 0, 2, 1, 1]), weights=torch.arange(6.0)
    )
    rep = base.permute([2, 0, 2])
    assert rep.keys() == ["c", "a", "c"]
    assert rep.values().tolist() == [5, 6, 1, 2, 5, 6]
    assert rep.lengths().tolist() == [1, 1, 1, 1, 1, 1]
    assert rep.weights().tolist() == [4.0, 5.0, 0.0, 1.0, 4.0, 5.0]
    assert rep.length_per_key() == [2, 2, 2] and rep.offset_per_key() == [0, 2, 4, 6]
    assert rep.stride() == 2
    # A repeated-key KJT keeps working through the other transforms.
    first, second = rep.split([2, 1])
    assert first.keys() == ["c", "a"] and second.keys() == ["c"]
    assert second.values().tolist() == [5, 6]
    moved = rep.to("cpu:0")
    assert moved.keys() == ["c", "a", "c"] and moved.values().tolist() == rep.values().tolist()
    again = rep.permute([1, 1])
    assert again.keys() == ["a", "a"] and again.values().tolist() == [1, 2, 1, 2]
    # Sub-selection (dropping keys) and the empty permutation.
    sub = base.permute([2, 0])
    assert sub.keys() == ["c", "a"] and sub.values().tolist() == [5, 6, 1, 2]
    none = base.permute([])
    assert none.keys() == [] and none.values().numel() == 0


def test_permute_out_of_range(kjt: KeyedJaggedTensor) -> None:
    with pytest.raises(ValueError, match="out of range"):
        kjt.permute([0, 2])
    with pytest.raises(ValueError, match="out of range"):
        kjt.permute([-1])


def test_to_device_and_lightning_move(kjt: KeyedJaggedTensor) -> None:
    from lightning.fabric.utilities.apply_func import move_data_to_device

    assert kjt.to(torch.device("cpu")) is kjt
    assert kjt.to("cpu") is kjt
    batch = {"sparse": kjt, "dense": torch.ones(3, 2), "pair": (kjt, 1)}
    moved = move_data_to_device(batch, torch.device("cpu"))
    assert isinstance(moved["sparse"], KeyedJaggedTensor)
    assert isinstance(moved["pair"][0], KeyedJaggedTensor)
    assert moved["sparse"].values().tolist() == VALUES
    assert moved["sparse"].weights().tolist() == WEIGHTS
    moved_t = move_data_to_device((kjt, torch.zeros(1)), "cpu")
    assert isinstance(moved_t, tuple) and isinstance(moved_t[0], KeyedJaggedTensor)
    assert moved_t[0].lengths().tolist() == LENGTHS
    # "cpu:0" is not equal to "cpu" as a torch.device, so this exercises the copying branch of .to().
    copied = kjt.to("cpu:0")
    assert copied is not kjt and isinstance(copied, KeyedJaggedTensor)
    assert copied.keys() == KEYS and copied.stride() == 3
    assert copied.values().tolist() == VALUES and copied.lengths().tolist() == LENGTHS
    assert copied.weights().tolist() == WEIGHTS


def test_jagged_tensor_to_and_2d_values() -> None:
    jt = JaggedTensor(torch.arange(10.0).view(5, 2), lengths=_t([2, 0, 3]), weights=torch.ones(5))
    assert jt.offsets().tolist() == [0, 2, 2, 5]
    assert [b.shape[0] for b in jt.to_dense()] == [2, 0, 3]
    moved = jt.to("cpu")
    assert torch.equal(moved.values(), jt.values()) and moved.lengths().tolist() == [2, 0, 3]
    assert torch.equal(moved.weights(), jt.weights())
    jt2 = JaggedTensor(_t([1, 2, 3]), offsets=_t([0, 3]))
    assert jt2.lengths().tolist() == [3] and jt2.weights_or_none() is None
    with pytest.raises(ValueError, match="no weights"):
        jt2.weights()


def test_empty_kjt_and_batch_size_zero() -> None:
    e = KeyedJaggedTensor(["a", "b"], _t([]), lengths=_t([]))
    assert e.keys() == ["a", "b"] and e.stride() == 0
    assert e.length_per_key() == [0, 0] and e.offset_per_key() == [0, 0, 0]
    assert e["a"].values().numel() == 0
    assert e.permute([1, 0]).keys() == ["b", "a"]
    assert [s.keys() for s in e.split([1, 1])] == [["a"], ["b"]]
    none = KeyedJaggedTensor.empty()
    assert none.keys() == [] and none.stride() == 0 and none.length_per_key() == []
    with pytest.raises(ValueError, match="no keys must have no lengths"):
        KeyedJaggedTensor([], _t([1]), lengths=_t([1]))


def test_from_jt_dict_round_trip(kjt: KeyedJaggedTensor) -> None:
    back = KeyedJaggedTensor.from_jt_dict(kjt.to_dict())
    assert back.keys() == KEYS
    assert back.values().tolist() == VALUES
    assert back.lengths().tolist() == LENGTHS
    assert back.weights().tolist() == WEIGHTS
    d = kjt.to_dict()
    d["f1"] = JaggedTensor(d["f1"].values(), lengths=d["f1"].lengths())
    with pytest.raises(ValueError, match="every JaggedTensor has weights or none"):
        KeyedJaggedTensor.from_jt_dict(d)


# -- validation errors -------------------------------------------------------------------------------


def test_lengths_cover_more_than_values() -> None:
    with pytest.raises(ValueError, match=r"lengths sum to 8 but `values` has only 7 entries"):
        KeyedJaggedTensor.from_lengths_sync(KEYS, _t(VALUES[:-1]), _t(LENGTHS))
    with pytest.raises(ValueError, match=r"lengths sum to 3 but `values` has only 2 entries"):
        JaggedTensor(_t([1, 2]), lengths=_t([1, 2]))


def test_weights_cover_less_than_lengths() -> None:
    with pytest.raises(ValueError, match=r"lengths sum to 8 but `weights` has only 7 entries"):
        KeyedJaggedTensor.from_lengths_sync(KEYS, _t(VALUES), _t(LENGTHS), weights=torch.ones(7))
    with pytest.raises(ValueError, match=r"lengths sum to 2 but `weights` has only 1 entries"):
        JaggedTensor(_t([1, 2]), lengths=_t([2]), weights=torch.ones(1))


def test_entries_past_the_last_bag_belong_to_no_bag() -> None:
    # TorchRec accepts values / weights longer than the lengths cover (preallocated buffers): the bags are
    # what the lengths say, everywhere
    kjt = KeyedJaggedTensor.from_offsets_sync(KEYS, _t(VALUES + [99, 98]), _t(OFFSETS), weights=torch.arange(20.0))
    ref = KeyedJaggedTensor.from_offsets_sync(KEYS, _t(VALUES), _t(OFFSETS), weights=torch.arange(8.0))
    assert kjt.length_per_key() == ref.length_per_key()
    for k in KEYS:
        assert torch.equal(kjt[k].values(), ref[k].values()) and torch.equal(kjt[k].weights(), ref[k].weights())
    for a, b in zip(kjt.split([1, 1]), ref.split([1, 1])):
        assert kjt_is_equal(a, b)
    assert kjt_is_equal(kjt.permute([1, 0]), ref.permute([1, 0]))
    assert str(kjt) == str(ref)
    jt = JaggedTensor(_t([1, 2, 3, 4]), lengths=_t([1, 0, 2]), weights=torch.arange(6.0))
    assert [t.tolist() for t in jt.to_dense()] == [[1], [], [2, 3]]
    assert [t.tolist() for t in jt.to_dense_weights()] == [[0.0], [], [1.0, 2.0]]
    assert jt.to_padded_dense().tolist() == [[1, 0], [0, 0], [2, 3]]
    assert jt.to_padded_dense_weights(1, -1.0).tolist() == [[0.0], [-1.0], [1.0]]
    # concatenating would move the trailing entries into the next input's bags (TorchRec does): refused
    with pytest.raises(ValueError, match="past its last bag"):
        KeyedJaggedTensor.concat([kjt, ref])
    with pytest.raises(ValueError, match="past its last bag"):
        KeyedJaggedTensor.from_jt_dict({"a": jt})


def test_batch_size_inconsistent_across_keys() -> None:
    # 5 bags cannot be split over 2 keys: one key would have a different batch size.
    with pytest.raises(ValueError, match=r"5 lengths cannot be split evenly over 2 keys.*stride_per_key_per_rank"):
        KeyedJaggedTensor.from_lengths_sync(KEYS, _t([1, 2, 3, 4, 5]), _t([1, 1, 1, 1, 1]))
    with pytest.raises(ValueError, match="cannot be split evenly over 3 keys"):
        KeyedJaggedTensor.from_offsets_sync(["a", "b", "c"], _t([1, 2]), _t([0, 1, 2]))


def test_negative_lengths_and_bad_offsets() -> None:
    with pytest.raises(ValueError, match=r"`lengths` must be non-negative, got min -1"):
        KeyedJaggedTensor.from_lengths_sync(KEYS, _t([1, 2]), _t([2, 1, -1, 0]))
    with pytest.raises(ValueError, match="non-decreasing"):
        KeyedJaggedTensor.from_offsets_sync(KEYS, _t([1, 2]), _t([0, 2, 1, 2, 2]))
    with pytest.raises(ValueError, match="start with 0"):
        KeyedJaggedTensor.from_offsets_sync(KEYS, _t([1, 2]), _t([1, 1, 2]))
    assert KeyedJaggedTensor.from_offsets_sync([], _t([]), _t([])).offsets().tolist() == [0]  # as TorchRec
    with pytest.raises(ValueError, match="needs `lengths` or `offsets`"):
        KeyedJaggedTensor(KEYS, _t(VALUES))


def test_duplicated_keys_are_kept_as_in_torchrec() -> None:
    kjt = KeyedJaggedTensor.from_lengths_sync(["f1", "f1"], _t([1, 2]), _t([1, 1]))
    assert kjt.keys() == ["f1", "f1"] and kjt["f1"].values().tolist() == [1]


def test_bad_tensor_kinds() -> None:
    with pytest.raises(ValueError, match="`lengths` must hold integers"):
        KeyedJaggedTensor.from_lengths_sync(["a"], _t([1, 2]), torch.tensor([2.0]))
    with pytest.raises(TypeError, match="`lengths` must be a torch.Tensor"):
        KeyedJaggedTensor.from_lengths_sync(["a"], _t([1, 2]), [2])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="keys must be strings"):
        KeyedJaggedTensor.from_lengths_sync([1], _t([1, 2]), _t([2]))  # type: ignore[list-item]
    with pytest.raises(ValueError, match="at least one dimension"):
        JaggedTensor(torch.tensor(1), lengths=_t([1]))


# -- KeyedTensor --------------------------------------------------------------------------------------


def test_keyed_tensor_accessors_and_regroup() -> None:
    v1 = torch.arange(10.0).view(2, 5)
    kt1 = KeyedTensor(["a", "b"], [2, 3], v1)
    v2 = torch.arange(100.0, 108.0).view(2, 4)
    kt2 = KeyedTensor(["c"], [4], v2)
    assert kt1.keys() == ["a", "b"] and kt1.length_per_key() == [2, 3] and kt1.offset_per_key() == [0, 2, 5]
    assert kt1.key_dim() == 1 and kt1.values() is v1
    assert torch.equal(kt1["b"], v1[:, 2:5])
    assert list(kt1.to_dict()) == ["a", "b"] and torch.equal(kt1.to_dict()["a"], v1[:, :2])
    with pytest.raises(KeyError, match="zz"):
        kt1["zz"]
    g1, g2 = KeyedTensor.regroup([kt1, kt2], [["c", "a"], ["b"]])
    assert torch.equal(g1, torch.cat([v2, v1[:, :2]], dim=1))
    assert torch.equal(g2, v1[:, 2:5])
    (g,) = KeyedTensor.regroup([kt1], [["b", "a", "b"]])  # a key may appear in several places
    assert torch.equal(g, torch.cat([v1[:, 2:], v1[:, :2], v1[:, 2:]], dim=1))
    with pytest.raises(KeyError, match=r"key 'x' of group 0 is in no input"):
        KeyedTensor.regroup([kt1, kt2], [["a", "x"]])
    # a key in several KeyedTensors is taken from the last one (TorchRec's KeyedTensor.regroup)
    (g,) = KeyedTensor.regroup([kt1, KeyedTensor(["a"], [1], torch.zeros(2, 1))], [["a"]])
    assert torch.equal(g, torch.zeros(2, 1))
    moved = kt1.to("cpu")
    assert moved.keys() == ["a", "b"] and torch.equal(moved.values(), v1)


def test_keyed_tensor_regroup_is_differentiable() -> None:
    v = torch.randn(3, 5, requires_grad=True)
    kt = KeyedTensor(["a", "b"], [2, 3], v)
    (g,) = KeyedTensor.regroup([kt], [["b", "a"]])
    (g * torch.arange(15.0).view(3, 5)).sum().backward()
    expected = torch.cat([torch.arange(15.0).view(3, 5)[:, 3:], torch.arange(15.0).view(3, 5)[:, :3]], dim=1)
    assert torch.equal(v.grad, expected)


def test_keyed_tensor_validation() -> None:
    with pytest.raises(ValueError, match="2 keys but 1 lengths"):
        KeyedTensor(["a", "b"], [2], torch.zeros(1, 2))
    with pytest.raises(ValueError, match=r"size 5 along key_dim=1, got shape \(1, 4\)"):
        KeyedTensor(["a", "b"], [2, 3], torch.zeros(1, 4))
    kt0 = KeyedTensor(["a", "b"], [1, 2], torch.arange(6.0).view(3, 2), key_dim=0)  # blocks along rows
    assert torch.equal(kt0["b"], torch.arange(2.0, 6.0).view(2, 2))


def test_concat_keeps_keys_values_and_strides() -> None:
    a = KeyedJaggedTensor.from_lengths_sync(["x"], _t([1, 2, 3]), _t([2, 1]), weights=torch.ones(3))
    b = KeyedJaggedTensor.from_lengths_sync(["y", "z"], _t([4, 5]), _t([0, 1, 1, 0]), weights=torch.zeros(2))
    c = KeyedJaggedTensor.concat([a, b])
    assert c.keys() == ["x", "y", "z"] and c.values().tolist() == [1, 2, 3, 4, 5]
    assert c.lengths().tolist() == [2, 1, 0, 1, 1, 0] and c.weights().tolist() == [1, 1, 1, 0, 0]
    assert c.stride() == 2 and not c.variable_stride_per_key()
    # different batch sizes give a variable-stride KJT
    d = KeyedJaggedTensor.concat(
        [a, KeyedJaggedTensor.from_lengths_sync(["w"], _t([7]), _t([1, 0, 0]), weights=torch.ones(1))]
    )
    assert d.variable_stride_per_key() and d.stride_per_key() == [2, 3] and d["w"].lengths().tolist() == [1, 0, 0]
    e = KeyedJaggedTensor.empty_like(c)
    assert e.keys() == c.keys() and e.stride() == 2 and e.values().numel() == 0


def test_jagged_tensor_dense_conversions() -> None:
    jt = JaggedTensor.from_dense(
        [torch.tensor([1.0, 2.0]), torch.tensor([]), torch.tensor([3.0])],
        weights=[torch.tensor([0.5, 0.25]), torch.tensor([]), torch.tensor([2.0])],
    )
    assert jt.lengths().dtype == torch.int32 and jt.lengths().tolist() == [2, 0, 1]
    assert torch.equal(jt.to_padded_dense(), torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, 0.0]]))
    assert torch.equal(jt.to_padded_dense(1, padding_value=-1.0), torch.tensor([[1.0], [-1.0], [3.0]]))
    assert torch.equal(jt.to_padded_dense_weights(), torch.tensor([[0.5, 0.25], [0.0, 0.0], [2.0, 0.0]]))
    assert [w.tolist() for w in jt.to_dense_weights()] == [[0.5, 0.25], [], [2.0]]
    back = JaggedTensor.from_dense_lengths(jt.to_padded_dense(), jt.lengths(), jt.to_padded_dense_weights())
    assert torch.equal(back.values(), jt.values()) and torch.equal(back.weights(), jt.weights())
    assert str(jt) == (
        'JaggedTensor({\n    "values": [[1.0, 2.0], [], [3.0]],\n    "weights": [[0.5, 0.25], [], [2.0]]\n})\n'
    )
    empty = JaggedTensor.empty(is_weighted=True, values_dtype=torch.long)
    assert empty.values().dtype == torch.long and empty.lengths().dtype == torch.int32 and empty.to_dense() == []


def test_to_dict_index_per_key_and_keyed_tensor_helpers() -> None:
    kjt = KeyedJaggedTensor(["a", "b"], _t([1, 2, 3]), lengths=_t([1, 0, 2, 0]).int(), length_per_key=[1, 2])
    assert kjt.lengths().dtype == torch.int32 and kjt.offsets().dtype == torch.int32  # the caller's dtype
    assert kjt.index_per_key() == {"a": 0, "b": 1} and kjt.stride_per_key() == [2, 2]
    d = kjt.to_dict(compute_offsets=False)
    assert d["b"].values().tolist() == [2, 3] and d["b"].lengths().tolist() == [2, 0]
    with pytest.raises(ValueError, match=r"length_per_key \[1, 1\] does not split the 3 values"):
        KeyedJaggedTensor(["a", "b"], _t([1, 2, 3]), lengths=_t([1, 0, 2, 0]), length_per_key=[1, 1])
    kt = KeyedTensor.from_tensor_list(["p", "q"], [torch.ones(2, 1), torch.zeros(2, 2)])
    assert kt.length_per_key() == [1, 2] and kt.values().shape == (2, 3)
    groups = KeyedTensor.regroup_as_dict([kt], [["q"], ["p", "q"]], ["g1", "g2"])
    assert list(groups) == ["g1", "g2"] and groups["g2"].shape == (2, 3)
    assert str(kt) == 'KeyedTensor({\n    "p": [[1.0], [1.0]],\n    "q": [[0.0, 0.0], [0.0, 0.0]]\n})\n'


def test_meta_device_kjt_has_placeholder_lengths_per_key() -> None:
    # shapes only (model sizing): as TorchRec, the values split over the keys, the first key taking the rest
    meta = torch.device("meta")
    kjt = KeyedJaggedTensor(
        ["a", "b", "c"],
        torch.empty(10, device=meta),
        weights=torch.empty(10, device=meta),
        lengths=torch.empty(6, dtype=torch.long, device=meta),
    )
    assert kjt.sync().length_per_key() == [4, 3, 3]
    assert kjt.unsync().length_per_key_or_none() is None
    d = kjt.to_dict()
    assert [d[k].values().shape[0] for k in "abc"] == [4, 3, 3] and d["b"].weights().is_meta
    assert KeyedJaggedTensor.from_jt_dict(d).length_per_key() == [4, 3, 3]
    assert kjt.permute([2, 0]).values().shape[0] == 7


def test_unsync_recomputes_lengths_per_key() -> None:
    kjt = KeyedJaggedTensor.from_lengths_sync(KEYS, _t(VALUES), _t(LENGTHS))
    lpk = kjt.sync().length_per_key_or_none()
    assert lpk is not None and kjt.unsync().length_per_key_or_none() is None
    assert kjt.length_per_key() == lpk
