"""Sparse input and output types with TorchRec's names: JaggedTensor, KeyedJaggedTensor, KeyedTensor.

All three are ``torch.fx`` proxyable (building one from traced tensors records a node) and skip their
data-dependent checks under ``torch.compile``, so models holding them trace and compile without graph breaks.
"""

import torch

from lightning_rec._compat import TreeSpec, register_pytree_flatten_spec, register_pytree_node
from lightning_rec.sparse._kjt_extras import ComputeJTDictToKJT, ComputeKJTToJTDict, kjt_is_equal
from lightning_rec.sparse._regroup import kt_regroup_arguments
from lightning_rec.sparse._utils import SparseInputError, checks_enabled, offsets_from_lengths, segment_gather_index
from lightning_rec.sparse.jagged_tensor import JaggedTensor, jt_is_equal
from lightning_rec.sparse.keyed_jagged_tensor import KeyedJaggedTensor
from lightning_rec.sparse.keyed_tensor import KeyedTensor

__all__ = [
    "ComputeJTDictToKJT",
    "ComputeKJTToJTDict",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "SparseInputError",
    "checks_enabled",
    "jt_is_equal",
    "kjt_is_equal",
    "kt_regroup_arguments",
    "offsets_from_lengths",
    "segment_gather_index",
]


# pytree nodes, so torch.export / torch.compile see the tensors inside (TorchRec registers the same types)
def _flatten_jt(jt: JaggedTensor) -> tuple[list, None]:
    return [jt.values(), jt.weights_or_none(), jt.lengths(), jt.offsets()], None


def _unflatten_jt(children: list, _ctx: None) -> JaggedTensor:
    return JaggedTensor(children[0], weights=children[1], lengths=children[2], offsets=children[3])


def _flatten_kjt(kjt: KeyedJaggedTensor) -> tuple[list, tuple]:
    inv = kjt.inverse_indices_or_none()
    spkpr = kjt.stride_per_key_per_rank() if kjt.variable_stride_per_key() else None
    ctx = (kjt.keys(), kjt.stride(), spkpr, None if inv is None else inv[0])
    return [kjt.values(), kjt.weights_or_none(), kjt.lengths(), kjt.offsets(), None if inv is None else inv[1]], ctx


def _unflatten_kjt(children: list, ctx: tuple) -> KeyedJaggedTensor:
    keys, stride, spkpr, inv_keys = ctx
    inv = children[4] if len(children) > 4 else None
    return KeyedJaggedTensor(
        keys,
        children[0],
        weights=children[1],
        lengths=children[2],
        offsets=children[3],
        stride=stride,
        stride_per_key_per_rank=spkpr,
        inverse_indices=None if inv is None or inv_keys is None else (inv_keys, inv),
    )


def _flatten_kt(kt: KeyedTensor) -> tuple[list, tuple]:
    return [kt.values()], (kt.keys(), kt.length_per_key(), kt.key_dim())


def _unflatten_kt(children: list, ctx: tuple) -> KeyedTensor:
    return KeyedTensor(ctx[0], ctx[1], children[0], ctx[2])


register_pytree_node(JaggedTensor, _flatten_jt, _unflatten_jt)
register_pytree_node(KeyedJaggedTensor, _flatten_kjt, _unflatten_kjt)
register_pytree_node(KeyedTensor, _flatten_kt, _unflatten_kt)


def _flatten_spec_kt(kt: KeyedTensor, spec: TreeSpec) -> list[torch.Tensor]:
    # an exported program's input spec names the keys in its order: a KeyedTensor with the same keys in
    # another order is regrouped into that order (TorchRec registers the same)
    keys = spec.context[0]
    if kt.keys() == keys:
        return [kt.values()]
    d = kt.to_dict()
    return [torch.cat([d[k] for k in keys], dim=kt.key_dim())]


register_pytree_flatten_spec(KeyedTensor, _flatten_spec_kt)
