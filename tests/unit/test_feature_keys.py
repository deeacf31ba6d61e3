"""A KJT whose keys miss a collection's features: the error names every key the KJT had."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_rec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)

TABLES = [EmbeddingBagConfig(name="user", num_embeddings=5, embedding_dim=4, feature_names=["user_id"])]


def _kjt(keys: list[str], device: str = "cpu") -> KeyedJaggedTensor:
    n = len(keys)
    return KeyedJaggedTensor.from_lengths_sync(
        keys, torch.zeros(n, dtype=torch.long, device=device), torch.ones(n, dtype=torch.long, device=device)
    )


def test_ignored_keys_are_still_named() -> None:
    ebc = EmbeddingBagCollection(TABLES)  # strict_features=False: keys no table reads are ignored
    want = (
        "KeyedJaggedTensor keys do not match the collection's features: missing ['user_id'] (expected "
        "['user_id']; the KeyedJaggedTensor has keys ['uid', 'item_id']; no table reads ['uid', 'item_id'], "
        "ignored as strict_features=False)"
    )
    with pytest.raises(ValueError, match=re.escape(want)):
        ebc(_kjt(["uid", "item_id"]))
    with pytest.raises(ValueError, match=re.escape("the KeyedJaggedTensor has keys ['uid', 'item_id']")):
        ebc(_kjt(["uid", "item_id"], device="meta"))  # the shapes-only forward says the same
    ec = EmbeddingCollection([EmbeddingConfig(name="t", num_embeddings=5, embedding_dim=4, feature_names=["x"])])
    with pytest.raises(
        ValueError,
        match=re.escape(
            "missing ['x'] (expected ['x']; the KeyedJaggedTensor has keys ['y']; no table reads ['y'], ignored"
        ),
    ):
        ec(_kjt(["y"]))


def test_strict_lists_unexpected_and_every_key() -> None:
    ebc = EmbeddingBagCollection(TABLES, strict_features=True)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "missing ['user_id'], unexpected ['uid'] (expected ['user_id']; the KeyedJaggedTensor has keys ['uid'])"
        ),
    ):
        ebc(_kjt(["uid"]))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "missing [], unexpected ['extra'] (expected ['user_id']; "
            "the KeyedJaggedTensor has keys ['user_id', 'extra'])"
        ),
    ):
        ebc(_kjt(["user_id", "extra"]))


def test_missing_among_read_keys_names_no_ignored_keys() -> None:
    two = TABLES + [EmbeddingBagConfig(name="item", num_embeddings=5, embedding_dim=4, feature_names=["item_id"])]
    with pytest.raises(
        ValueError,
        match=re.escape(
            "missing ['item_id'] (expected ['user_id', 'item_id']; the KeyedJaggedTensor has keys ['user_id'])"
        ),
    ):
        EmbeddingBagCollection(two)(_kjt(["user_id"]))
