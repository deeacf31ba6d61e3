"""KeyedTensor: pooled embeddings of one batch, key blocks side by side (TorchRec's ``KeyedTensor``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_rec.sparse import _format
from lightning_rec.sparse._utils import SparseMeta, checks_enabled, cumsum_list


class KeyedTensor(metaclass=SparseMeta):
    """``values()`` holds one block per key along ``key_dim`` (default 1: ``[batch, sum(length_per_key)]``).

    Args (TorchRec's names and order): ``keys``, ``length_per_key`` (block widths), ``values``, ``key_dim``.
    """

    def __init__(
        self,
        keys: Sequence[str],
        length_per_key: Sequence[int],
        values: torch.Tensor,
        key_dim: int = 1,
        offset_per_key: Sequence[int] | None = None,
        index_per_key: dict[str, int] | None = None,
    ) -> None:
        keys, length_per_key = list(keys), list(length_per_key)
        if checks_enabled():
            if len(keys) != len(length_per_key):
                raise ValueError(f"KeyedTensor: {len(keys)} keys but {len(length_per_key)} lengths")
            # TorchRec builds an empty KeyedTensor from a 1-D empty tensor
            if keys and (values.dim() <= key_dim or values.size(key_dim) != sum(length_per_key)):
                raise ValueError(
                    f"KeyedTensor: values must have size {sum(length_per_key)} along key_dim={key_dim}, "
                    f"got shape {tuple(values.shape)}"
                )
        self._keys = keys
        self._length_per_key = length_per_key
        self._values = values
        self._key_dim = key_dim
        self._offsets = list(offset_per_key) if offset_per_key is not None else cumsum_list(length_per_key)

    @staticmethod
    def from_tensor_list(
        keys: list[str], tensors: list[torch.Tensor], key_dim: int = 1, cat_dim: int = 1
    ) -> KeyedTensor:
        """Concatenate one tensor per key along ``cat_dim``; block widths read along ``key_dim``."""
        return KeyedTensor(keys, [t.shape[key_dim] for t in tensors], torch.cat(tensors, dim=cat_dim), key_dim)

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def length_per_key(self) -> list[int]:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        return self._offsets

    def key_dim(self) -> int:
        return self._key_dim

    def device(self) -> torch.device:
        return self._values.device

    def _block(self, i: int) -> torch.Tensor:
        return self._values.narrow(self._key_dim, self._offsets[i], self._length_per_key[i])

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(f"{key!r} is not in this KeyedTensor (keys: {self._keys})")
        return self._block(self._keys.index(key))

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {k: self._block(i) for i, k in enumerate(self._keys)}

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedTensor:
        return KeyedTensor(self._keys, self._length_per_key, self._values.to(device, non_blocking=non_blocking),
                           self._key_dim)

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        self._values.record_stream(stream)

    @staticmethod
    def regroup(keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]) -> list[torch.Tensor]:
        """One tensor per group: the named keys' blocks side by side, taken from several KeyedTensors.

        A key found in several KeyedTensors is taken from the first; a key may appear in several groups.
        """
        return _regroup(keyed_tensors, groups)

    @staticmethod
    def _regroup(keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]) -> list[torch.Tensor]:
        where: dict[str, tuple[int, int]] = {}
        for t, kt in enumerate(keyed_tensors):
            if kt.key_dim() != 1:
                raise ValueError("KeyedTensor.regroup needs key_dim=1 KeyedTensors")
            for i, k in enumerate(kt.keys()):
                where.setdefault(k, (t, i))
        out = []
        for g in groups:
            missing = [k for k in g if k not in where]
            if missing:
                raise KeyError(f"regroup: keys {missing} not found (available: {sorted(where)})")
            out.append(torch.cat([keyed_tensors[where[k][0]]._block(where[k][1]) for k in g], dim=1))
        return out

    @staticmethod
    def regroup_as_dict(
        keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]], keys: Sequence[str]
    ) -> dict[str, torch.Tensor]:
        """``regroup`` with the groups named by ``keys``."""
        if len(groups) != len(keys):
            raise ValueError(f"regroup_as_dict: {len(groups)} groups but {len(keys)} keys")
        return _regroup_as_dict(keyed_tensors, groups, list(keys))

    def __str__(self) -> str:
        return _format.keyed(self.to_dict())

    def __repr__(self) -> str:
        return f"KeyedTensor(keys={self._keys}, length_per_key={self._length_per_key}, values={self._values})"


# fx.wrap: under torch.fx tracing a regroup is one graph node (its arguments are Proxies to iterate over)
@torch.fx.wrap
def _regroup(keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]) -> list[torch.Tensor]:
    return KeyedTensor._regroup(keyed_tensors, groups)


@torch.fx.wrap
def _regroup_as_dict(
    keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]], keys: list[str]
) -> dict[str, torch.Tensor]:
    return dict(zip(keys, KeyedTensor._regroup(keyed_tensors, groups)))
