"""Lookup kernels: one fbgemm table-batched call, or plain torch ``F.embedding_bag`` / ``F.embedding``.

Every kernel here pools with SUM. MEAN is applied by the caller, once, on the sample's own rank
(DESIGN.md rule 1); that also keeps us clear of fbgemm's wrong MEAN + per-sample-weight backward.

Tables are always separate leaf ``nn.Parameter``s. The fbgemm path needs one flat buffer, so it packs the
parameters into one (making each parameter a view of it) and re-packs whenever a conversion such as
``.to(torch.float16)`` has given the parameters new storage: the parameters are the truth, the flat
buffer is derived from them and can never be left behind holding stale values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import math
import operator
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


def promoted_dtype(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """Pooled outputs of several tables are concatenated, so they share the promoted dtype."""
    dtype = dtypes[0] if dtypes else torch.float32
    for d in dtypes[1:]:
        dtype = torch.promote_types(dtype, d)
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
        return torch.zeros(b, 0, dtype=promoted_dtype([t.dtype for t in tables]), device=values.device)
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


# ---------------------------------------------------------------------------------------------------------
# Fused (in-backward) optimizer kernel
# ---------------------------------------------------------------------------------------------------------

# fbgemm state names per optimizer kind, in the order ``split_optimizer_states()`` returns them
_FUSED_STATE_NAMES: dict[str, tuple[str, ...]] = {
    "sgd": (),
    "adagrad": ("sum",),
    "rowwise_adagrad": ("sum",),
    "adam": ("exp_avg", "exp_avg_sq"),
    "partial_rowwise_adam": ("exp_avg", "exp_avg_sq"),
    "lamb": ("exp_avg", "exp_avg_sq"),
    "partial_rowwise_lamb": ("exp_avg", "exp_avg_sq"),
}


def _as_int(x):
    """``x`` as a Python int when it is an integer of any kind (numpy, 0-d tensor), else unchanged."""
    try:
        return operator.index(x)
    except TypeError:
        return x


class _FusedStepCounter:
    """Backward passes through one kernel since its optimizer's last step."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


_DOUBLE_BACKWARD = (
    "backward ran a second time through the same FusedPooledKernel output (retain_graph=True, or a double "
    "backward). A fused optimizer updates the tables inside backward, so the first backward has already applied "
    "the update and a second one cannot be honoured. Build a new forward for every backward."
)
_ACCUMULATION = (
    "a second backward reached FusedPooledKernel before the optimizer step. A fused optimizer updates the tables "
    "inside backward, so gradient accumulation (e.g. Lightning's accumulate_grad_batches > 1), several "
    "backward passes per step, or several lookups through the same kernel per step cannot be honoured: each "
    "would be applied as a separate update. Use one forward and one backward per step, then call "
    "FusedOptimizer.step() (or kernel.finish_step() when driving the kernel without a FusedOptimizer)."
)


class _FusedBackwardGuard(torch.autograd.Function):
    """Identity on the kernel's output; in backward: refuse a repeated backward, count it, scale the gradient."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, counter: _FusedStepCounter, grad_scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.counter = counter
        ctx.grad_scale = grad_scale
        ctx.used = False
        # detach(): an alias that is not an autograd view, so callers may still modify the output in place
        return out.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if ctx.used:
            raise RuntimeError(_DOUBLE_BACKWARD)
        if ctx.counter.count >= 1:
            raise RuntimeError(_ACCUMULATION)
        ctx.used = True
        ctx.counter.count += 1
        if ctx.grad_scale != 1.0:
            grad = grad * ctx.grad_scale
        return grad, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad * ctx.scale, None


class _FusedTable(torch.nn.Module):
    """Holds one table's ``weight`` (a view of the fused kernel's storage): state_dict keys read ``<table>.weight``."""

    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):  # type: ignore[override]
        # Always copy into the kernel's storage: load_state_dict(assign=True) would swap in a tensor the kernel
        # never sees. Unexpected keys are checked by the kernel (a key of table "a.b" starts with "a.").
        local_metadata = {**local_metadata, "assign_to_params_buffers": False}
        n = len(unexpected_keys)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        del unexpected_keys[n:]


class FusedPooledKernel(torch.nn.Module):
    """SUM-pooled lookup over several tables whose optimizer runs inside backward (fbgemm split TBE).

    One ``SplitTableBatchedEmbeddingBagsCodegen`` (CPU: ``ComputeDevice.CPU`` + ``EmbeddingLocation.HOST``;
    CUDA: ``EmbeddingLocation.DEVICE``) holds every table. Backward through :meth:`forward`'s output applies
    the optimizer update to the tables directly; nothing gets a ``.grad``. MEAN pooling is the caller's job.

    Args:
        tables: ``(name, rows, dim, dtype)`` per table. ``dim`` must be a multiple of 4, ``dtype`` float32 or
            float16 (one dtype for all tables), ``rows >= 1``. Names must be unique.
        feature_table: the table of each feature, in input order. Must be non-decreasing (fbgemm's Adagrad
            kernels are wrong or crash otherwise: FBGEMM_CPU.md pitfall 2), and every table needs a feature.
        optimizer: a :class:`~lightning_rec.optim.FusedOptimizerSpec` (or a dict of its fields).
        device: ``cpu`` (default) or a CUDA device. The kernel cannot be moved or converted afterwards.
        weights: optional initial ``[rows, dim]`` weight per table (copied in). Default: uniform in
            ``+-sqrt(1 / rows)``, TorchRec's default (fbgemm itself starts at zero).

    Tables: :meth:`tables` returns one leaf ``nn.Parameter`` per table, a view of the kernel's storage
    (``requires_grad=False``, so no torch optimizer or DDP touches them). They are registered as
    ``<table name>.weight`` in this module's ``state_dict``, whose values therefore share storage with what
    the kernel updates; ``load_state_dict`` copies into that storage. The fbgemm module's own parameters and
    buffers (weights, momentum: fbgemm registers momentum as a parameter, pitfall 9) are kept out of
    ``parameters()`` and ``state_dict()``; optimizer state goes through :meth:`optimizer_states`.

    Guards: ids outside ``[0, rows)`` (including -1, which passes fbgemm's bounds check, pitfall 14) raise a
    ValueError before the kernel. A second backward through one output, or a second backward through the
    kernel before :meth:`finish_step` (which ``FusedOptimizer.step`` calls), raises a RuntimeError: the first
    backward has already applied its update, so gradient accumulation cannot be honoured.
    """

    def __init__(
        self,
        tables: Sequence[tuple[str, int, int, torch.dtype]],
        feature_table: Sequence[int],
        optimizer,
        device: torch.device | str | None = None,
        weights: Sequence[torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        from lightning_rec.optim import as_spec

        spec = as_spec(optimizer)
        if spec is None:
            raise ValueError("FusedPooledKernel needs a fused optimizer spec, got None")
        dev = torch.device("cpu" if device is None else device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        optim_type = spec.validate(dev)
        names, rows, dims, dtype = self._check_tables(tables)
        feature_table = self._check_feature_table(feature_table, names)

        import fbgemm_gpu.split_table_batched_embeddings_ops_training as tbe_ops

        on_cpu = dev.type == "cpu"
        location = tbe_ops.EmbeddingLocation.HOST if on_cpu else tbe_ops.EmbeddingLocation.DEVICE
        compute = tbe_ops.ComputeDevice.CPU if on_cpu else tbe_ops.ComputeDevice.CUDA
        precision = tbe_ops.SparseType.FP32 if dtype == torch.float32 else tbe_ops.SparseType.FP16
        extra: dict = {}
        if spec.betas is not None:
            extra.update(beta1=spec.betas[0], beta2=spec.betas[1])
        if spec.weight_decay:  # CUDA only: validate() refuses it on CPU
            extra["weight_decay"] = spec.weight_decay
            if spec.kind == "rowwise_adagrad":
                extra["weight_decay_mode"] = tbe_ops.WeightDecayMode.L2
        tbe = tbe_ops.SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(r, d, location, compute) for r, d in zip(rows, dims)],
            feature_table_map=list(feature_table),
            optimizer=optim_type,
            learning_rate=spec.lr,
            eps=spec.eps,
            stochastic_rounding=spec.stochastic_rounding,
            pooling_mode=tbe_ops.PoolingMode.SUM,
            weights_precision=precision,
            output_dtype=precision,
            device=dev,
            # ids are checked before the kernel; FATAL turns anything that slips through into an error on CPU
            bounds_check_mode=tbe_ops.BoundsCheckMode.FATAL if on_cpu else tbe_ops.BoundsCheckMode.WARNING,
            table_names=list(names),
            **extra,
        )
        # Not a registered submodule: its parameters and buffers stay out of parameters() and state_dict().
        object.__setattr__(self, "_tbe", tbe)
        self.spec = spec
        self.optim_type = optim_type
        self.table_names: list[str] = names
        self.rows: list[int] = rows
        self.dims: list[int] = dims
        self.dtype = dtype
        self.device = dev
        self.feature_table: list[int] = feature_table
        self.feature_dims: list[int] = [dims[t] for t in feature_table]
        self.total_dim = sum(self.feature_dims)
        self._rows_per_feature = torch.tensor([rows[t] for t in feature_table], dtype=torch.long, device=dev)
        self._counter = _FusedStepCounter()
        self._lr = float(spec.lr)  # the value last pushed into fbgemm (fbgemm keeps it as float32)
        self._owner: tuple | None = None  # (weakref to FusedOptimizer, group index)

        views = tbe.split_embedding_weights()
        with torch.no_grad():
            if weights is None:
                for v, r in zip(views, rows):
                    bound = math.sqrt(1.0 / r)
                    v.uniform_(-bound, bound)
            else:
                weights = list(weights)
                if len(weights) != len(names):
                    raise ValueError(f"got {len(weights)} initial weights for {len(names)} tables {names}")
                for v, w, name in zip(views, weights, names):
                    if tuple(w.shape) != tuple(v.shape):
                        raise ValueError(
                            f"table {name!r}: initial weight has shape {tuple(w.shape)}, expected {tuple(v.shape)}"
                        )
                    v.copy_(w)
        for name, v in zip(names, views):
            self._modules[name] = _FusedTable(torch.nn.Parameter(v, requires_grad=False))
        self._ptrs = [v.data_ptr() for v in views]

    # -- construction checks ------------------------------------------------------------------------------

    @staticmethod
    def _check_tables(tables) -> tuple[list[str], list[int], list[int], torch.dtype]:
        tables = list(tables)
        if not tables:
            raise ValueError("FusedPooledKernel needs at least one table")
        names, rows, dims, dtypes = [], [], [], []
        for entry in tables:
            if len(entry) != 4:
                raise ValueError(f"a table must be (name, rows, dim, dtype), got {entry!r}")
            name, r, d, dtype = entry
            r, d = _as_int(r), _as_int(d)
            if not isinstance(name, str) or not name:
                raise ValueError(f"table names must be non-empty strings, got {name!r}")
            if name in names:
                raise ValueError(f"table name {name!r} is used twice; table names must be unique")
            if not isinstance(r, int) or r < 1:
                raise ValueError(
                    f"table {name!r}: the fused kernel needs at least one row, got rows={r!r} "
                    "(a table with no rows on this rank must not be given to the kernel)"
                )
            if not isinstance(d, int) or d < 1 or d % 4:
                raise ValueError(
                    f"table {name!r}: embedding dim {d!r} is not supported by the fused fbgemm kernel, which needs "
                    "a positive multiple of 4 (use plain parameters with a torch optimizer for other dims)"
                )
            if dtype == torch.bfloat16:
                raise ValueError(
                    f"table {name!r}: bfloat16 tables are not supported by the fused kernel (fbgemm has no "
                    "bfloat16 CPU kernel for it); use torch.float32 or torch.float16"
                )
            if dtype not in (torch.float32, torch.float16):
                raise ValueError(f"table {name!r}: dtype {dtype} is not supported; use torch.float32 or torch.float16")
            names.append(name)
            rows.append(r)
            dims.append(d)
            dtypes.append(dtype)
        if len(set(dtypes)) > 1:
            detail = ", ".join(f"{n!r}: {d}" for n, d in zip(names, dtypes))
            raise ValueError(f"one fused kernel needs one dtype for all its tables, got {detail}")
        return names, rows, dims, dtypes[0]

    @staticmethod
    def _check_feature_table(feature_table, names: list[str]) -> list[int]:
        ft = [int(t) for t in feature_table]
        if not ft:
            raise ValueError("FusedPooledKernel needs at least one feature")
        for f, t in enumerate(ft):
            if not 0 <= t < len(names):
                raise ValueError(f"feature {f} maps to table index {t}, outside [0, {len(names) - 1}]")
        for f in range(1, len(ft)):
            if ft[f] < ft[f - 1]:
                raise ValueError(
                    f"feature_table must be non-decreasing (features grouped by table, in table order), got {ft}: "
                    f"feature {f} (table {names[ft[f]]!r}) comes after feature {f - 1} (table {names[ft[f - 1]]!r}). "
                    "fbgemm's Adagrad kernels are silently wrong or crash otherwise; sort the features by table "
                    "and permute the output columns afterwards"
                )
        unused = [names[t] for t in range(len(names)) if t not in set(ft)]
        if unused:
            raise ValueError(f"tables {unused} have no feature; fbgemm needs at least one feature per table")
        return ft

    # -- tables -------------------------------------------------------------------------------------------

    def tables(self) -> list[torch.nn.Parameter]:
        """One leaf ``nn.Parameter`` per table (``[rows, dim]``, ``requires_grad=False``), views of the kernel's
        storage: the kernel's updates are visible in them, and writes to them reach the kernel."""
        return [self._modules[name].weight for name in self.table_names]  # type: ignore[union-attr]

    def _check_aliases(self) -> None:
        for name, p, ptr in zip(self.table_names, self.tables(), self._ptrs):
            if p.data_ptr() != ptr or p.dtype != self.dtype or p.device != self.device:
                raise RuntimeError(
                    f"the parameter of table {name!r} no longer shares storage with its FusedPooledKernel (it was "
                    "replaced, moved or converted, e.g. by .to(), .half() or param.data = ...). The fused kernel "
                    "updates its own storage; build the kernel on the target device and dtype instead"
                )

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        self._refuse_conversion(fn)
        return super()._apply(fn, recurse)

    def _refuse_conversion(self, fn) -> None:
        # .to() / .cuda() / .half() would give the table parameters new storage the kernel never sees.
        for name, p in zip(self.table_names, self.tables()):
            q = fn(p)
            if q is not p and (q.data_ptr() != p.data_ptr() or q.dtype != p.dtype or q.device != p.device):
                raise RuntimeError(
                    f"a FusedPooledKernel cannot be moved or converted after construction (table {name!r} would go "
                    f"from {p.dtype} on {p.device} to {q.dtype} on {q.device}); build it on the target device "
                    "with the target dtype"
                )

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):  # type: ignore[override]
        # nn.Module splits keys at the first "." to find the child, so a table named "user.id" would make its
        # own key look unexpected; check against the tables' keys instead.
        super()._load_from_state_dict(state_dict, prefix, local_metadata, False, missing_keys, unexpected_keys, error_msgs)
        if strict:
            own = {f"{prefix}{name}.weight" for name in self.table_names}
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in own)

    def __deepcopy__(self, memo):
        import copy

        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        new._owner = None
        new._counter = _FusedStepCounter()
        # nn.Parameter's deepcopy clones its data: point the copies back into the copied kernel's storage
        views = new._tbe.split_embedding_weights()
        for p, v in zip(new.tables(), views):
            p.data = v
        new._ptrs = [v.data_ptr() for v in views]
        return new

    # -- forward ------------------------------------------------------------------------------------------

    def forward(
        self,
        values: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
        grad_scale: float = 1.0,
    ) -> torch.Tensor:
        """SUM-pooled ``[B, sum of feature dims]`` (columns in feature order) from feature-major inputs.

        ``offsets`` has ``len(feature_table) * B + 1`` entries (bags of feature 0, then feature 1, ...).
        ``grad_scale`` multiplies the gradient that reaches the tables' update (e.g. ``1 / world_size``);
        the gradient of ``per_sample_weights`` is not scaled.
        """
        if values.dim() != 1 or offsets.dim() != 1:
            raise ValueError(f"values and offsets must be 1-D, got shapes {tuple(values.shape)} and {tuple(offsets.shape)}")
        n_features = len(self.feature_table)
        if offsets.numel() < 1 or (offsets.numel() - 1) % n_features:
            raise ValueError(
                f"offsets has {offsets.numel()} entries; expected features * batch + 1 with {n_features} features"
            )
        batch = (offsets.numel() - 1) // n_features
        grad_scale = float(grad_scale)
        if not math.isfinite(grad_scale):
            raise ValueError(f"grad_scale must be finite, got {grad_scale}")
        self._check_aliases()
        values = values.to(device=self.device, dtype=torch.long)
        offsets = offsets.to(device=self.device, dtype=torch.long)
        self._check_inputs(values, offsets, batch)
        psw = per_sample_weights
        if psw is not None:
            if psw.dim() != 1 or psw.numel() != values.numel():
                raise ValueError(
                    f"per_sample_weights must be 1-D with one weight per id ({values.numel()}), got shape {tuple(psw.shape)}"
                )
            psw_in = psw.to(device=self.device, dtype=torch.float32)
            if psw_in.requires_grad and grad_scale != 1.0 and torch.is_grad_enabled():
                if grad_scale == 0.0:
                    raise ValueError(
                        "grad_scale=0 with per_sample_weights that require grad: their gradient cannot be recovered"
                    )
                psw_in = _ScaleGrad.apply(psw_in, 1.0 / grad_scale)  # undo the scaling below for the weights' grad
        else:
            psw_in = None
        lr = self.get_learning_rate()
        if lr != self._lr:  # fbgemm captures the learning rate at forward
            self._push_lr(lr)
        out = self._tbe(values, offsets, per_sample_weights=psw_in)
        if out.requires_grad and torch.is_grad_enabled():
            out = _FusedBackwardGuard.apply(out, self._counter, grad_scale)
        return out

    def _check_inputs(self, values: torch.Tensor, offsets: torch.Tensor, batch: int) -> None:
        n = values.numel()
        if batch == 0:
            if n or int(offsets[0]) != 0:
                raise ValueError(f"batch size 0 but {n} ids (offsets {offsets.tolist()})")
            return
        steps = offsets.diff()
        if int(offsets[0]) != 0 or int(offsets[-1]) != n or bool((steps < 0).any()):
            raise ValueError(
                f"offsets must start at 0, never decrease and end at the number of ids ({n}); got first "
                f"{int(offsets[0])}, last {int(offsets[-1])}"
            )
        if n == 0:
            return
        lens = offsets[::batch].diff()
        upper = torch.repeat_interleave(self._rows_per_feature, lens, output_size=n)
        bad = (values < 0) | (values >= upper)
        if bool(bad.any()):
            pos = int(torch.nonzero(bad)[0])
            f = int(torch.searchsorted(lens.cumsum(0), torch.tensor(pos, device=lens.device), right=True))
            t = self.feature_table[f]
            value = int(values[pos])
            hint = " (-1 is usually padding: filter it out before the lookup)" if value == -1 else ""
            raise ValueError(
                f"feature {f} (table {self.table_names[t]!r}) has id {value}, outside the valid range "
                f"[0, {self.rows[t] - 1}]{hint}"
            )

    # -- optimizer ----------------------------------------------------------------------------------------

    def finish_step(self) -> None:
        """End a training step: allow the next backward. ``FusedOptimizer.step`` calls this."""
        self._counter.count = 0

    def _attach(self, optimizer_ref, index: int) -> None:
        self._owner = (optimizer_ref, index)

    def _owned_by(self, optimizer, index: int) -> bool:
        return self._owner is not None and self._owner[0]() is optimizer and self._owner[1] == index

    def _owner_group(self) -> dict | None:
        if self._owner is None:
            return None
        opt = self._owner[0]()
        if opt is None:
            self._owner = None
            return None
        return opt.param_groups[self._owner[1]]

    def get_learning_rate(self) -> float:
        """The learning rate the next forward will use (the driving FusedOptimizer's group ``lr``, if any)."""
        group = self._owner_group()
        return float(group["lr"]) if group is not None else self._lr

    def set_learning_rate(self, lr: float) -> None:
        """Set the learning rate (and the driving FusedOptimizer's group ``lr``, which owns it)."""
        lr = float(lr)
        if not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"learning rate must be a finite number >= 0, got {lr}")
        group = self._owner_group()
        if group is not None:
            group["lr"] = lr
        self._push_lr(lr)

    def _push_lr(self, lr: float) -> None:
        self._tbe.set_learning_rate(lr)
        self._lr = lr

    @property
    def optimizer_iter(self) -> int | None:
        """Adam-family step counter (for bias correction); None for other kinds."""
        if self.spec.kind not in ("adam", "partial_rowwise_adam", "lamb", "partial_rowwise_lamb"):
            return None
        return int(self._tbe.iter.item())

    @optimizer_iter.setter
    def optimizer_iter(self, step: int) -> None:
        if self.optimizer_iter is None:
            raise ValueError(f"fused optimizer {self.spec.kind!r} has no step counter")
        self._tbe.iter.fill_(int(step))
        self._tbe.iter_cpu.fill_(int(step))

    def optimizer_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{table name: {state name: tensor}}``; the tensors are views of the live state.

        ``"sum"``: ``[rows, dim]`` (adagrad) or ``[rows]`` (rowwise_adagrad); ``"exp_avg"`` / ``"exp_avg_sq"``
        (Adam family); nothing for sgd.
        """
        state_names = _FUSED_STATE_NAMES[self.spec.kind]
        if not state_names:
            return {name: {} for name in self.table_names}
        split = self._tbe.split_optimizer_states()
        return {
            name: {k: s for k, s in zip(state_names, states)} for name, states in zip(self.table_names, split)
        }

    def _check_optimizer_states(self, states: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        missing = [n for n in self.table_names if n not in states]
        unexpected = [n for n in states if n not in self.table_names]
        if missing or unexpected:
            raise ValueError(
                f"fused optimizer state does not match the kernel's tables: missing {missing}, unexpected {unexpected}"
            )
        for name, own in self.optimizer_states().items():
            given = states[name]
            if set(given) != set(own):
                raise ValueError(
                    f"table {name!r}: optimizer state has entries {sorted(given)} but fused optimizer "
                    f"{self.spec.kind!r} keeps {sorted(own)}"
                )
            for key, t in own.items():
                src = given[key]
                if not isinstance(src, torch.Tensor) or tuple(src.shape) != tuple(t.shape):
                    shape = tuple(src.shape) if isinstance(src, torch.Tensor) else type(src).__name__
                    raise ValueError(
                        f"table {name!r}: optimizer state {key!r} has shape {shape} in the checkpoint but "
                        f"{tuple(t.shape)} here"
                    )

    def load_optimizer_states(self, states: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Copy ``{table name: {state name: tensor}}`` into the kernel (all checked before any copy)."""
        self._check_optimizer_states(states)
        with torch.no_grad():
            for name, own in self.optimizer_states().items():
                for key, t in own.items():
                    t.copy_(states[name][key])


class FusedTables(torch.nn.Module):
    """The tables of several fused kernels under one module: ``<table name>.weight`` each, in ``order``.

    A sharded collection holds up to two kernels (its shards; its data-parallel tables) but one
    ``embedding_bags`` attribute, so state_dict keys stay those of the unsharded module. The kernels are not
    submodules (their tables would be registered twice); conversions are refused as each kernel refuses them.
    """

    def __init__(self, fused: Sequence[FusedPooledKernel], order: Sequence[str]) -> None:
        super().__init__()
        object.__setattr__(self, "_kernels", list(fused))
        held = {name: k._modules[name] for k in fused for name in k.table_names}
        for name in [n for n in order if n in held] + [n for n in held if n not in set(order)]:
            self._modules[name] = held[name]

    def __getitem__(self, name: str) -> torch.nn.Module:
        return self._modules[name]  # type: ignore[return-value]

    def __iter__(self):
        return iter(self._modules)

    def __len__(self) -> int:
        return len(self._modules)

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        for k in self._kernels:
            k._refuse_conversion(fn)
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):  # type: ignore[override]
        # table names may contain ".": check unexpected keys against the tables' own keys (as the kernel does)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, False, missing_keys, unexpected_keys, error_msgs)
        if strict:
            own = {f"{prefix}{name}.weight" for name in self._modules}
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in own)
