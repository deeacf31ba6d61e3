"""fbgemm's dense table-batched lookup (``compute_kernel="fbgemm"``) over plain ``nn.Parameter`` tables.

Tables are always separate leaf ``nn.Parameter``s. The fbgemm kernel needs one flat buffer, so it packs the
parameters into one (making each parameter a view of it) and re-packs whenever a conversion such as
``.to(torch.float16)`` has given the parameters new storage: the parameters are the truth, the flat
buffer is derived from them and can never be left behind holding stale values. Pools with SUM only (MEAN
is applied by the caller, which also keeps clear of fbgemm's wrong MEAN + per-sample-weight backward).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from math import log2
from typing import Any

import torch

from lightning_rec.kernels._capability import load_fbgemm

# fbgemm registers its dense lookup op under the device key with an autograd function inside, so torch warns in
# every backward through it that no autograd kernel is registered ("may lead to silently incorrect behavior").
# The gradients are right (../FBGEMM_CPU.md, section 2). On CPU we call the forward and backward ops ourselves
# (_CpuLookup) and nothing warns; only the CUDA path still goes through the op, so only its warning is hidden.
warnings.filterwarnings(
    "ignore", message=r"fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel was not registered"
)


class _FlatAlias(torch.autograd.Function):
    """Expose a flat buffer whose pieces are the given parameters, routing its gradient to them."""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.shapes = [p.shape for p in params]
        return flat.view_as(flat)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        out, start = [], 0
        for shape in ctx.shapes:
            n = shape.numel()
            out.append(grad[start : start + n].view(shape))
            start += n
        return (None, *out)


class _CpuLookup(torch.autograd.Function):
    """fbgemm's dense CPU lookup (SUM) over a flat buffer whose pieces are ``params``; gradients reach ``params``
    and the per-sample weights. The kernels are the ones fbgemm's own op runs, so results are bitwise its."""

    @staticmethod
    def forward(
        ctx: Any,
        meta: dict,
        flat: torch.Tensor,
        values: torch.Tensor,
        offsets: torch.Tensor,  # type: ignore[override]
        psw: torch.Tensor | None,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        ctx.meta, ctx.shapes = meta, [p.shape for p in params]
        ctx.save_for_backward(flat, values, offsets, psw)
        # as fbgemm's op: half / byte tables pool into fp32, others in their own dtype (-1)
        out_dtype = 0 if flat.dtype in (torch.float16, torch.uint8) else -1
        return torch.ops.fbgemm.split_embedding_codegen_forward_cpu(
            flat,
            meta["weights_offsets"],
            meta["D_offsets"],
            meta["total_D"],
            meta["hash_size_cumsum"],
            values,
            offsets,
            0,
            psw,
            out_dtype,
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        flat, values, offsets, psw = ctx.saved_tensors
        meta, grad = ctx.meta, grad.contiguous()
        grad_psw = None
        if ctx.needs_input_grad[4]:
            grad_psw = torch.ops.fbgemm.split_embedding_codegen_grad_indice_weights_cpu(
                grad, flat, meta["weights_offsets"], meta["D_offsets"], values, offsets, None
            )
        grads: list[torch.Tensor | None] = [None] * len(ctx.shapes)
        if any(ctx.needs_input_grad[5:]):
            g = torch.ops.fbgemm.split_embedding_backward_codegen_dense_cpu(
                grad,
                flat,
                meta["weights_offsets"],
                meta["D_offsets"],
                meta["max_D"],
                meta["hash_size_cumsum"],
                meta["total_hash_size_bits"],
                values,
                offsets,
                0,
                psw,
                0.0,
            )
            start = 0
            for i, shape in enumerate(ctx.shapes):
                grads[i] = g[start : start + shape.numel()].view(shape)
                start += shape.numel()
        return (None, None, None, None, grad_psw, *grads)


class FbgemmPooledKernel:
    """One ``fbgemm::dense_embedding_codegen_lookup_function`` call over several tables (SUM pooling).

    Holds the flat buffer and the kernel's metadata; not a Module, so the buffer never shows up in
    ``state_dict`` or ``parameters()``.
    """

    def __init__(self, feature_table: Sequence[int]) -> None:
        load_fbgemm()  # registers torch.ops.fbgemm
        self.feature_table = list(feature_table)
        self._flat: torch.Tensor | None = None
        self._meta: dict | None = None

    def _packed(self, tables: Sequence[torch.Tensor]) -> torch.Tensor:
        flat = self._flat
        if flat is not None and flat.dtype == tables[0].dtype and flat.device == tables[0].device:
            ptr, step = flat.data_ptr(), flat.element_size()
            start, ok = 0, True
            for t in tables:
                if t.data_ptr() != ptr + start * step or not t.is_contiguous():
                    ok = False
                    break
                start += t.numel()
            if ok and start == flat.numel():
                return flat
        with torch.no_grad():
            flat = torch.cat([t.detach().reshape(-1) for t in tables])
            start = 0
            for t in tables:
                n = t.numel()
                t.data = flat[start : start + n].view(t.shape)
                start += n
        self._flat = flat
        self._meta = None
        return flat

    def _metadata(self, tables: Sequence[torch.Tensor]) -> dict:
        if self._meta is None:
            dev = tables[0].device
            rows = [t.shape[0] for t in tables]
            dims = [t.shape[1] for t in tables]
            fdims = [dims[t] for t in self.feature_table]
            d_off = [0]
            for d in fdims:
                d_off.append(d_off[-1] + d)
            hcum = [0]
            for r in rows:
                hcum.append(hcum[-1] + r)
            w_off = [0]
            for r, d in zip(rows, dims):
                w_off.append(w_off[-1] + r * d)
            self._meta = dict(
                weights_offsets=torch.tensor([w_off[t] for t in self.feature_table], dtype=torch.long, device=dev),
                D_offsets=torch.tensor(d_off, dtype=torch.int32, device=dev),
                total_D=d_off[-1],
                max_D=max(dims),
                hash_size_cumsum=torch.tensor(
                    [hcum[t] for t in self.feature_table] + [hcum[-1]], dtype=torch.long, device=dev
                ),
                total_hash_size_bits=int(log2(float(hcum[-1])) + 1) if hcum[-1] else 0,
            )
        return self._meta

    def __call__(
        self,
        tables: Sequence[torch.Tensor],
        values: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        storage: Sequence[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """SUM-pooled ``[batch, sum of feature widths]``; gradients reach ``tables``.

        ``storage``: the leaf parameters whose storage the flat buffer replaces, when ``tables`` are views
        of them made for autograd (a sharded collection's gradient hooks); default ``tables`` themselves.
        """
        flat = self._packed(tables if storage is None else storage)
        meta = self._metadata(tables)
        psw = None if per_sample_weights is None else per_sample_weights.float()
        if flat.device.type == "cpu":
            out = _CpuLookup.apply(meta, flat, values.long(), offsets.long(), psw, *tables)
            return out.to(tables[0].dtype)
        weights = _FlatAlias.apply(flat, *tables) if torch.is_grad_enabled() else flat
        out = torch.ops.fbgemm.dense_embedding_codegen_lookup_function(
            dev_weights=weights,
            indices=values.long(),
            offsets=offsets.long(),
            pooling_mode=0,  # SUM
            indice_weights=psw,
            feature_requires_grad=None,
            **meta,
        )
        return out.to(tables[0].dtype)
