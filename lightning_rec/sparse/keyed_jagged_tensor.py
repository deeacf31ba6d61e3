"""KeyedJaggedTensor: the sparse features of one batch (TorchRec's ``KeyedJaggedTensor``).

The layout is key-major: ``lengths()`` holds all bags of the first key, then all bags of the second key, and
so on. Every key has ``stride()`` bags, or, with a variable batch size per feature (TorchRec's VBE,
``stride_per_key_per_rank``), ``stride_per_key()[i]`` bags. Checks that need tensor values run once, when an
object is built eagerly; methods after that trust the invariants.
"""

# no ``from __future__ import annotations``: TorchScript cannot parse some string annotations (torch.device)
from collections.abc import Callable

import torch

from lightning_rec.sparse import _format, _utils
from lightning_rec.sparse._utils import (
    SparseMeta,
    check_no_trailing,
    checks_enabled,
    cumsum_list,
    offsets_from_lengths,
    script_lengths_and_offsets,
    script_strides,
)
from lightning_rec.sparse.jagged_tensor import JaggedTensor


class KeyedJaggedTensor(metaclass=SparseMeta):
    """Sparse features of one batch: for each key (feature) and each sample, a bag of ids.

    Args (TorchRec's names and order):
        keys: feature names; any strings, in the order their bags appear in ``values``.
        values: ids (or any per-entry data), key-major. The lookup modules require integer ids.
        weights: optional per-entry weights, same length as ``values``.
        lengths: ``[sum(stride_per_key)]`` bag sizes, key-major. Give this or ``offsets``.
        offsets: cumulative bag boundaries (one more entry than bags).
        stride: batch size; inferred from ``lengths`` unless there are no keys.
        stride_per_key_per_rank: variable batch size per feature, ``[key][rank]`` (TorchRec's VBE).
        length_per_key / offset_per_key: ids per key, if the caller already knows them (saves a sync).
        inverse_indices: ``(keys, [F, B] tensor)`` mapping each sample to its deduplicated bag (VBE).

    ``torch.jit.script``-able, as TorchRec's: under TorchScript the checks are skipped (as TorchRec never runs
    them) and the arithmetic is the same.

    Example (2 keys, batch of 3)::

        keys    = ["f1", "f2"]
        lengths = [2, 0, 1,   1, 1, 1]      # f1: [a b] [] [c]   f2: [d] [e] [f]
        values  = [a, b, c,   d, e, f]
    """

    # ``device`` is a property here (a method in TorchRec): TorchScript code reads ``values().device``
    __jit_unused_properties__ = ["device"]  # noqa: RUF012

    def __init__(
        self,
        keys: list[str],
        values: torch.Tensor,
        weights: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: list[list[int]] | None = None,
        stride_per_key: list[int] | None = None,
        length_per_key: list[int] | None = None,
        lengths_offset_per_key: list[int] | None = None,
        offset_per_key: list[int] | None = None,
        index_per_key: dict[str, int] | None = None,
        jt_dict: dict[str, JaggedTensor] | None = None,
        inverse_indices: tuple[list[str], torch.Tensor] | None = None,
    ) -> None:
        if torch.jit.is_scripting():
            # TorchScript compiles this branch only (the eager one below is Python it cannot compile)
            lengths, offsets = script_lengths_and_offsets(lengths, offsets)
            stride, spkpr, spk = script_strides(keys, lengths.numel(), stride, stride_per_key_per_rank)
        else:
            keys, lengths, offsets, stride, spkpr, spk, length_per_key = _utils.eager_fields(
                keys, values, weights, lengths, offsets, stride, stride_per_key_per_rank, length_per_key, offset_per_key
            )
        # TorchScript reads the attributes' types from these annotations
        self._keys = keys
        self._values = values
        self._weights = weights
        self._lengths: torch.Tensor = lengths
        self._offsets: torch.Tensor = offsets
        self._stride: int = stride
        self._stride_per_key: list[int] = spk
        self._stride_per_key_per_rank: list[list[int]] = spkpr
        self._variable_stride: bool = stride_per_key_per_rank is not None
        self._lengths_offset_per_key: list[int] = cumsum_list(spk)
        self._length_per_key: list[int] | None = length_per_key
        self._inverse_indices = inverse_indices

    # -- constructors (TorchRec names) --------------------------------------------------------------
    @staticmethod
    def from_lengths_sync(
        keys: list[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: list[list[int]] | None = None,
        inverse_indices: tuple[list[str], torch.Tensor] | None = None,
    ) -> "KeyedJaggedTensor":
        return KeyedJaggedTensor(
            keys,
            values,
            weights=weights,
            lengths=lengths,
            stride=stride,
            stride_per_key_per_rank=stride_per_key_per_rank,
            inverse_indices=inverse_indices,
        )

    @staticmethod
    def from_offsets_sync(
        keys: list[str],
        values: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: list[list[int]] | None = None,
        inverse_indices: tuple[list[str], torch.Tensor] | None = None,
    ) -> "KeyedJaggedTensor":
        return KeyedJaggedTensor(
            keys,
            values,
            weights=weights,
            offsets=offsets,
            stride=stride,
            stride_per_key_per_rank=stride_per_key_per_rank,
            inverse_indices=inverse_indices,
        )

    @staticmethod
    def from_jt_dict(jt_dict: dict[str, JaggedTensor]) -> "KeyedJaggedTensor":
        """Build from ``{key: JaggedTensor}``; JaggedTensors with different bag counts give a VBE KJT."""
        keys = list(jt_dict.keys())
        if len(keys) == 0:
            return KeyedJaggedTensor.empty()
        jts = [jt_dict[k] for k in keys]
        has_w = [jt.weights_or_none() is not None for jt in jts]
        if any(has_w) and not all(has_w):
            raise ValueError("from_jt_dict: either every JaggedTensor has weights or none has")
        strides = [jt.lengths().numel() for jt in jts]
        same = strides.count(strides[0]) == len(strides)
        if not torch.jit.is_scripting() and checks_enabled():
            for k in keys:
                check_no_trailing(jt_dict[k], "KeyedJaggedTensor.from_jt_dict")
        return KeyedJaggedTensor(
            keys,
            torch.cat([jt.values() for jt in jts]),
            weights=torch.cat([jt.weights() for jt in jts]) if all(has_w) else None,
            lengths=torch.cat([jt.lengths() for jt in jts]),
            stride_per_key_per_rank=None if same else [[s] for s in strides],
        )

    @staticmethod
    def empty(
        is_weighted: bool = False,
        device: torch.device | None = None,
        values_dtype: torch.dtype | None = None,
        weights_dtype: torch.dtype | None = None,
        lengths_dtype: torch.dtype = torch.int32,
    ) -> "KeyedJaggedTensor":
        """No keys, no values (TorchRec's signature)."""
        no_keys: list[str] = []
        return KeyedJaggedTensor(
            no_keys,
            torch.empty(0, dtype=torch.long if values_dtype is None else values_dtype, device=device),
            weights=torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None,
            lengths=torch.empty(0, dtype=lengths_dtype, device=device),
            stride=0,
        )

    @staticmethod
    def empty_like(kjt: "KeyedJaggedTensor") -> "KeyedJaggedTensor":
        """Same keys, stride and dtypes, no ids."""
        return _empty_like(kjt)

    @staticmethod
    def concat(kjt_list: list["KeyedJaggedTensor"]) -> "KeyedJaggedTensor":
        """Keys of every KJT side by side (each KJT's bags stay key-major)."""
        return _concat(kjt_list)

    @staticmethod
    def _empty_like(kjt: "KeyedJaggedTensor") -> "KeyedJaggedTensor":
        n = sum(kjt.stride_per_key())
        w = kjt.weights_or_none()
        return KeyedJaggedTensor(
            kjt.keys(),
            kjt.values()[:0],
            weights=None if w is None else w[:0],
            lengths=torch.zeros(n, dtype=kjt.lengths().dtype, device=kjt.values().device),
            stride=kjt.stride(),
            stride_per_key_per_rank=kjt.stride_per_key_per_rank() if kjt.variable_stride_per_key() else None,
        )

    @staticmethod
    def _concat(kjt_list: list["KeyedJaggedTensor"]) -> "KeyedJaggedTensor":
        # plain loops: TorchScript compiles this (no sets, generators or nested comprehensions)
        if len(kjt_list) == 0:
            raise ValueError("KeyedJaggedTensor.concat needs at least one KeyedJaggedTensor")
        has_w = [k.weights_or_none() is not None for k in kjt_list]
        if any(has_w) and not all(has_w):
            raise ValueError("KeyedJaggedTensor.concat: either every KeyedJaggedTensor has weights or none has")
        strides: list[int] = []
        variable = False
        keys: list[str] = []
        spkpr: list[list[int]] = []
        lpk: list[int] = []
        for k in kjt_list:
            if len(k.keys()) > 0:
                strides.append(k.stride())
            variable = variable or k.variable_stride_per_key()
            keys.extend(k.keys())
            spkpr.extend(k.stride_per_key_per_rank())
            lpk.extend(k.length_per_key())
            if not torch.jit.is_scripting() and checks_enabled():
                check_no_trailing(k, "KeyedJaggedTensor.concat")
        if len(strides) > 0 and strides.count(strides[0]) != len(strides):
            variable = True
        return KeyedJaggedTensor(
            keys,
            torch.cat([k.values() for k in kjt_list]),
            weights=torch.cat([k.weights() for k in kjt_list]) if all(has_w) else None,
            lengths=torch.cat([k.lengths() for k in kjt_list]),
            stride=max(strides) if len(strides) > 0 else 0,
            stride_per_key_per_rank=spkpr if variable else None,
            length_per_key=lpk,
        )

    # -- accessors ----------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def lengths_or_none(self) -> torch.Tensor | None:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        return self._offsets

    def offsets_or_none(self) -> torch.Tensor | None:
        return self._offsets

    def weights(self) -> torch.Tensor:
        w = self._weights  # a local: TorchScript refines locals, not attributes
        if w is None:
            raise ValueError("this KeyedJaggedTensor has no weights")
        return w

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def stride(self) -> int:
        """The batch size: number of bags per key (the largest one with a variable batch size)."""
        return self._stride

    def stride_per_key(self) -> list[int]:
        return self._stride_per_key

    def stride_per_key_per_rank(self) -> list[list[int]]:
        return self._stride_per_key_per_rank

    def variable_stride_per_key(self) -> bool:
        return self._variable_stride

    def inverse_indices(self) -> tuple[list[str], torch.Tensor]:
        inv = self._inverse_indices
        if inv is None:
            raise ValueError("this KeyedJaggedTensor has no inverse_indices")
        return inv

    def inverse_indices_or_none(self) -> tuple[list[str], torch.Tensor] | None:
        return self._inverse_indices

    @property
    def device(self) -> torch.device:
        return self._values.device

    def index_per_key(self) -> dict[str, int]:
        return {k: i for i, k in enumerate(self._keys)}

    def lengths_offset_per_key(self) -> list[int]:
        return self._lengths_offset_per_key

    def length_per_key(self) -> list[int]:
        """Number of ids of each key (one device sync, cached)."""
        lpk = self._length_per_key
        if lpk is None:
            lpk = _utils.ids_per_key(
                len(self._keys),
                self._values,
                self._lengths,
                self._offsets,
                self._stride,
                self._variable_stride,
                self._lengths_offset_per_key,
            )
            self._length_per_key = lpk
        return lpk

    def unsync(self) -> "KeyedJaggedTensor":
        """Forget the cached ids per key (TorchRec's ``unsync``); the next ``length_per_key()`` recomputes."""
        self._length_per_key = None
        return self

    def length_per_key_or_none(self) -> list[int] | None:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        return cumsum_list(self.length_per_key())

    def offset_per_key_or_none(self) -> list[int] | None:
        return None if self._length_per_key is None else self.offset_per_key()

    def _key_index(self, key: str) -> int:
        if key not in self._keys:
            # no f-string conversion (``!r``): TorchScript compiles this
            keys = ", ".join(self._keys)
            raise KeyError("feature '" + key + "' is not in this KeyedJaggedTensor (keys: " + keys + ")")
        return self._keys.index(key)

    def _slice(self, i: int, opk: list[int], compute_offsets: bool = True) -> JaggedTensor:
        lo, hi = self._lengths_offset_per_key[i], self._lengths_offset_per_key[i + 1]
        lengths = self._lengths[lo:hi]
        w = self._weights
        return JaggedTensor(
            self._values[opk[i] : opk[i + 1]],
            weights=None if w is None else w[opk[i] : opk[i + 1]],
            lengths=lengths,
            offsets=(self._offsets[lo : hi + 1] - self._offsets[lo]) if compute_offsets else None,
        )

    def __getitem__(self, key: str) -> JaggedTensor:
        return self._slice(self._key_index(key), self.offset_per_key(), True)

    def to_dict(self, compute_offsets: bool = True) -> dict[str, JaggedTensor]:
        opk = self.offset_per_key()
        return {k: self._slice(i, opk, compute_offsets) for i, k in enumerate(self._keys)}

    # -- transforms ---------------------------------------------------------------------------------
    def split(self, segments: list[int]) -> list["KeyedJaggedTensor"]:
        """Split by keys into consecutive groups of ``segments[i]`` keys."""
        if sum(segments) != len(self._keys) or (len(segments) > 0 and min(segments) < 0):
            n = str(len(self._keys))
            raise ValueError("split sizes " + str(segments) + " must be non-negative and sum to " + n)
        opk, lopk, lpk = self.offset_per_key(), self._lengths_offset_per_key, self.length_per_key()
        out: list[KeyedJaggedTensor] = []
        k = 0
        w = self._weights
        for s in segments:
            lo, hi = opk[k], opk[k + s]
            out.append(
                KeyedJaggedTensor(
                    self._keys[k : k + s],
                    self._values[lo:hi],
                    weights=None if w is None else w[lo:hi],
                    lengths=self._lengths[lopk[k] : lopk[k + s]],
                    offsets=None,
                    stride=self._stride,
                    stride_per_key_per_rank=self._stride_per_key_per_rank[k : k + s] if self._variable_stride else None,
                    stride_per_key=None,
                    length_per_key=lpk[k : k + s],
                    lengths_offset_per_key=None,
                    offset_per_key=None,
                    index_per_key=None,
                    jt_dict=None,
                    inverse_indices=self._inverse_indices,
                )
            )
            k += s
        return out

    def permute(self, indices: list[int], indices_tensor: torch.Tensor | None = None) -> "KeyedJaggedTensor":
        """Reorder (or repeat) keys: the result has keys ``[keys[i] for i in indices]``."""
        indices = list(indices)
        gather, new_lpk, lengths = _utils.permutation(
            indices,
            self.offset_per_key(),
            self.length_per_key(),
            self._lengths,
            self._stride,
            self._stride_per_key,
            self._lengths_offset_per_key,
            self._variable_stride,
        )
        w = self._weights
        spkpr = [self._stride_per_key_per_rank[i] for i in indices] if self._variable_stride else None
        return KeyedJaggedTensor(
            [self._keys[i] for i in indices],
            self._values[gather],
            weights=None if w is None else w[gather],
            lengths=lengths,
            offsets=None,
            stride=self._stride,
            stride_per_key_per_rank=spkpr,
            stride_per_key=None,
            length_per_key=new_lpk,
            lengths_offset_per_key=None,
            offset_per_key=None,
            index_per_key=None,
            jt_dict=None,
            inverse_indices=self._inverse_indices,
        )

    # (inside methods every constructor argument is given: TorchScript compiles methods before it knows the
    # constructor's defaults)
    @torch.jit.unused
    def _apply(self, fn: Callable) -> "KeyedJaggedTensor":  # (no Callable[[...]]: TorchScript reads hints)
        inv = self._inverse_indices
        return KeyedJaggedTensor(
            self._keys,
            fn(self._values),
            weights=None if self._weights is None else fn(self._weights),
            lengths=fn(self._lengths),
            offsets=fn(self._offsets),
            stride=self._stride,
            stride_per_key_per_rank=self._stride_per_key_per_rank if self._variable_stride else None,
            stride_per_key=None,
            length_per_key=self._length_per_key,
            lengths_offset_per_key=None,
            offset_per_key=None,
            index_per_key=None,
            jt_dict=None,
            inverse_indices=None if inv is None else (inv[0], fn(inv[1])),
        )

    def to(
        self, device: torch.device, non_blocking: bool = False, dtype: torch.dtype | None = None
    ) -> "KeyedJaggedTensor":
        if not torch.jit.is_scripting():
            device = torch.device(device)  # a string too
        w, inv = self._weights, self._inverse_indices
        if device == self._values.device and dtype is None:
            return self
        if w is not None:
            w = w.to(device, non_blocking=non_blocking)
            if dtype is not None:
                w = w.to(dtype)
        return KeyedJaggedTensor(
            self._keys,
            self._values.to(device, non_blocking=non_blocking),
            weights=w,
            lengths=self._lengths.to(device, non_blocking=non_blocking),
            offsets=self._offsets.to(device, non_blocking=non_blocking),
            stride=self._stride,
            stride_per_key_per_rank=self._stride_per_key_per_rank if self._variable_stride else None,
            stride_per_key=None,
            length_per_key=self._length_per_key,
            lengths_offset_per_key=None,
            offset_per_key=None,
            index_per_key=None,
            jt_dict=None,
            inverse_indices=None if inv is None else (inv[0], inv[1].to(device, non_blocking=non_blocking)),
        )

    @torch.jit.unused
    def pin_memory(self) -> "KeyedJaggedTensor":
        return self._apply(lambda t: t.pin_memory())

    @torch.jit.unused
    def record_stream(self, stream: torch.cuda.Stream) -> None:
        for t in (self._values, self._lengths, self._offsets, self._weights):
            if t is not None:
                t.record_stream(stream)

    def sync(self) -> "KeyedJaggedTensor":
        self.length_per_key()
        return self

    @torch.jit.unused
    def __str__(self) -> str:
        return _format.keyed_jagged(
            self._keys, self._values, self._weights, self._offsets, self._lengths_offset_per_key
        )

    @torch.jit.unused
    def __repr__(self) -> str:
        return _format.keyed_jagged_repr(self._keys, self._stride_per_key, self._lengths, self._values, self._weights)


# fx.wrap: under torch.fx tracing these are single graph nodes (their arguments are Proxies to iterate over)
@torch.fx.wrap
def _concat(kjt_list: list["KeyedJaggedTensor"]) -> "KeyedJaggedTensor":  # (quoted: TorchScript resolves later)
    return KeyedJaggedTensor._concat(kjt_list)


@torch.fx.wrap
def _empty_like(kjt: "KeyedJaggedTensor") -> "KeyedJaggedTensor":
    return KeyedJaggedTensor._empty_like(kjt)


__all__ = ["KeyedJaggedTensor", "offsets_from_lengths"]
