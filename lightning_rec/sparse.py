"""Sparse input and output types: JaggedTensor, KeyedJaggedTensor, KeyedTensor.

Layouts follow TorchRec: a KeyedJaggedTensor is key-major, so ``lengths()`` is ``[F * B]`` with all
bags of the first key, then all bags of the second key, and so on. Validation happens once, when an
object is built; every method after that trusts the invariants.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.long, device=lengths.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


def _check_index_tensor(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"`{name}` must be 1-D, got shape {tuple(t.shape)}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"`{name}` must hold integers, got dtype {t.dtype}")


def _lengths_or_offsets(
    values: torch.Tensor, lengths: torch.Tensor | None, offsets: torch.Tensor | None, what: str
) -> tuple[torch.Tensor, torch.Tensor]:
    if lengths is None and offsets is None:
        raise ValueError(f"{what} needs `lengths` or `offsets`")
    if lengths is not None:
        _check_index_tensor("lengths", lengths)
        lengths = lengths.long()
        if lengths.numel() and int(lengths.min()) < 0:
            raise ValueError(f"{what}: `lengths` must be non-negative, got min {int(lengths.min())}")
        computed = _offsets_from_lengths(lengths)
        if offsets is not None:
            _check_index_tensor("offsets", offsets)
            if not torch.equal(offsets.long(), computed):
                raise ValueError(f"{what}: `offsets` do not match the cumulative sum of `lengths`")
        offsets = computed
    else:
        assert offsets is not None
        _check_index_tensor("offsets", offsets)
        offsets = offsets.long()
        if offsets.numel() == 0 or int(offsets[0]) != 0:
            raise ValueError(f"{what}: `offsets` must start with 0 and have one more entry than bags")
        lengths = offsets[1:] - offsets[:-1]
        if lengths.numel() and int(lengths.min()) < 0:
            raise ValueError(f"{what}: `offsets` must be non-decreasing")
    total = int(offsets[-1])
    if total != values.size(0):
        raise ValueError(
            f"{what}: lengths sum to {total} but `values` has {values.size(0)} entries"
        )
    return lengths, offsets


class JaggedTensor:
    """A batch of variable-length rows: ``values`` cut into bags by ``lengths`` / ``offsets``.

    ``values`` is 1-D (ids) or 2-D (one embedding per id, as returned by ``EmbeddingCollection``).
    """

    def __init__(
        self,
        values: torch.Tensor,
        lengths: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
    ) -> None:
        if not isinstance(values, torch.Tensor) or values.dim() not in (1, 2):
            raise ValueError("JaggedTensor `values` must be a 1-D or 2-D tensor")
        self._lengths, self._offsets = _lengths_or_offsets(values, lengths, offsets, "JaggedTensor")
        if weights is not None and weights.shape[:1] != values.shape[:1]:
            raise ValueError(
                f"JaggedTensor: `weights` has {weights.size(0)} entries but `values` has {values.size(0)}"
            )
        self._values = values
        self._weights = weights

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        return self._offsets

    def weights(self) -> torch.Tensor:
        if self._weights is None:
            raise ValueError("this JaggedTensor has no weights")
        return self._weights

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def to_dense(self) -> list[torch.Tensor]:
        """One tensor per bag."""
        return list(torch.split(self._values, self._lengths.tolist()))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedTensor:
        return JaggedTensor(
            self._values.to(device, non_blocking=non_blocking),
            lengths=self._lengths.to(device, non_blocking=non_blocking),
            weights=None if self._weights is None else self._weights.to(device, non_blocking=non_blocking),
        )

    def __repr__(self) -> str:
        return f"JaggedTensor(values={self._values}, lengths={self._lengths})"


class KeyedJaggedTensor:
    """Sparse features of one batch: for each key (feature) and each sample, a bag of ids.

    Args:
        keys: feature names; any strings, in the order their bags appear in ``values``.
        values: 1-D integer ids, key-major (all ids of key 0, then key 1, ...).
        weights: optional per-id float weights, same length as ``values``.
        lengths: ``[len(keys) * stride]`` bag sizes, key-major. Give this or ``offsets``.
        offsets: ``[len(keys) * stride + 1]`` cumulative bag boundaries.
        stride: batch size; inferred from ``lengths`` unless there are no keys.

    Example (2 keys, batch of 3)::

        keys    = ["f1", "f2"]
        lengths = [2, 0, 1,   1, 1, 1]      # f1: [a b] [] [c]   f2: [d] [e] [f]
        values  = [a, b, c,   d, e, f]
    """

    def __init__(
        self,
        keys: Sequence[str],
        values: torch.Tensor,
        weights: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        stride: int | None = None,
        *,
        _allow_duplicate_keys: bool = False,
    ) -> None:
        keys = list(keys)
        for k in keys:
            if not isinstance(k, str):
                raise TypeError(f"KeyedJaggedTensor keys must be strings, got {k!r}")
        # User input must name each key once; ``permute`` may repeat keys (TorchRec semantics), and the
        # transforms below carry such a KJT along.
        if not _allow_duplicate_keys and len(set(keys)) != len(keys):
            dup = sorted({k for k in keys if keys.count(k) > 1})
            raise ValueError(f"KeyedJaggedTensor keys must be unique, duplicated: {dup}")
        _check_index_tensor("values", values)
        lengths, offsets = _lengths_or_offsets(values, lengths, offsets, "KeyedJaggedTensor")
        n_bags = lengths.numel()
        if keys:
            if n_bags % len(keys):
                raise ValueError(
                    f"KeyedJaggedTensor: {n_bags} lengths cannot be split evenly over {len(keys)} keys "
                    "(every key needs the same batch size)"
                )
            inferred = n_bags // len(keys)
            if stride is not None and stride != inferred:
                raise ValueError(
                    f"KeyedJaggedTensor: stride={stride} but {n_bags} lengths over {len(keys)} keys "
                    f"give a batch size of {inferred}"
                )
            stride = inferred
        else:
            if n_bags:
                raise ValueError("KeyedJaggedTensor with no keys must have no lengths")
            stride = stride or 0
        if weights is not None:
            if not isinstance(weights, torch.Tensor) or weights.dim() != 1:
                raise ValueError("KeyedJaggedTensor `weights` must be a 1-D tensor")
            if not weights.is_floating_point():
                raise ValueError(f"KeyedJaggedTensor `weights` must be floating point, got {weights.dtype}")
            if weights.numel() != values.numel():
                raise ValueError(
                    f"KeyedJaggedTensor: `weights` has {weights.numel()} entries but `values` has {values.numel()}"
                )
        self._keys = keys
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._offsets = offsets
        self._stride = stride
        self._length_per_key: list[int] | None = None

    # -- constructors (TorchRec names) --------------------------------------------------------------
    @staticmethod
    def from_lengths_sync(
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
        stride: int | None = None,
    ) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(keys, values, weights=weights, lengths=lengths, stride=stride)

    @staticmethod
    def from_offsets_sync(
        keys: Sequence[str],
        values: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None = None,
        stride: int | None = None,
    ) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(keys, values, weights=weights, offsets=offsets, stride=stride)

    @staticmethod
    def from_jt_dict(jt_dict: dict[str, JaggedTensor]) -> KeyedJaggedTensor:
        """Build from ``{key: JaggedTensor}``; every JaggedTensor must have the same number of bags."""
        keys = list(jt_dict)
        if not keys:
            return KeyedJaggedTensor([], torch.zeros(0, dtype=torch.long), lengths=torch.zeros(0, dtype=torch.long))
        jts = [jt_dict[k] for k in keys]
        has_w = [jt.weights_or_none() is not None for jt in jts]
        if any(has_w) and not all(has_w):
            raise ValueError("from_jt_dict: either every JaggedTensor has weights or none has")
        return KeyedJaggedTensor(
            keys,
            torch.cat([jt.values() for jt in jts]),
            weights=torch.cat([jt.weights() for jt in jts]) if all(has_w) else None,
            lengths=torch.cat([jt.lengths() for jt in jts]),
        )

    @staticmethod
    def empty(keys: Sequence[str] = (), device: torch.device | str | None = None) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(
            keys,
            torch.zeros(0, dtype=torch.long, device=device),
            lengths=torch.zeros(0, dtype=torch.long, device=device),
            stride=0,
        )

    # -- accessors ----------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        return self._offsets

    def weights(self) -> torch.Tensor:
        if self._weights is None:
            raise ValueError("this KeyedJaggedTensor has no weights")
        return self._weights

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def stride(self) -> int:
        """The batch size: number of bags per key."""
        return self._stride

    @property
    def device(self) -> torch.device:
        return self._values.device

    def length_per_key(self) -> list[int]:
        """Number of ids of each key."""
        if self._length_per_key is None:
            if self._keys:
                self._length_per_key = self._lengths.view(len(self._keys), self._stride).sum(1).tolist()
            else:
                self._length_per_key = []
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        out = [0]
        for n in self.length_per_key():
            out.append(out[-1] + n)
        return out

    def __getitem__(self, key: str) -> JaggedTensor:
        try:
            i = self._keys.index(key)
        except ValueError:
            raise KeyError(f"feature {key!r} is not in this KeyedJaggedTensor (keys: {self._keys})") from None
        opk = self.offset_per_key()
        b = self._stride
        return JaggedTensor(
            self._values[opk[i] : opk[i + 1]],
            lengths=self._lengths[i * b : (i + 1) * b],
            weights=None if self._weights is None else self._weights[opk[i] : opk[i + 1]],
        )

    def to_dict(self) -> dict[str, JaggedTensor]:
        return {k: self[k] for k in self._keys}

    # -- transforms ---------------------------------------------------------------------------------
    def split(self, segments: Sequence[int]) -> list[KeyedJaggedTensor]:
        """Split by keys into consecutive groups of ``segments[i]`` keys."""
        if sum(segments) != len(self._keys) or any(s < 0 for s in segments):
            raise ValueError(f"split sizes {list(segments)} must be non-negative and sum to {len(self._keys)} keys")
        opk = self.offset_per_key()
        out, k = [], 0
        b = self._stride
        for s in segments:
            lo, hi = opk[k], opk[k + s]
            out.append(
                KeyedJaggedTensor(
                    self._keys[k : k + s],
                    self._values[lo:hi],
                    weights=None if self._weights is None else self._weights[lo:hi],
                    lengths=self._lengths[k * b : (k + s) * b],
                    stride=b,
                    _allow_duplicate_keys=True,
                )
            )
            k += s
        return out

    def permute(self, indices: Sequence[int]) -> KeyedJaggedTensor:
        """Reorder (or repeat) keys: the result has keys ``[keys[i] for i in indices]``."""
        n = len(self._keys)
        for i in indices:
            if not 0 <= i < n:
                raise ValueError(f"permute index {i} out of range for {n} keys")
        opk = self.offset_per_key()
        b = self._stride
        idx = torch.as_tensor(list(indices), dtype=torch.long, device=self._values.device)
        lengths = self._lengths.view(n, b)[idx].reshape(-1) if n else self._lengths
        seg_starts = torch.as_tensor(opk[:-1], dtype=torch.long, device=self._values.device)[idx]
        seg_lens = torch.as_tensor(self.length_per_key(), dtype=torch.long, device=self._values.device)[idx]
        gather = _segment_gather_index(seg_starts, seg_lens)
        return KeyedJaggedTensor(
            [self._keys[i] for i in indices],
            self._values[gather],
            weights=None if self._weights is None else self._weights[gather],
            lengths=lengths,
            stride=b,
            _allow_duplicate_keys=True,
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedJaggedTensor:
        if torch.device(device) == self.device:
            return self
        return KeyedJaggedTensor(
            self._keys,
            self._values.to(device, non_blocking=non_blocking),
            weights=None if self._weights is None else self._weights.to(device, non_blocking=non_blocking),
            lengths=self._lengths.to(device, non_blocking=non_blocking),
            stride=self._stride,
            _allow_duplicate_keys=True,
        )

    def pin_memory(self) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(
            self._keys,
            self._values.pin_memory(),
            weights=None if self._weights is None else self._weights.pin_memory(),
            lengths=self._lengths.pin_memory(),
            stride=self._stride,
            _allow_duplicate_keys=True,
        )

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        for t in (self._values, self._lengths, self._offsets, self._weights):
            if t is not None:
                t.record_stream(stream)

    def __repr__(self) -> str:
        return (
            f"KeyedJaggedTensor(keys={self._keys}, stride={self._stride}, lengths={self._lengths.tolist()}, "
            f"values={self._values.tolist()}" + ("" if self._weights is None else f", weights={self._weights.tolist()}") + ")"
        )


def _segment_gather_index(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Index that concatenates segments ``[starts[i], starts[i] + lens[i])`` in order, without a loop."""
    total = int(lens.sum()) if lens.numel() else 0
    if total == 0:
        return torch.zeros(0, dtype=torch.long, device=starts.device)
    out_starts = torch.cumsum(lens, 0) - lens
    shift = torch.repeat_interleave(starts - out_starts, lens)
    return torch.arange(total, device=starts.device) + shift


class KeyedTensor:
    """Pooled embeddings of one batch: ``values()`` is ``[batch, sum(length_per_key)]``, key blocks side by side."""

    def __init__(self, keys: Sequence[str], length_per_key: Sequence[int], values: torch.Tensor, key_dim: int = 1) -> None:
        if key_dim != 1:
            raise ValueError("KeyedTensor only supports key_dim=1")
        keys, length_per_key = list(keys), [int(x) for x in length_per_key]
        if len(keys) != len(length_per_key):
            raise ValueError(f"KeyedTensor: {len(keys)} keys but {len(length_per_key)} lengths")
        if values.dim() != 2 or values.size(1) != sum(length_per_key):
            raise ValueError(
                f"KeyedTensor: values must be [batch, {sum(length_per_key)}], got {tuple(values.shape)}"
            )
        self._keys = keys
        self._length_per_key = length_per_key
        self._values = values
        self._offsets = [0]
        for n in length_per_key:
            self._offsets.append(self._offsets[-1] + n)

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def length_per_key(self) -> list[int]:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        return self._offsets

    def key_dim(self) -> int:
        return 1

    def __getitem__(self, key: str) -> torch.Tensor:
        try:
            i = self._keys.index(key)
        except ValueError:
            raise KeyError(f"{key!r} is not in this KeyedTensor (keys: {self._keys})") from None
        return self._values[:, self._offsets[i] : self._offsets[i + 1]]

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {k: self[k] for k in self._keys}

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedTensor:
        return KeyedTensor(self._keys, self._length_per_key, self._values.to(device, non_blocking=non_blocking))

    @staticmethod
    def regroup(keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]) -> list[torch.Tensor]:
        """Concatenate the columns of the named keys, one tensor per group, across several KeyedTensors."""
        where: dict[str, torch.Tensor] = {}
        for kt in keyed_tensors:
            for k in kt.keys():
                if k in where:
                    raise ValueError(f"regroup: key {k!r} appears in more than one KeyedTensor")
                where[k] = kt[k]
        out = []
        for g in groups:
            missing = [k for k in g if k not in where]
            if missing:
                raise KeyError(f"regroup: keys {missing} not found (available: {sorted(where)})")
            out.append(torch.cat([where[k] for k in g], dim=1))
        return out

    def __repr__(self) -> str:
        return f"KeyedTensor(keys={self._keys}, length_per_key={self._length_per_key}, values={self._values})"
