"""KeyedTensor: pooled embeddings of one batch, key blocks side by side (TorchRec's ``KeyedTensor``)."""

# no ``from __future__ import annotations``: TorchScript cannot parse some string annotations (torch.device)
import torch

from lightning_rec.sparse import _format
from lightning_rec.sparse._regroup import regroup_values
from lightning_rec.sparse._utils import SparseMeta, checks_enabled, cumsum_list


class KeyedTensor(metaclass=SparseMeta):
    """``values()`` holds one block per key along ``key_dim`` (default 1: ``[batch, sum(length_per_key)]``).

    Args (TorchRec's names and order): ``keys``, ``length_per_key`` (block widths), ``values``, ``key_dim``.
    ``torch.jit.script``-able, as TorchRec's: the checks and Python-only helpers run eagerly only.
    """

    def __init__(
        self,
        keys: list[str],
        length_per_key: list[int],
        values: torch.Tensor,
        key_dim: int = 1,
        offset_per_key: list[int] | None = None,
        index_per_key: dict[str, int] | None = None,
    ) -> None:
        if not torch.jit.is_scripting():
            keys, length_per_key = list(keys), list(length_per_key)
            if offset_per_key is not None:
                offset_per_key = list(offset_per_key)
            if checks_enabled():
                _check(keys, length_per_key, values, key_dim)
        self._keys = keys
        self._length_per_key = length_per_key
        self._values = values
        self._key_dim = key_dim
        self._offsets: list[int] = offset_per_key if offset_per_key is not None else cumsum_list(length_per_key)

    @staticmethod
    def from_tensor_list(
        keys: list[str], tensors: list[torch.Tensor], key_dim: int = 1, cat_dim: int = 1
    ) -> "KeyedTensor":
        """Concatenate one tensor per key along ``cat_dim``; block widths read along ``key_dim``."""
        # every argument given: inside the class TorchScript does not know the defaults yet
        return KeyedTensor(
            keys, [t.size(key_dim) for t in tensors], torch.cat(tensors, dim=cat_dim), key_dim, None, None
        )

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
            raise KeyError(_missing_key(key, self._keys))
        return self._block(self._keys.index(key))

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {k: self._block(i) for i, k in enumerate(self._keys)}

    def to(self, device: torch.device, non_blocking: bool = False) -> "KeyedTensor":
        return KeyedTensor(
            self._keys,
            self._length_per_key,
            self._values.to(device, non_blocking=non_blocking),
            self._key_dim,
            self._offsets,
            None,
        )

    @torch.jit.unused
    def record_stream(self, stream: torch.cuda.Stream) -> None:
        self._values.record_stream(stream)

    @staticmethod
    def regroup(keyed_tensors: list["KeyedTensor"], groups: list[list[str]]) -> list[torch.Tensor]:
        """One tensor per group: the named keys' blocks side by side, taken from several KeyedTensors.

        A key found in several KeyedTensors is taken from the last (TorchRec's rule); a key may appear in
        several groups (its gradient sums over them).
        """
        return _regroup(keyed_tensors, groups)

    @staticmethod
    def _regroup(keyed_tensors: list["KeyedTensor"], groups: list[list[str]]) -> list[torch.Tensor]:
        if len(keyed_tensors) == 0:
            raise ValueError("KeyedTensor.regroup needs at least one KeyedTensor")
        key_dim = keyed_tensors[0].key_dim()
        for kt in keyed_tensors:
            if kt.key_dim() != key_dim:
                raise ValueError("KeyedTensor.regroup needs KeyedTensors of one key_dim")
        return regroup_values(
            [kt.values() for kt in keyed_tensors],
            [kt.keys() for kt in keyed_tensors],
            [kt.length_per_key() for kt in keyed_tensors],
            groups,
            key_dim,
        )

    @staticmethod
    def regroup_as_dict(
        keyed_tensors: list["KeyedTensor"], groups: list[list[str]], keys: list[str]
    ) -> dict[str, torch.Tensor]:
        """``regroup`` with the groups named by ``keys``."""
        if len(groups) != len(keys):
            raise ValueError("regroup_as_dict: needs as many keys as groups")
        return _regroup_as_dict(keyed_tensors, groups, keys)

    @torch.jit.unused
    def __str__(self) -> str:
        return _format.keyed(self.to_dict())

    @torch.jit.unused
    def __repr__(self) -> str:
        return f"KeyedTensor(keys={self._keys}, length_per_key={self._length_per_key}, values={self._values})"


# fx.wrap: under torch.fx tracing a regroup is one graph node (its arguments are Proxies to iterate over)
@torch.fx.wrap
def _regroup(keyed_tensors: list["KeyedTensor"], groups: list[list[str]]) -> list[torch.Tensor]:
    return KeyedTensor._regroup(keyed_tensors, groups)


@torch.fx.wrap
def _regroup_as_dict(
    keyed_tensors: list["KeyedTensor"], groups: list[list[str]], keys: list[str]
) -> dict[str, torch.Tensor]:
    tensors = KeyedTensor._regroup(keyed_tensors, groups)
    return {k: tensors[i] for i, k in enumerate(keys)}


def _check(keys: list[str], length_per_key: list[int], values: torch.Tensor, key_dim: int) -> None:
    if len(keys) != len(length_per_key):
        raise ValueError(f"KeyedTensor: {len(keys)} keys but {len(length_per_key)} lengths")
    # TorchRec builds an empty KeyedTensor from a 1-D empty tensor
    if keys and (values.dim() <= key_dim or values.size(key_dim) != sum(length_per_key)):
        raise ValueError(
            f"KeyedTensor: values must have size {sum(length_per_key)} along key_dim={key_dim}, "
            f"got shape {tuple(values.shape)}"
        )


def _missing_key(key: str, keys: list[str]) -> str:
    # no f-string conversions (``!r``): TorchScript compiles this
    return "key '" + key + "' is not in this KeyedTensor (keys: " + ", ".join(keys) + ")"
