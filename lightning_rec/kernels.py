"""Lookup kernels: one fbgemm table-batched call, or plain torch ``F.embedding_bag`` / ``F.embedding``.

Every kernel here pools with SUM. MEAN is applied by the caller, once, on the sample's own rank
(DESIGN.md rule 1); that also keeps us clear of fbgemm's wrong MEAN + per-sample-weight backward.

Tables are always separate leaf ``nn.Parameter``s. The fbgemm path needs one flat buffer, so it packs the
parameters into one (making each parameter a view of it) and re-packs whenever a conversion such as
``.to(torch.float16)`` has given the parameters new storage: the parameters are the truth, the flat
buffer is derived from them and can never be left behind holding stale values.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import log2

import warnings

import torch
import torch.nn.functional as F

# fbgemm's dense CPU backward is correct but warns that no autograd kernel is registered for it.
warnings.filterwarnings("ignore", message=r".*an autograd kernel was not registered.*")

KERNELS = ("auto", "fbgemm", "torch")


def validate_kernel(kernel: str) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return kernel


def _fbgemm_unsupported_reason(tables: Sequence[torch.Tensor], sparse_grad: bool) -> str | None:
    """Why the fbgemm dense kernel cannot serve these tables (None if it can)."""
    if not tables:
        return "there are no tables"
    if sparse_grad:
        return "sparse_grad=True needs the torch kernel (fbgemm's autograd kernel returns a dense gradient)"
    dtypes = {t.dtype for t in tables}
    if len(dtypes) > 1:
        return f"tables mix dtypes {sorted(str(d) for d in dtypes)}; one batched kernel needs one dtype"
    dtype = next(iter(dtypes))
    if dtype not in (torch.float32, torch.float16):
        return f"fbgemm has no {dtype} kernel on this build"
    if len({t.device for t in tables}) > 1:
        return "tables live on different devices"
    return None


def resolve_kernel(requested: str, tables: Sequence[torch.Tensor], sparse_grad: bool) -> str:
    """Pick the kernel for plain-parameter training.

    ``auto`` picks fbgemm on CUDA and torch on CPU: measured on the 26-table benchmark
    (benchmarks/bench_kernels.py), torch's embedding_bag is faster on CPU for autograd training
    (fbgemm's CPU forward is slower and its dense backward is no faster), so the default follows the
    measurement.
    """
    reason = _fbgemm_unsupported_reason(tables, sparse_grad)
    if requested == "fbgemm":
        if reason is not None:
            raise ValueError(f"kernel='fbgemm' cannot be used: {reason}. Use kernel='auto' or 'torch'.")
        return "fbgemm"
    if requested == "torch" or reason is not None:
        return "torch"
    return "fbgemm" if tables[0].device.type == "cuda" else "torch"


def validate_ids(
    values: torch.Tensor,
    length_per_feature: Sequence[int],
    rows_per_feature: Sequence[int],
    feature_names: Sequence[str],
    table_of_feature: Sequence[str],
) -> None:
    """Raise a ValueError naming feature, table, value and range for the first out-of-range id."""
    if values.numel() == 0:
        return
    rows = torch.as_tensor(list(rows_per_feature), dtype=torch.long, device=values.device)
    lens = torch.as_tensor(list(length_per_feature), dtype=torch.long, device=values.device)
    upper = torch.repeat_interleave(rows, lens)
    bad = (values < 0) | (values >= upper)
    if not bool(bad.any()):
        return
    pos = int(torch.nonzero(bad)[0])
    f = int(torch.searchsorted(torch.cumsum(lens, 0), torch.tensor(pos, device=values.device), right=True))
    raise ValueError(
        f"feature {feature_names[f]!r} (table {table_of_feature[f]!r}) has id {int(values[pos])}, "
        f"outside the valid range [0, {rows_per_feature[f] - 1}] (num_embeddings={rows_per_feature[f]})"
    )


class _FlatAlias(torch.autograd.Function):
    """Expose a flat buffer whose pieces are the given parameters, routing its gradient to them."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.shapes = [p.shape for p in params]
        return flat.view_as(flat)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        out, start = [], 0
        for shape in ctx.shapes:
            n = shape.numel()
            out.append(grad[start : start + n].view(shape))
            start += n
        return (None, *out)


class FbgemmPooledKernel:
    """One ``fbgemm::dense_embedding_codegen_lookup_function`` call over several tables (SUM pooling).

    Holds the flat buffer and the kernel's metadata; not a Module, so the buffer never shows up in
    ``state_dict`` or ``parameters()``.
    """

    def __init__(self, feature_table: Sequence[int]) -> None:
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

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
                hash_size_cumsum=torch.tensor([hcum[t] for t in self.feature_table] + [hcum[-1]], dtype=torch.long, device=dev),
                total_hash_size_bits=int(log2(float(hcum[-1])) + 1) if hcum[-1] else 0,
            )
        return self._meta

    def __call__(
        self,
        tables: Sequence[torch.Tensor],
        values: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
    ) -> torch.Tensor:
        flat = self._packed(tables)
        meta = self._metadata(tables)
        weights = _FlatAlias.apply(flat, *tables) if torch.is_grad_enabled() else flat
        out = torch.ops.fbgemm.dense_embedding_codegen_lookup_function(
            dev_weights=weights,
            indices=values.long(),
            offsets=offsets.long(),
            pooling_mode=0,  # SUM
            indice_weights=None if per_sample_weights is None else per_sample_weights.float(),
            feature_requires_grad=None,
            **meta,
        )
        return out.to(tables[0].dtype)


def output_dtype(tables: Sequence[torch.Tensor]) -> torch.dtype:
    """Pooled outputs of several tables are concatenated, so they share the promoted dtype."""
    dtype = tables[0].dtype if tables else torch.float32
    for t in tables[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def torch_pooled(
    tables: Sequence[torch.Tensor],
    feature_table: Sequence[int],
    values: torch.Tensor,
    offsets: torch.Tensor,
    batch_size: int,
    per_sample_weights: torch.Tensor | None,
    sparse_grad: bool,
) -> torch.Tensor:
    """SUM-pooled ``[batch_size, sum of feature dims]`` from feature-major ``values`` / ``offsets``."""
    b = batch_size
    if not feature_table:
        return torch.zeros(b, 0, dtype=output_dtype(tables), device=values.device)
    # An empty batch still goes through F.embedding_bag so that the [0, D] output stays in the autograd
    # graph: backward through it must work (and give zero gradients) on a rank that got no samples.
    bounds = offsets[::b].tolist() if b else [0] * (len(feature_table) + 1)
    outs = []
    # One lookup per run of consecutive features that share a table: a table then gets one gradient
    # instead of a sum of several, which torch cannot add when they are sparse fp16 / bf16 on CPU.
    for t, f0, f1 in _table_runs(feature_table):
        w = tables[t]
        lo, hi = bounds[f0], bounds[f1]
        seg_off = offsets[f0 * b : f1 * b + 1] - lo
        psw = None if per_sample_weights is None else per_sample_weights[lo:hi].to(w.dtype)
        out = F.embedding_bag(
            values[lo:hi].long(), w, seg_off.long(), mode="sum", per_sample_weights=psw,
            include_last_offset=True, sparse=sparse_grad,
        )
        if f1 - f0 > 1:  # [features * batch, D] -> [batch, features * D]
            out = out.view(f1 - f0, b, w.shape[1]).transpose(0, 1).reshape(b, (f1 - f0) * w.shape[1])
        outs.append(out)
    return torch.cat(outs, dim=1)


def _table_runs(feature_table: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(table, first feature, end feature)`` for each run of consecutive features on the same table."""
    runs: list[tuple[int, int, int]] = []
    for f, t in enumerate(feature_table):
        if runs and runs[-1][0] == t:
            runs[-1] = (t, runs[-1][1], f + 1)
        else:
            runs.append((t, f, f + 1))
    return runs


def torch_sequence(
    tables: Sequence[torch.Tensor],
    feature_table: Sequence[int],
    values: torch.Tensor,
    length_per_feature: Sequence[int],
    sparse_grad: bool,
) -> list[torch.Tensor]:
    """One ``[ids of feature, dim]`` tensor per feature (one lookup per run of features sharing a table)."""
    outs, start = [], 0
    for t, f0, f1 in _table_runs(feature_table):
        lens = list(length_per_feature[f0:f1])
        n = sum(lens)
        emb = F.embedding(values[start : start + n].long(), tables[t], sparse=sparse_grad)
        outs.extend(torch.split(emb, lens) if f1 - f0 > 1 else [emb])
        start += n
    return outs


def mean_divisor(lengths: torch.Tensor, dims: Sequence[int], is_mean: Sequence[bool], batch_size: int) -> torch.Tensor | None:
    """``[batch, sum dims]`` divisor: the full bag length for MEAN features (at least 1), 1 for SUM ones."""
    if not any(is_mean):
        return None
    n = len(dims)
    lens = lengths.view(n, batch_size).to(torch.float32).clamp_min(1.0)
    mask = torch.tensor(is_mean, device=lengths.device).view(n, 1)
    lens = torch.where(mask, lens, torch.ones_like(lens))
    return torch.repeat_interleave(lens.t(), torch.tensor(list(dims), device=lengths.device), dim=1)
