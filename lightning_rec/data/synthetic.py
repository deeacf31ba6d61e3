"""A synthetic, Criteo-shaped click log whose labels come from a known hidden model."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import cast

import numpy as np

from lightning_rec.data._hashing import key_of, mix64, uniform
from lightning_rec.data._stream import Arrays, ClickStream

# Criteo Terabyte click logs: distinct values per categorical feature (the counts TorchRec's and MLPerf's
# DLRM use as table sizes).
CRITEO_CARDINALITIES: list[int] = [
    45833188,
    36746,
    17245,
    7413,
    20243,
    3,
    7114,
    1441,
    62,
    29275261,
    1572176,
    345138,
    10,
    2209,
    11267,
    128,
    4,
    974,
    14,
    48937457,
    11316796,
    40094537,
    452104,
    12606,
    104,
    35,
]
NUM_DENSE = 13
FEATURE_NAMES: list[str] = [f"cat_{i}" for i in range(len(CRITEO_CARDINALITIES))]
# a few features become bags of up to N ids ("recently clicked items"), the rest stay one id per row
DEFAULT_MULTI_HOT: dict[str, int] = {"cat_1": 10, "cat_6": 5, "cat_14": 20}
SPLITS = {"train": 1, "val": 2, "test": 3, "predict": 4}

_MAX_HOT = 128
_STRIDE = 4096  # counters per row: 2 x 13 dense, 1 label, 26 lengths, 26 x 128 id slots fit below it
_LABEL, _LEN0, _ID0 = 26, 32, 64
_INTERACT_DIM = 4
# the hidden model's scale: these give a base rate near 0.25 and an achievable AUC near 0.8
_BIAS, _DENSE_STD, _CAT_STD, _INTERACT_STD = -1.5, 0.8, 1.2, 0.6


def scaled_cardinalities(
    size: float, min_cardinality: int = 16, base: Sequence[int] = CRITEO_CARDINALITIES
) -> list[int]:
    """``base`` scaled by ``size``, each at least ``min_cardinality`` (or its full count, if smaller)."""
    if not size > 0:
        raise ValueError(f"size must be > 0, got {size}")
    return [min(c, max(min_cardinality, math.ceil(c * size))) for c in base]


def _coprime_near(n: int, frac: float) -> int:
    a = max(1, int(n * frac)) | 1
    while math.gcd(a, n) != 1:
        a += 2
    return a


def binary_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC by the rank-sum formula, ties counted half (nan when a class is missing)."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels) > 0.5
    pos, neg = int(labels.sum()), int((~labels).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    r = (np.cumsum(counts) - (counts - 1) / 2.0)[inverse]  # 1-based ranks, ties share their mean rank
    return float((r[labels].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


class SyntheticClicks(ClickStream):
    """Streaming, Criteo-shaped click rows with labels from a hidden ground-truth model.

    Each row has 13 dense features (``log1p`` of heavy-tailed counts, as Criteo is usually fed),
    26 categorical features ``cat_0 .. cat_25`` with Zipf-distributed ids (popular ids scattered over the
    table, not all at the top), and a 0/1 label drawn from ``sigmoid(bias + dense + per-id effects +
    pairwise interactions of per-id vectors)``: the shape a DLRM can learn. ``achievable_auc`` is that
    hidden model's AUC, the ceiling a learned model approaches.

    Every row is a pure function of ``(seed, split, epoch, row index)``: the same rows come out for any batch
    size, world size or number of DataLoader workers, and no row is held in memory beyond its batch. With
    ``fresh_epochs`` (the default for ``train``) each epoch draws new rows of the same task, so more epochs
    help instead of repeating rows; epoch 0's rows do not depend on it.
    The hidden model depends on ``seed`` only, so ``train`` / ``val`` / ``test`` splits are different rows
    of the same task.

    Rows are sharded over ``world_size`` data-parallel ranks by the rule in
    ``lightning_rec.data._rank_rows``: the same number of batches on every rank, no overlap, no loss; the
    last batch is split evenly (and may hold one row more than ``batch_size``). Use it with
    ``DataLoader(ds, batch_size=None)``: it yields whole :class:`Batch` objects.

    Args:
        num_rows: rows in this split (over all ranks).
        batch_size: rows per batch on each rank.
        size: scales ``CRITEO_CARDINALITIES`` (table sizes), floored at ``min_cardinality``.
        seed: fixes the hidden model and the rows.
        rank, world_size: this data-parallel rank and the number of ranks.
        multi_hot: ``{feature: max ids per row}``; a row's bag length is uniform in ``[0, max]``
            (empty bags happen). ``None`` takes ``DEFAULT_MULTI_HOT``; ``{}`` makes every feature one id.
        drop_last: drop the rows after the last full global batch.
        split: ``"train"``, ``"val"``, ``"test"`` or ``"predict"``.
        cardinalities: exact table sizes (26 ints), instead of ``size``.
        zipf_exponent: the ids' Zipf exponent (larger is more skewed).
        fresh_epochs: new rows every epoch (``None``: for the ``train`` split only).
        raw_ids: emit raw ids from an unbounded id space instead of ids in ``[0, cardinality)`` (for
            managed-collision tables; ``cardinalities`` then only size the tables). A feature's ids at row
            time ``t`` (the row index, plus ``epoch * num_rows`` with ``fresh_epochs``) are Zipf ranks ``r``
            over ``raw_id_space x cardinality`` values, turned into the item ``floor(t * d) - r`` with
            ``d = raw_id_drift * cardinality / 1000`` and hashed to a non-negative 63-bit id: the most
            popular ids are the newest, and new ids keep appearing (``raw_id_drift`` of the cardinality per
            1,000 rows) while old ones fade. Labels follow the hidden model's per-id effects of the raw ids,
            so a model that gives every id its own row can learn them.
        raw_id_space, raw_id_drift: see ``raw_ids``.
    """

    num_dense: int = NUM_DENSE

    def __init__(
        self,
        num_rows: int,
        batch_size: int,
        size: float = 1e-3,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        multi_hot: Mapping[str, int] | None = None,
        drop_last: bool = False,
        split: str = "train",
        cardinalities: Sequence[int] | None = None,
        zipf_exponent: float = 1.05,
        min_cardinality: int = 16,
        fresh_epochs: bool | None = None,
        raw_ids: bool = False,
        raw_id_space: float = 2.0,
        raw_id_drift: float = 0.001,
    ) -> None:
        super().__init__()
        if split not in SPLITS:
            raise ValueError(f"SyntheticClicks: split must be one of {list(SPLITS)}, got {split!r}")
        if cardinalities is None:
            cardinalities = scaled_cardinalities(size, min_cardinality)
        cardinalities = [int(c) for c in cardinalities]
        if len(cardinalities) != len(FEATURE_NAMES) or min(cardinalities) < 1:
            raise ValueError(
                f"SyntheticClicks: cardinalities must be {len(FEATURE_NAMES)} positive ints, got {cardinalities}"
            )
        multi_hot = dict(DEFAULT_MULTI_HOT if multi_hot is None else multi_hot)
        for name, m in multi_hot.items():
            if name not in FEATURE_NAMES:
                raise ValueError(
                    f"SyntheticClicks: multi_hot names unknown feature {name!r}; features are {FEATURE_NAMES}"
                )
            if not isinstance(m, int) or not 1 <= m <= _MAX_HOT:
                raise ValueError(f"SyntheticClicks: multi_hot[{name!r}] must be an int in [1, {_MAX_HOT}], got {m!r}")
        if not zipf_exponent > 0:
            raise ValueError(f"SyntheticClicks: zipf_exponent must be > 0, got {zipf_exponent}")
        if not (raw_id_space >= 1 and raw_id_drift >= 0):
            raise ValueError(
                f"SyntheticClicks: raw_id_space must be >= 1 and raw_id_drift >= 0, got "
                f"{raw_id_space} and {raw_id_drift}"
            )
        self.raw_ids, self.raw_id_space, self.raw_id_drift = bool(raw_ids), float(raw_id_space), float(raw_id_drift)
        self.split = split
        self.cardinalities = cardinalities
        self.feature_names = list(FEATURE_NAMES)
        self.multi_hot = multi_hot
        self.fresh_epochs = split == "train" if fresh_epochs is None else bool(fresh_epochs)
        self._init_stream(
            num_rows, batch_size, rank, world_size, drop_last, False, 1, seed, f"SyntheticClicks(split={split!r})"
        )
        self._init_hidden_model(zipf_exponent)

    def _init_hidden_model(self, zipf_exponent: float) -> None:
        f = len(self.feature_names)
        n = np.asarray(self.cardinalities, dtype=np.float64)
        self._n = n.astype(np.int64)
        if self.raw_ids:  # ranks over a wider space than the table: the table cannot hold every id
            self._n = np.ceil(n * self.raw_id_space).astype(np.int64)
            n = self._n.astype(np.float64)
        self._raw_keys = np.asarray([key_of(self.seed, 0x1D5, j) for j in range(f)], dtype=np.uint64)
        self._cards = np.asarray(self.cardinalities, dtype=np.float64)
        self._one_minus_s = 1.0 - zipf_exponent
        # (n + 1) ** (1 - s) - 1, the span of the bounded power law's inverse CDF
        self._zipf_span = (n + 1.0) ** self._one_minus_s - 1.0 if self._one_minus_s != 0 else np.log(n + 1.0)
        # popular ranks land on scattered ids: rank -> (rank * a + b) mod n is a bijection when gcd(a, n) == 1
        self._scatter_a = np.asarray([_coprime_near(int(c), 0.6180339887) for c in self._n], dtype=np.int64)
        self._scatter_b = (uniform(key_of(self.seed, 7), np.arange(f)) * self._n).astype(np.int64)
        self._max_hot = np.asarray([self.multi_hot.get(name, 0) for name in self.feature_names], dtype=np.int64)
        mk = key_of(self.seed, 0xA11CE)
        self._model_key = mk
        w = uniform(mk, np.arange(NUM_DENSE) + 1) * 2 - 1
        self._dense_w = w / np.linalg.norm(w) * _DENSE_STD
        r = 0.2 + 0.8 * uniform(mk, np.arange(f) + 100)
        self._cat_w = r / np.linalg.norm(r) * _CAT_STD * math.sqrt(3.0)  # effects are uniform, variance 1/3
        pairs = f * (f - 1) / 2
        # a dot product of two vectors with entries uniform in [-c, c] has variance dim * (c^2 / 3)^2
        self._vec_c = math.sqrt(3.0 * _INTERACT_STD / math.sqrt(pairs * _INTERACT_DIM))
        self._dense_mu = 0.5 + 2.0 * uniform(mk, np.arange(NUM_DENSE) + 200)
        self._dense_sigma = 0.5 + 1.0 * uniform(mk, np.arange(NUM_DENSE) + 300)

    def read_rows(self, start: int, stop: int) -> Arrays:
        return cast(Arrays, self.rows(start, stop, self.epoch)[:4])

    def describe(self) -> dict:
        return {**super().describe(), "split": self.split, "fresh_epochs": self.fresh_epochs, "raw_ids": self.raw_ids}

    def rows(self, start: int, stop: int, epoch: int = 0) -> tuple[np.ndarray, ...]:
        """Rows ``[start, stop)`` of the split in ``epoch``: dense, lengths ``[F, B]``, values, labels, true
        probabilities."""
        b, f = stop - start, len(self.feature_names)
        row_key = (
            key_of(self.seed, SPLITS[self.split], epoch)
            if self.fresh_epochs and epoch
            else key_of(self.seed, SPLITS[self.split])
        )
        rows = np.arange(start, stop, dtype=np.uint64) * np.uint64(_STRIDE)
        u = uniform(row_key, rows[:, None] + np.arange(2 * NUM_DENSE, dtype=np.uint64))
        z = np.sqrt(-2.0 * np.log1p(-u[:, :NUM_DENSE])) * np.cos(2 * np.pi * u[:, NUM_DENSE:])
        counts = np.floor(np.exp(self._dense_mu + self._dense_sigma * z))
        dense = np.log1p(counts)

        u_len = uniform(row_key, rows[None, :] + (_LEN0 + np.arange(f, dtype=np.uint64))[:, None])
        hot = self._max_hot[:, None]
        lengths = np.where(hot > 0, np.floor(u_len * (hot + 1)), 1).astype(np.int64)
        flat_len = lengths.reshape(-1)
        bag = np.repeat(np.arange(f * b), flat_len)  # key-major bag index of every id
        feat, row = bag // b, bag % b
        starts = np.cumsum(flat_len) - flat_len
        slot = np.arange(bag.size) - starts[bag]
        u_id = uniform(row_key, rows[row] + (_ID0 + feat * _MAX_HOT + slot).astype(np.uint64))
        if self._one_minus_s != 0:
            x = (1.0 + u_id * self._zipf_span[feat]) ** (1.0 / self._one_minus_s)
        else:
            x = np.exp(u_id * self._zipf_span[feat])
        rank_ = np.minimum(np.floor(x).astype(np.int64) - 1, self._n[feat] - 1)
        if self.raw_ids:
            t0 = epoch * self.num_rows if self.fresh_epochs else 0
            t = np.arange(start, stop, dtype=np.float64) + t0
            shift = np.floor(t[row] * (self.raw_id_drift / 1000.0) * self._cards[feat]).astype(np.int64)
            item = (shift - rank_).astype(np.uint64)  # wraps below 0: still one value per item
            values = (mix64(item ^ self._raw_keys[feat]) >> np.uint64(1)).astype(np.int64)
        else:
            values = (rank_ * self._scatter_a[feat] + self._scatter_b[feat]) % self._n[feat]

        probs = self._probabilities(z, values, feat, bag, flat_len, b)
        labels = (uniform(row_key, rows + np.uint64(_LABEL)) < probs).astype(np.float32)
        return dense.astype(np.float32), lengths, values, labels, probs

    def _probabilities(
        self, z: np.ndarray, values: np.ndarray, feat: np.ndarray, bag: np.ndarray, flat_len: np.ndarray, b: int
    ) -> np.ndarray:
        f = len(self.feature_names)
        cell = (values.astype(np.uint64) << np.uint64(6)) | feat.astype(np.uint64)  # (id, feature) -> counter
        denom = np.maximum(flat_len, 1).astype(np.float64)
        effect = uniform(self._model_key, cell << np.uint64(3)) * 2 - 1
        pooled = (np.bincount(bag, weights=effect, minlength=f * b) / denom).reshape(f, b)
        logit = _BIAS + z @ self._dense_w + self._cat_w @ pooled
        vecs = np.empty((_INTERACT_DIM, f, b))
        for d in range(_INTERACT_DIM):
            v = (uniform(self._model_key, (cell << np.uint64(3)) + np.uint64(d + 1)) * 2 - 1) * self._vec_c
            vecs[d] = (np.bincount(bag, weights=v, minlength=f * b) / denom).reshape(f, b)
        total = vecs.sum(axis=1)  # sum over features: sum_{f<g} <p_f, p_g> = (|sum p|^2 - sum |p_f|^2) / 2
        logit += ((total**2).sum(0) - (vecs**2).sum(axis=(0, 1))) / 2.0
        return 1.0 / (1.0 + np.exp(-logit))

    def achievable_auc(self, num_rows: int | None = None, chunk: int = 65536) -> float:
        """AUC of the hidden model's true probabilities against the labels of this split's first rows.

        ``num_rows`` defaults to the whole split (all ranks); rows are generated in chunks, not held.
        """
        n = self.num_rows if num_rows is None else int(num_rows)
        probs, labels = [], []
        for s in range(0, n, chunk):
            *_, y, p = self.rows(s, min(n, s + chunk))
            probs.append(p)
            labels.append(y)
        return binary_auc(np.concatenate(probs), np.concatenate(labels)) if n else float("nan")

    def base_rate(self, num_rows: int = 65536) -> float:
        """Fraction of positive labels among the split's first ``num_rows`` rows."""
        return float(self.rows(0, min(num_rows, max(self.num_rows, 1)))[3].mean())
