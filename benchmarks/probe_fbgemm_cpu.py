"""Re-measure the fbgemm-gpu-cpu capability matrix (``FBGEMM_CPU.md``) on CPU against plain-torch references.

Covers the rows of sections 1-4 of that file that are wrong, silently wrong, ignored or FAIL for fbgemm-gpu-cpu
1.8.0, plus the ok rows they are measured against (the three fused optimizers, weighted SUM, non-decreasing
``feature_table_map``, ...). Every probe builds a tiny case (a few rows, a few bags, duplicate ids), runs it
through fbgemm and through a reference written here in plain torch (``nn.EmbeddingBag`` / ``torch.optim`` where
torch has the same thing, explicit formulas otherwise), and prints one line:

    <row name> | ok (max err E) / WRONG (max err of each part that differs) / FAIL (<first line of the error>)

"ok" means every compared tensor is within 1e-5 (fp32) or 1e-2 (fp16/bf16 values) of the reference. Rows whose
1.8.0 behaviour is an error (FATAL bounds check, unsupported optimizer, ...) print FAIL when the error is still
raised. Every probe runs in a forked child process (one crash or hang does not stop the others) with one
thread and fixed seeds, so the output is deterministic. The whole run takes well under a minute on 2 cores.

Usage:
    python benchmarks/probe_fbgemm_cpu.py                 # all probes
    python benchmarks/probe_fbgemm_cpu.py --only VBE      # probes whose row name contains "VBE"
    python benchmarks/probe_fbgemm_cpu.py --no-fork       # run in this process (a crash stops the run)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import multiprocessing
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from fbgemm_gpu.permute_pooled_embedding_modules import PermutePooledEmbeddings
from fbgemm_gpu.split_embedding_configs import FP8QuantizationConfig
from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    BoundsCheckMode,
    ComputeDevice,
    DenseTableBatchedEmbeddingBagsCodegen,
    EmbeddingLocation,
    OptimType,
    PoolingMode,
    SparseType,
    SplitTableBatchedEmbeddingBagsCodegen,
    WeightDecayMode,
)
from fbgemm_gpu.tbe.utils.quantize import quantize_embs

FBGEMM = torch.ops.fbgemm
TOL = 1e-5  # fp32 results
TOL_HALF = 1e-2  # fp16 / bf16 results (values and grads up to ~4)
LR = 0.1
EPS = 1e-8
MODES = {"sum": PoolingMode.SUM, "mean": PoolingMode.MEAN, "none": PoolingMode.NONE}

Bags = list[list[torch.Tensor]]  # bags[feature][bag] = 1-D int64 ids

PROBES: list[tuple[str, Callable[[], str]]] = []


def probe(name: str) -> Callable[[Callable[[], str]], Callable[[], str]]:
    def register(fn: Callable[[], str]) -> Callable[[], str]:
        PROBES.append((name, fn))
        return fn

    return register


# ---------------------------------------------------------------------------------------------------------------
# comparison helpers


def compare(tol: float = TOL, note: str = "", **parts: tuple[torch.Tensor | None, torch.Tensor | None]) -> str:
    """'ok (max err E)' if every (got, want) pair matches within tol, else 'WRONG (...)' naming each bad part."""
    bad, worst = [], 0.0
    for name, (got, want) in parts.items():
        if got is None:
            bad.append(f"{name}: None")
            continue
        assert want is not None, f"reference of {name} is None"
        got, want = got.detach().float(), want.detach().float()
        if got.shape != want.shape:
            bad.append(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
            continue
        err = (got - want).abs().max().item() if got.numel() else 0.0
        if not err <= tol:  # also catches nan
            bad.append(f"{name} {err:.1e}")
        worst = max(worst, err) if err == err else worst
    suffix = f"; {note}" if note else ""
    if bad:
        return "WRONG (max err " + ", ".join(bad) + suffix + ")"
    return f"ok (max err {worst:.0e}{suffix})"


def flat(ts: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """All tensors as one flat fp32 vector; None if any of them is None (a gradient that never arrived)."""
    if any(t is None for t in ts):
        return None
    return torch.cat([t.detach().float().reshape(-1) for t in ts if t is not None]) if ts else torch.zeros(0)


def same(a: torch.Tensor | None, b: torch.Tensor | None, tol: float = TOL) -> bool:
    if a is None or b is None or a.shape != b.shape:
        return False
    return a.numel() == 0 or bool((a - b).abs().max() <= tol)


def is_ok(result: str) -> bool:
    return result.startswith("ok")


def combine(**results: str) -> str:
    """One line from several sub-results: ok if all are ok, else WRONG/FAIL listing the sub-results that are not."""
    bad = {k: v for k, v in results.items() if not is_ok(v)}
    if not bad:
        errs = [v[v.find("err ") + 4 : v.find(")")].split(";")[0] for v in results.values() if "err " in v]
        worst = max((float(e) for e in errs if _is_float(e)), default=0.0)
        return f"ok (max err {worst:.0e})"
    word = "FAIL" if all(v.startswith("FAIL") for v in bad.values()) else "WRONG"
    inner = {k: v[len("WRONG (") : -1] if v.startswith("WRONG (") else v for k, v in bad.items()}
    return f"{word} (" + "; ".join(f"{k}: {v}" for k, v in inner.items()) + ")"


def _is_float(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def error_line(e: BaseException) -> str:
    text = str(e).strip()
    first = text.splitlines()[0].strip() if text else ""
    if len(first) > 160:
        first = first[:157] + "..."
    return f"FAIL ({type(e).__name__}: {first})"


def attempt(fn: Callable[[], str]) -> str:
    try:
        return fn()
    except Exception as e:  # a probe's result, not a bug of the probe: report it and carry on
        return error_line(e)


# ---------------------------------------------------------------------------------------------------------------
# inputs and the plain-torch reference of a table-batched lookup


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_tables(g: torch.Generator, shapes: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    return [torch.rand(r, d, generator=g) - 0.5 for r, d in shapes]


def make_bags(
    g: torch.Generator, rows: Sequence[int], batch: Sequence[int], max_len: int = 4, min_len: int = 0
) -> Bags:
    """Random bags, feature-major; small tables make duplicate ids within and across bags common."""
    bags: Bags = []
    for r, b in zip(rows, batch):
        lens = torch.randint(min_len, max_len + 1, (b,), generator=g)
        bags.append([torch.randint(0, r, (int(n),), generator=g) for n in lens])
    return bags


def flatten_bags(bags: Bags, dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [x for fb in bags for x in fb]
    indices = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64)
    lengths = torch.tensor([len(x) for x in ids], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return indices.to(dtype), offsets.to(dtype)


def n_ids(bags: Bags) -> int:
    return sum(len(x) for fb in bags for x in fb)


def ref_lookup(
    tables: Sequence[torch.Tensor],
    ftm: Sequence[int],
    bags: Bags,
    mode: str,
    psw: torch.Tensor | None = None,
    vbe: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """What a table-batched lookup should return: pooled [B, sum D_f], NONE [N, D], or VBE 1-D rank-major."""
    per_feature: list[list[torch.Tensor]] = []
    pos = 0
    for f, fb in enumerate(bags):
        w = tables[ftm[f]]
        items = []
        for ids in fb:
            rows = w[ids]
            if psw is not None:
                rows = rows * psw[pos : pos + len(ids), None]
            pos += len(ids)
            if mode == "none":
                items.append(rows)
            else:
                s = rows.sum(0)
                items.append(s / len(ids) if mode == "mean" and len(ids) else s)
        per_feature.append(items)
    if mode == "none":
        return torch.cat([r for items in per_feature for r in items])
    if vbe is None:
        return torch.stack([torch.cat([items[b] for items in per_feature]) for b in range(len(bags[0]))])
    parts = []
    for r in range(len(vbe[0])):
        for f, items in enumerate(per_feature):
            start = sum(vbe[f][:r])
            parts.extend(items[start : start + vbe[f][r]])
    return torch.cat(parts)


class Step:
    """One training step's input: bags, optional per-sample weights, and the upstream gradient."""

    def __init__(self, bags: Bags, psw: torch.Tensor | None, grad: torch.Tensor) -> None:
        self.bags, self.psw, self.grad = bags, psw, grad


def make_steps(
    g: torch.Generator,
    tables: Sequence[torch.Tensor],
    ftm: Sequence[int],
    n: int,
    mode: str,
    batch: int = 4,
    weighted: bool = False,
    vbe: Sequence[Sequence[int]] | None = None,
    max_len: int = 4,
    min_len: int = 0,
) -> list[Step]:
    rows = [tables[t].shape[0] for t in ftm]
    batches = [sum(b) for b in vbe] if vbe is not None else [batch] * len(ftm)
    steps = []
    for _ in range(n):
        bags = make_bags(g, rows, batches, max_len, min_len)
        psw = torch.rand(n_ids(bags), generator=g) + 0.5 if weighted else None
        with torch.no_grad():
            shape = ref_lookup(tables, ftm, bags, mode, psw, vbe).shape
        steps.append(Step(bags, psw, torch.randn(shape, generator=g)))
    return steps


def touched_rows(ftm: Sequence[int], bags: Bags, table: int, rows: int) -> torch.Tensor:
    mask = torch.zeros(rows, dtype=torch.bool)
    for f, fb in enumerate(bags):
        if ftm[f] == table:
            for ids in fb:
                mask[ids] = True
    return mask


def feature_runs(ftm: Sequence[int], table: int) -> list[list[int]]:
    """The features of a table, grouped into runs of consecutive features (ftm [0,1,0]: table 0 -> [[0], [2]])."""
    runs: list[list[int]] = []
    for f, t in enumerate(ftm):
        if t != table:
            continue
        if runs and runs[-1][-1] == f - 1:
            runs[-1].append(f)
        else:
            runs.append([f])
    return runs


def ref_train(
    init: Sequence[torch.Tensor],
    ftm: Sequence[int],
    steps: Sequence[Step],
    mode: str,
    opt: str,
    lr: float = LR,
    eps: float = EPS,
    vbe: Sequence[Sequence[int]] | None = None,
    weight_decay: float = 0.0,
    wd_mode: str = "none",
    round_to: torch.dtype | None = None,
    step_per_run: bool = False,
) -> dict[str, list[torch.Tensor]]:
    """Exact training reference: the gradient of each table is summed over all its features and duplicate ids,
    then one optimizer step per table (opt: sgd | adagrad | rowwise); only rows seen in the step are updated.
    step_per_run=True models a known bug instead: one optimizer step per run of consecutive features."""
    weights = [w.clone() for w in init]
    state = [torch.zeros_like(w) if opt == "adagrad" else torch.zeros(w.shape[0]) for w in init]
    outs, psw_grads = [], []
    for st in steps:
        leaves = [weights[t].clone().requires_grad_() for t in ftm]  # one leaf per feature: grads kept apart
        psw = st.psw.clone().requires_grad_() if st.psw is not None else None
        out = ref_lookup(leaves, range(len(ftm)), st.bags, mode, psw, vbe)
        out.backward(st.grad)
        outs.append(out.detach())
        if psw is not None:
            psw_grads.append(psw.grad)
        for t, w in enumerate(weights):
            runs = feature_runs(ftm, t)
            groups = runs if step_per_run else [[f for run in runs for f in run]]
            for feats in groups:
                if not feats:
                    continue
                g = sum(leaves[f].grad for f in feats)
                seen = touched_rows([0 if f in feats else -1 for f in range(len(ftm))], st.bags, 0, w.shape[0])
                optimizer_step(opt, w, g, state[t], seen, lr, eps, weight_decay, wd_mode)
            if round_to is not None:
                w.copy_(w.to(round_to).float())
    return {"weights": weights, "state": state, "outs": outs, "psw_grads": psw_grads}


def optimizer_step(
    opt: str,
    w: torch.Tensor,
    g: torch.Tensor,
    state: torch.Tensor,
    seen: torch.Tensor,
    lr: float,
    eps: float,
    weight_decay: float,
    wd_mode: str,
) -> None:
    """One in-place step on a table (rows not seen have g == 0 and are left alone).
    opt: sgd | adagrad | rowwise (EXACT_ROWWISE_ADAGRAD, with L2 / decoupled weight decay) | rmsprop."""
    if opt == "sgd":
        w -= lr * g
    elif opt == "adagrad":
        state += g * g
        w -= lr * g / (state.sqrt() + eps)
    elif opt == "rowwise":
        gd = g + weight_decay * w * seen[:, None] if wd_mode == "l2" else g
        state += (gd * gd).mean(1) * seen
        mult = (lr / (state.sqrt() + eps))[:, None]
        if wd_mode == "decouple":
            w -= (lr * weight_decay * w * seen[:, None]) + mult * g
        else:
            w -= mult * gd
    elif opt == "rmsprop":  # ROWWISE_RMSPROP_AR with its defaults (ar_alpha=0): rowwise RMSprop, no bias correction
        state.copy_(torch.where(seen, 0.99 * state + 0.01 * (g * g).mean(1), state))
        w -= (lr / (state.sqrt() + eps))[:, None] * g
    else:
        raise ValueError(opt)


def make_tbe(
    init: Sequence[torch.Tensor],
    ftm: Sequence[int] | None = None,
    opt: OptimType = OptimType.EXACT_SGD,
    mode: str = "sum",
    lr: float = LR,
    eps: float = EPS,
    copy_weights: bool = True,
    **kwargs: object,
) -> SplitTableBatchedEmbeddingBagsCodegen:
    specs = [(w.shape[0], w.shape[1], EmbeddingLocation.HOST, ComputeDevice.CPU) for w in init]
    m = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=specs,
        feature_table_map=list(ftm) if ftm is not None else None,
        optimizer=opt,
        learning_rate=lr,
        eps=eps,
        pooling_mode=MODES[mode],
        **kwargs,
    )
    if copy_weights:
        with torch.no_grad():
            for view, w in zip(m.split_embedding_weights(), init):
                view.copy_(w)
    return m


def tbe_train(
    m: torch.nn.Module,
    steps: Sequence[Step],
    vbe: Sequence[Sequence[int]] | None = None,
    idx_dtype: torch.dtype = torch.int64,
    feature_requires_grad: torch.Tensor | None = None,
) -> dict[str, list[torch.Tensor]]:
    outs: list[torch.Tensor] = []
    psw_grads: list[torch.Tensor | None] = []
    for st in steps:
        indices, offsets = flatten_bags(st.bags, idx_dtype)
        psw = st.psw.clone().requires_grad_() if st.psw is not None else None
        kwargs: dict[str, object] = {}
        if vbe is not None:
            kwargs["batch_size_per_feature_per_rank"] = [list(b) for b in vbe]
        if feature_requires_grad is not None:
            kwargs["feature_requires_grad"] = feature_requires_grad
        out = m(indices, offsets, per_sample_weights=psw, **kwargs)
        grad = st.grad.to(out.dtype) if out.shape == st.grad.shape else torch.zeros_like(out)
        out.backward(grad)
        outs.append(out.detach().float())
        if psw is not None:
            psw_grads.append(psw.grad)
    weights = [w.detach().clone().float() for w in m.split_embedding_weights()]
    return {"outs": outs, "psw_grads": psw_grads, "weights": weights}


def tbe_states(m: SplitTableBatchedEmbeddingBagsCodegen) -> list[torch.Tensor]:
    return [s[0].detach().clone().float() for s in m.split_optimizer_states() if s]


def train_vs_ref(
    shapes: Sequence[tuple[int, int]],
    ftm: Sequence[int] | None,
    opt: OptimType,
    ref_opt: str,
    mode: str,
    n_steps: int = 3,
    weighted: bool = False,
    vbe: Sequence[Sequence[int]] | None = None,
    check_state: bool = True,
    seed: int = 0,
    **kwargs: object,
) -> str:
    g = gen(seed)
    init = make_tables(g, shapes)
    fmap = list(ftm) if ftm is not None else list(range(len(shapes)))
    m = make_tbe(init, ftm, opt, mode, **kwargs)
    steps = make_steps(g, init, fmap, n_steps, mode, weighted=weighted, vbe=vbe)
    want = ref_train(init, fmap, steps, mode, ref_opt, vbe=vbe)
    got = tbe_train(m, steps, vbe=vbe)
    parts = {"fwd": (flat(got["outs"]), flat(want["outs"])), "weights": (flat(got["weights"]), flat(want["weights"]))}
    if weighted:
        parts["psw.grad"] = (flat(got["psw_grads"]), flat(want["psw_grads"]))
    if check_state and ref_opt != "sgd":
        parts["state"] = (flat(tbe_states(m)), flat(want["state"]))
    return compare(**parts)


# ---------------------------------------------------------------------------------------------------------------
# section 1: SplitTableBatchedEmbeddingBagsCodegen (fused optimizer)


def vs_torch_optim(opt: OptimType, mode: str) -> str:
    """Against nn.EmbeddingBag(sparse=True) + torch.optim.SGD / Adagrad, 5 steps, 2 tables of different D."""
    g = gen(1)
    init = make_tables(g, [(10, 4), (7, 8)])
    steps = make_steps(g, init, [0, 1], 5, mode)
    params = [torch.nn.Parameter(w.clone()) for w in init]
    if opt == OptimType.EXACT_SGD:
        torch_opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=LR)
    else:
        torch_opt = torch.optim.Adagrad(params, lr=LR, eps=EPS)
    want_outs = []
    for st in steps:
        cols = []
        for f, fb in enumerate(st.bags):
            idx, off = flatten_bags([fb])
            cols.append(F.embedding_bag(idx, params[f], off[:-1], mode=mode, sparse=True))
        out = torch.cat(cols, 1)
        out.backward(st.grad)
        want_outs.append(out.detach())
        torch_opt.step()
        torch_opt.zero_grad()
    m = make_tbe(init, None, opt, mode)
    got = tbe_train(m, steps)
    parts = {"fwd": (flat(got["outs"]), flat(want_outs)), "weights": (flat(got["weights"]), flat(params))}
    if opt == OptimType.EXACT_ADAGRAD:
        parts["state sum"] = (flat(tbe_states(m)), flat([torch_opt.state[p]["sum"] for p in params]))
    return compare(**parts)


for _mode in ("sum", "mean"):
    probe(f"1 EXACT_SGD vs nn.EmbeddingBag(sparse)+optim.SGD, 5 steps, {_mode.upper()}")(
        lambda mode=_mode: vs_torch_optim(OptimType.EXACT_SGD, mode)
    )
    probe(f"1 EXACT_ADAGRAD vs optim.Adagrad(eps=1e-8), 5 steps, {_mode.upper()} (weights + state sum)")(
        lambda mode=_mode: vs_torch_optim(OptimType.EXACT_ADAGRAD, mode)
    )


@probe("1 EXACT_ROWWISE_ADAGRAD vs m+=mean(g^2); w-=lr*g/(sqrt(m)+eps), 5 steps, SUM+MEAN (weights + state)")
def _() -> str:
    return combine(
        **{
            mode: train_vs_ref([(10, 4), (7, 8)], None, OptimType.EXACT_ROWWISE_ADAGRAD, "rowwise", mode, n_steps=5)
            for mode in ("sum", "mean")
        }
    )


def constructs_and_updates(opt: OptimType, **kwargs: object) -> str:
    g = gen(2)
    init = make_tables(g, [(10, 4)])
    steps = make_steps(g, init, [0], 1, "sum")
    m = make_tbe(init, None, opt, "sum", **kwargs)
    got = tbe_train(m, steps)
    moved = (flat(got["weights"]) - flat(init)).abs().max().item()
    if moved == 0:
        return "WRONG (constructs, but the weights do not change)"
    return f"ok (constructs and updates, max change {moved:.1e}; values not checked against a reference)"


probe("1 EMAINPLACE_ROWWISE_ADAGRAD constructs and updates")(
    lambda: constructs_and_updates(OptimType.EMAINPLACE_ROWWISE_ADAGRAD)
)


@probe("1 ROWWISE_RMSPROP_AR (OptimType added in 1.9), defaults, vs m=0.99m+0.01*mean(g^2); w-=lr*g/(sqrt(m)+eps)")
def _() -> str:
    opt = getattr(OptimType, "ROWWISE_RMSPROP_AR", None)
    if opt is None:
        return "n/a (no such OptimType in this version)"
    return combine(
        **{mode: train_vs_ref([(10, 4), (7, 8)], None, opt, "rmsprop", mode, n_steps=5) for mode in ("sum", "mean")}
    )


_UNSUPPORTED = [
    "ADAM",
    "PARTIAL_ROWWISE_ADAM",
    "LAMB",
    "PARTIAL_ROWWISE_LAMB",
    "LARS_SGD",
    "ENSEMBLE_ROWWISE_ADAGRAD",
    "MADGRAD",
    "SHAMPOO",
    "SHAMPOO_V2",
    "EXACT_ROWWISE_WEIGHTED_ADAGRAD",
    "SGD",
    "ROWWISE_ADAGRAD",
    "NONE",
]
for _name in _UNSUPPORTED:
    probe(f"1 optimizer {_name} on CPU (construct + 1 step)")(
        lambda name=_name: constructs_and_updates(getattr(OptimType, name))
    )


for _loc in ("DEVICE", "MANAGED", "MANAGED_CACHING"):

    @probe(f"1 ComputeDevice.CPU with EmbeddingLocation.{_loc}")
    def _(loc: str = _loc) -> str:
        specs = [(10, 4, getattr(EmbeddingLocation, loc), ComputeDevice.CPU)]
        SplitTableBatchedEmbeddingBagsCodegen(embedding_specs=specs, optimizer=OptimType.EXACT_SGD)
        return "ok (constructs)"


@probe("1 PoolingMode.NONE unweighted, 3 optimizers (fwd + update)")
def _() -> str:
    opts = {"sgd": OptimType.EXACT_SGD, "adagrad": OptimType.EXACT_ADAGRAD, "rowwise": OptimType.EXACT_ROWWISE_ADAGRAD}
    return combine(**{k: train_vs_ref([(10, 4), (7, 4)], None, o, k, "none") for k, o in opts.items()})


@probe("1 mixed dims across tables, SUM/MEAN x 3 optimizers")
def _() -> str:
    opts = {"sgd": OptimType.EXACT_SGD, "adagrad": OptimType.EXACT_ADAGRAD, "rowwise": OptimType.EXACT_ROWWISE_ADAGRAD}
    return combine(
        **{
            f"{k} {mode}": train_vs_ref([(10, 4), (7, 12)], None, o, k, mode)
            for k, o in opts.items()
            for mode in ("sum", "mean")
        }
    )


@probe("1 per_sample_weights + SUM (fwd, update, psw grad; feature_requires_grad=[0,1] masks feature 0)")
def _() -> str:
    main = train_vs_ref([(10, 4), (7, 8)], None, OptimType.EXACT_SGD, "sgd", "sum", weighted=True)
    g = gen(3)
    init = make_tables(g, [(10, 4), (7, 8)])
    steps = make_steps(g, init, [0, 1], 1, "sum", weighted=True)
    want = ref_train(init, [0, 1], steps, "sum", "sgd")["psw_grads"][0].clone()
    want[: sum(len(x) for x in steps[0].bags[0])] = 0
    got = tbe_train(make_tbe(init, None, OptimType.EXACT_SGD, "sum"), steps, feature_requires_grad=torch.tensor([0, 1]))
    masked = compare(**{"psw.grad": (got["psw_grads"][0], want)})
    return combine(**{"update+grads": main, "feature_requires_grad": masked})


def weighted_split(mode: str, part: str) -> str:
    """MEAN / NONE with per-sample weights; the note says which known-wrong result fbgemm's output equals:
    for MEAN the grads without the 1/L factor (= the SUM grads), for NONE the unweighted result."""
    g = gen(4)
    init = make_tables(g, [(10, 4), (7, 4)])
    steps = make_steps(g, init, [0, 1], 1, mode, weighted=True, min_len=1)
    want = ref_train(init, [0, 1], steps, mode, "sgd")
    if mode == "mean":
        alt, alt_name = ref_train(init, [0, 1], steps, "sum", "sgd"), "the grads without the 1/L factor"
    else:
        unweighted = [Step(st.bags, None, st.grad) for st in steps]
        alt, alt_name = ref_train(init, [0, 1], unweighted, mode, "sgd"), "the unweighted result"
    got = tbe_train(make_tbe(init, None, OptimType.EXACT_SGD, mode), steps)
    if part == "fwd":
        note = f"equals {alt_name}" if same(flat(got["outs"]), flat(alt["outs"])) else ""
        return compare(note=note, fwd=(flat(got["outs"]), flat(want["outs"])))
    matches = []
    if same(flat(got["weights"]), flat(alt["weights"])):
        matches.append("table update")
    if mode == "mean" and same(flat(got["psw_grads"]), flat(alt["psw_grads"])):
        matches.append("psw.grad")
    return compare(
        note=f"{' and '.join(matches)} {'equal' if len(matches) > 1 else 'equals'} {alt_name}" if matches else "",
        **{
            "table update": (flat(got["weights"]), flat(want["weights"])),
            "psw.grad": (flat(got["psw_grads"]), flat(want["psw_grads"])),
        },
    )


probe("1 per_sample_weights + MEAN forward")(lambda: weighted_split("mean", "fwd"))
probe("1 per_sample_weights + MEAN backward (table update, psw grad)")(lambda: weighted_split("mean", "bwd"))
probe("1 per_sample_weights + NONE forward")(lambda: weighted_split("none", "fwd"))
probe("1 per_sample_weights + NONE backward (table update, psw grad)")(lambda: weighted_split("none", "bwd"))


@probe("1 weights_precision FP16 (fwd + update, stochastic_rounding=False)")
def _() -> str:
    g = gen(5)
    init = [w.half().float() for w in make_tables(g, [(10, 4), (7, 8)])]
    steps = make_steps(g, init, [0, 1], 3, "sum")
    want = ref_train(init, [0, 1], steps, "sum", "sgd", round_to=torch.float16)
    m = make_tbe(init, None, OptimType.EXACT_SGD, "sum", weights_precision=SparseType.FP16, stochastic_rounding=False)
    got = tbe_train(m, steps)
    return compare(
        TOL_HALF,
        fwd=(flat(got["outs"]), flat(want["outs"])),
        weights=(flat(got["weights"]), flat(want["weights"])),
    )


def low_precision_train(wp: SparseType | None, out_dtype: SparseType | None) -> str:
    """Fwd + 1 SGD step with bf16 weights or a bf16 output, against the fp32 reference (bf16 tolerance)."""
    g = gen(6)
    init = [w.bfloat16().float() for w in make_tables(g, [(10, 4), (7, 8)])]
    steps = make_steps(g, init, [0, 1], 1, "sum")
    want = ref_train(init, [0, 1], steps, "sum", "sgd")
    kwargs: dict[str, object] = {}
    if wp is not None:
        kwargs.update(weights_precision=wp, stochastic_rounding=False)
    if out_dtype is not None:
        kwargs["output_dtype"] = out_dtype
    got = tbe_train(make_tbe(init, None, OptimType.EXACT_SGD, "sum", **kwargs), steps)
    return compare(
        1e-2,
        fwd=(flat(got["outs"]), flat(want["outs"])),
        weights=(flat(got["weights"]), flat(want["weights"])),
    )


probe("1 weights_precision BF16 (fwd + update)")(lambda: low_precision_train(SparseType.BF16, None))


def int8_rowwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, D] fp32 -> ([rows, D + 8] uint8 row: D codes, fp32 scale, fp32 bias; the dequantized fp32 rows)."""
    lo, hi = w.min(1).values, w.max(1).values
    scale = (hi - lo) / 255.0
    q = ((w - lo[:, None]) / scale[:, None]).round().clamp(0, 255).to(torch.uint8)
    tail = torch.stack([scale, lo], 1).contiguous().view(torch.uint8)
    return torch.cat([q, tail], 1), q.float() * scale[:, None] + lo[:, None]


def int8_tbe(
    mode: str,
) -> tuple[SplitTableBatchedEmbeddingBagsCodegen, list[torch.Tensor], list[torch.Tensor], list[Step]]:
    """An INT8-weight TBE holding our own rowwise quantization; also returns the dequantized rows and the codes."""
    g = gen(7)
    init = make_tables(g, [(10, 8), (7, 8)])
    m = make_tbe(init, None, OptimType.EXACT_SGD, mode, copy_weights=False, weights_precision=SparseType.INT8)
    deq = []
    with torch.no_grad():
        for view, w in zip(m.split_embedding_weights(), init):
            q, d = int8_rowwise(w)
            view.copy_(q)
            deq.append(d)
    return m, deq, make_steps(g, deq, [0, 1], 1, mode)


def int8_forward(mode: str) -> str:
    m, deq, steps = int8_tbe(mode)
    indices, offsets = flatten_bags(steps[0].bags)
    with torch.no_grad():
        out = m(indices, offsets)
    o = out.detach().float()
    raw = mode == "none" and bool((o == o.round()).all() and (o >= 0).all() and (o <= 255).all())
    want = ref_lookup(deq, [0, 1], steps[0].bags, mode)
    return compare(1e-4, note="returns raw bytes (integers 0..255) as floats" if raw else "", fwd=(out, want))


probe("1 weights_precision INT8 pooled (SUM) forward")(lambda: int8_forward("sum"))
probe("1 weights_precision INT8 PoolingMode.NONE forward")(lambda: int8_forward("none"))


@probe("1 weights_precision INT8 backward (EXACT_SGD)")
def _() -> str:
    m, _, steps = int8_tbe("sum")
    got = tbe_train(m, steps)
    return "ok (backward runs; update not checked)" if got["outs"] else "WRONG"


def weights_precision_runs(wp: SparseType) -> str:
    g = gen(8)
    init = make_tables(g, [(10, 8)])
    m = make_tbe(init, None, OptimType.EXACT_SGD, "sum", copy_weights=False, weights_precision=wp)
    m.init_embedding_weights_uniform(-0.1, 0.1)
    steps = make_steps(g, init, [0], 1, "sum")
    tbe_train(m, steps)
    return "ok (fwd + bwd run; values not checked)"


for _wp in ("INT4", "FP8", "NFP8"):
    probe(f"1 weights_precision {_wp} (construct, init, fwd, bwd)")(
        lambda wp=_wp: weights_precision_runs(getattr(SparseType, wp))
    )


@probe("1 output_dtype FP16 (fwd + bwd)")
def _() -> str:
    g = gen(9)
    init = make_tables(g, [(10, 4), (7, 8)])
    steps = make_steps(g, init, [0, 1], 2, "sum")
    want = ref_train(init, [0, 1], steps, "sum", "sgd")
    got = tbe_train(make_tbe(init, None, OptimType.EXACT_SGD, "sum", output_dtype=SparseType.FP16), steps)
    return compare(
        TOL_HALF,
        fwd=(flat(got["outs"]), flat(want["outs"])),
        weights=(flat(got["weights"]), flat(want["weights"])),
    )


probe("1 output_dtype BF16 (fwd + bwd)")(lambda: low_precision_train(None, SparseType.BF16))


@probe("1 output_dtype INT8")
def _() -> str:
    g = gen(10)
    init = make_tables(g, [(10, 8)])
    steps = make_steps(g, init, [0], 1, "sum")
    m = make_tbe(init, None, OptimType.EXACT_SGD, "sum", output_dtype=SparseType.INT8)
    indices, offsets = flatten_bags(steps[0].bags)
    out = m(indices, offsets)
    return compare(fwd=(out, ref_lookup(init, [0], steps[0].bags, "sum")))


@probe("1 mixed embedding dims + PoolingMode.NONE")
def _() -> str:
    g = gen(17)
    init = make_tables(g, [(10, 4), (7, 8)])
    m = make_tbe(init, None, OptimType.EXACT_SGD, "none")
    indices, offsets = flatten_bags(make_bags(g, [10, 7], [3, 3], min_len=1))
    out = m(indices, offsets)
    return f"WRONG? (constructs and runs, output shape {tuple(out.shape)}; no reference for mixed-D NONE)"


for _d in (2, 3, 6):
    probe(f"1 embedding_dim {_d} (not a multiple of 4), EXACT_SGD SUM")(
        lambda d=_d: train_vs_ref([(10, d)], None, OptimType.EXACT_SGD, "sgd", "sum")
    )

_OPTS = {"sgd": OptimType.EXACT_SGD, "adagrad": OptimType.EXACT_ADAGRAD, "rowwise": OptimType.EXACT_ROWWISE_ADAGRAD}


@probe("1 feature_table_map non-decreasing [0,0,1] and [0,1,1], 3 optimizers x SUM/MEAN/NONE")
def _() -> str:
    return combine(
        **{
            f"{ftm} {k} {mode}": train_vs_ref([(8, 4), (6, 4)], ftm, o, k, mode)
            for ftm in ([0, 0, 1], [0, 1, 1])
            for k, o in _OPTS.items()
            for mode in ("sum", "mean", "none")
        }
    )


@probe("1 feature_table_map unsorted [0,1,0] EXACT_SGD SUM/MEAN")
def _() -> str:
    return combine(
        **{
            mode: train_vs_ref([(6, 4), (5, 4)], [0, 1, 0], OptimType.EXACT_SGD, "sgd", mode)
            for mode in ("sum", "mean")
        }
    )


def unsorted_case(ftm: Sequence[int], opt: OptimType, ref_opt: str, mode: str = "sum") -> str:
    """train_vs_ref; when wrong, also says whether fbgemm did one optimizer step per run of consecutive features."""
    result = train_vs_ref([(6, 4), (5, 4)], ftm, opt, ref_opt, mode)
    if not result.startswith("WRONG"):
        return result
    g = gen(0)
    init = make_tables(g, [(6, 4), (5, 4)])
    m = make_tbe(init, ftm, opt, mode)
    steps = make_steps(g, init, ftm, 3, mode)
    per_run = ref_train(init, ftm, steps, mode, ref_opt, step_per_run=True)
    got = tbe_train(m, steps)
    if same(flat(got["weights"]), flat(per_run["weights"])) and same(flat(tbe_states(m)), flat(per_run["state"])):
        return result[:-1] + "; equals one optimizer step per run of consecutive features)"
    return result


for _ftm in ([0, 1, 0], [1, 0]):
    for _opt, _ref in ((OptimType.EXACT_ADAGRAD, "adagrad"), (OptimType.EXACT_ROWWISE_ADAGRAD, "rowwise")):
        probe(
            f"1 feature_table_map unsorted {str(_ftm).replace(' ', '')} {_opt.name} {'SUM/MEAN' if _ftm == [0, 1, 0] else 'SUM'}"
        )(
            lambda ftm=_ftm, opt=_opt, ref=_ref: combine(
                **{
                    mode: unsorted_case(ftm, opt, ref, mode)
                    for mode in (("sum", "mean") if len(ftm) == 3 else ("sum",))
                }
            )
        )
probe("1 feature_table_map unsorted [0,1,0] PoolingMode.NONE (EXACT_SGD)")(
    lambda: train_vs_ref([(6, 4), (5, 4)], [0, 1, 0], OptimType.EXACT_SGD, "sgd", "none")
)


def vbe_cases(opt: OptimType, ref_opt: str) -> str:
    cases = {
        "SUM 2 ranks": ([(10, 4), (7, 4)], "sum", False, [[2, 3], [1, 2]]),
        "MEAN 2 ranks": ([(10, 4), (7, 4)], "mean", False, [[2, 3], [1, 2]]),
        "weighted SUM": ([(10, 4), (7, 4)], "sum", True, [[2, 3], [1, 2]]),
        "mixed D": ([(10, 4), (7, 8)], "sum", False, [[2, 1], [3, 2]]),
        "1 rank": ([(10, 4), (7, 8)], "sum", False, [[3], [2]]),
    }
    return combine(
        **{
            name: attempt(lambda s=s, md=md, w=w, v=v: train_vs_ref(s, None, opt, ref_opt, md, weighted=w, vbe=v))
            for name, (s, md, w, v) in cases.items()
        }
    )


probe("1 VBE EXACT_SGD (SUM, MEAN, weighted SUM, mixed D, 1 and 2 ranks)")(
    lambda: vbe_cases(OptimType.EXACT_SGD, "sgd")
)
probe("1 VBE EXACT_ROWWISE_ADAGRAD (SUM, MEAN, weighted SUM, mixed D, 1 and 2 ranks)")(
    lambda: vbe_cases(OptimType.EXACT_ROWWISE_ADAGRAD, "rowwise")
)
probe("1 VBE EXACT_ADAGRAD SUM")(
    lambda: train_vs_ref([(10, 4), (7, 4)], None, OptimType.EXACT_ADAGRAD, "adagrad", "sum", vbe=[[2, 3], [1, 2]])
)


@probe("1 VBE PoolingMode.NONE (EXACT_SGD)")
def _() -> str:
    g = gen(11)
    init = make_tables(g, [(10, 4), (7, 4)])
    vbe = [[2, 3], [1, 2]]
    steps = make_steps(g, init, [0, 1], 1, "none", vbe=vbe)
    want = ref_train(init, [0, 1], steps, "none", "sgd", vbe=vbe)
    got = tbe_train(make_tbe(init, None, OptimType.EXACT_SGD, "none"), steps, vbe=vbe)
    return compare(fwd=(flat(got["outs"]), flat(want["outs"])), weights=(flat(got["weights"]), flat(want["weights"])))


def weight_decay_case(wd_mode: str) -> str:
    g = gen(12)
    init = make_tables(g, [(10, 4), (7, 8)])
    steps = make_steps(g, init, [0, 1], 3, "sum")
    mode = WeightDecayMode.L2 if wd_mode == "l2" else WeightDecayMode.DECOUPLE
    want = ref_train(init, [0, 1], steps, "sum", "rowwise", weight_decay=0.5, wd_mode=wd_mode)
    plain = ref_train(init, [0, 1], steps, "sum", "rowwise")
    m = make_tbe(init, None, OptimType.EXACT_ROWWISE_ADAGRAD, "sum", weight_decay=0.5, weight_decay_mode=mode)
    got = tbe_train(m, steps)
    same_as_plain = (flat(got["weights"]) - flat(plain["weights"])).abs().max().item() <= TOL
    return compare(
        note="the update equals the one without decay" if same_as_plain else "",
        weights=(flat(got["weights"]), flat(want["weights"])),
        state=(flat(tbe_states(m)), flat(want["state"])),
    )


probe("1 weight_decay=0.5 WeightDecayMode.L2, EXACT_ROWWISE_ADAGRAD")(lambda: weight_decay_case("l2"))
probe("1 weight_decay=0.5 WeightDecayMode.DECOUPLE, EXACT_ROWWISE_ADAGRAD")(lambda: weight_decay_case("decouple"))


@probe("1 int32 indices and offsets (EXACT_ROWWISE_ADAGRAD SUM)")
def _() -> str:
    g = gen(13)
    init = make_tables(g, [(10, 4), (7, 8)])
    steps = make_steps(g, init, [0, 1], 3, "sum")
    want = ref_train(init, [0, 1], steps, "sum", "rowwise")
    got = tbe_train(make_tbe(init, None, OptimType.EXACT_ROWWISE_ADAGRAD, "sum"), steps, idx_dtype=torch.int32)
    return compare(fwd=(flat(got["outs"]), flat(want["outs"])), weights=(flat(got["weights"]), flat(want["weights"])))


@probe("1 duplicate ids (3-row table, bags of 6-10 ids), 3 optimizers")
def _() -> str:
    results = {}
    for k, o in _OPTS.items():
        g = gen(14)
        init = make_tables(g, [(3, 4)])
        steps = make_steps(g, init, [0], 3, "sum", max_len=10, min_len=6)
        want = ref_train(init, [0], steps, "sum", k)
        got = tbe_train(make_tbe(init, None, o, "sum"), steps)
        results[k] = compare(weights=(flat(got["weights"]), flat(want["weights"])))
    return combine(**results)


def bounds_forward(mode: BoundsCheckMode) -> str:
    """Id 12 in a 10-row table: WARNING / IGNORE should look it up as row 0."""
    g = gen(15)
    init = make_tables(g, [(10, 4)])
    bags = [[torch.tensor([1, 12]), torch.tensor([3]), torch.tensor([12, 12, 5])]]
    fixed = [[torch.where(b >= 10, 0, b) for b in bags[0]]]
    m = make_tbe(init, None, OptimType.EXACT_SGD, "sum", bounds_check_mode=mode)
    indices, offsets = flatten_bags(bags)
    with torch.no_grad():
        out = m(indices, offsets)
    return compare(fwd=(out, ref_lookup(init, [0], fixed, "sum")))


for _bm in ("WARNING", "IGNORE", "FATAL", "NONE"):
    probe(f"1 BoundsCheckMode.{_bm}, out-of-range id in TBE forward (expect: looked up as row 0)")(
        lambda bm=_bm: bounds_forward(getattr(BoundsCheckMode, bm))
    )


@probe("1 bounds_check_indices WARNING: bad last offset clamped, warning counted")
def _() -> str:
    indices = torch.tensor([1, 2, 3, 4, 5])
    offsets = torch.tensor([0, 2, 5, 9])
    warning = torch.zeros(1, dtype=torch.int64)
    FBGEMM.bounds_check_indices(torch.tensor([10, 10, 10]), indices, offsets, 1, warning)
    return compare(
        offsets=(offsets, torch.tensor([0, 2, 5, 5])), warning_positive=((warning > 0).float(), torch.ones(1))
    )


@probe("1 id -1 through bounds_check_indices FATAL/WARNING/IGNORE (expect: caught or set to 0)")
def _() -> str:
    passed = []
    for name, code in (("FATAL", 0), ("WARNING", 1), ("IGNORE", 2)):
        indices = torch.tensor([1, -1, 3])
        offsets = torch.tensor([0, 2, 3])
        try:
            FBGEMM.bounds_check_indices(
                torch.tensor([10, 10]), indices, offsets, code, torch.zeros(1, dtype=torch.int64)
            )
        except Exception:
            continue
        if indices[1].item() == -1:
            passed.append(name)
    return f"WRONG (-1 left in place by {', '.join(passed)})" if passed else "ok (-1 caught or replaced in all modes)"


@probe("1 id -1 in TBE training step (BoundsCheckMode.WARNING)")
def _() -> str:
    g = gen(16)
    init = make_tables(g, [(10, 4)])
    bags = [[torch.tensor([1, -1]), torch.tensor([3])]]
    m = make_tbe(init, None, OptimType.EXACT_SGD, "sum")
    indices, offsets = flatten_bags(bags)
    out = m(indices, offsets)
    out.backward(torch.ones_like(out))
    fixed = [[torch.tensor([1, 0]), torch.tensor([3])]]
    return compare(note="-1 treated as row 0", fwd=(out, ref_lookup(init, [0], fixed, "sum")))


# ---------------------------------------------------------------------------------------------------------------
# section 2: DenseTableBatchedEmbeddingBagsCodegen (autograd)


def make_dense(
    init: Sequence[torch.Tensor], ftm: Sequence[int] | None = None, mode: str = "sum", **kwargs: object
) -> DenseTableBatchedEmbeddingBagsCodegen:
    m = DenseTableBatchedEmbeddingBagsCodegen(
        [(w.shape[0], w.shape[1]) for w in init],
        feature_table_map=list(ftm) if ftm is not None else None,
        pooling_mode=MODES[mode],
        use_cpu=True,
        **kwargs,
    )
    with torch.no_grad():
        for view, w in zip(m.split_embedding_weights(), init):
            view.copy_(w)
    return m


def dense_case(
    shapes: Sequence[tuple[int, int]],
    ftm: Sequence[int] | None = None,
    mode: str = "sum",
    weighted: bool = False,
    vbe: Sequence[Sequence[int]] | None = None,
    idx_dtype: torch.dtype = torch.int64,
    tol: float = TOL,
    **kwargs: object,
) -> str:
    """One fwd + bwd: output, the flat weight grad and the psw grad against autograd through the reference."""
    g = gen(20)
    init = make_tables(g, shapes)
    if kwargs.get("weights_precision") == SparseType.FP16:
        init = [w.half().float() for w in init]
    fmap = list(ftm) if ftm is not None else list(range(len(shapes)))
    st = make_steps(g, init, fmap, 1, mode, weighted=weighted, vbe=vbe)[0]
    leaves = [w.clone().requires_grad_() for w in init]
    psw_ref = st.psw.clone().requires_grad_() if st.psw is not None else None
    want = ref_lookup(leaves, fmap, st.bags, mode, psw_ref, vbe)
    want.backward(st.grad)
    m = make_dense(init, ftm, mode, **kwargs)
    indices, offsets = flatten_bags(st.bags, idx_dtype)
    psw = st.psw.clone().requires_grad_() if st.psw is not None else None
    fwd_kwargs: dict[str, object] = {}
    if vbe is not None:
        fwd_kwargs["batch_size_per_feature_per_rank"] = [list(b) for b in vbe]
    out = m(indices, offsets, per_sample_weights=psw, **fwd_kwargs)
    parts: dict[str, tuple[torch.Tensor | None, torch.Tensor]] = {"fwd": (out, want.detach())}
    note = ""
    if out.shape == want.shape:
        out.backward(st.grad.to(out.dtype))
        parts["weights.grad"] = (m.weights.grad, flat([leaf.grad for leaf in leaves]))
        if psw is not None and psw_ref is not None:
            parts["psw.grad"] = (psw.grad, psw_ref.grad)
    elif mode == "none":
        with torch.no_grad():
            summed = ref_lookup(init, fmap, st.bags, "sum")
        if out.shape == summed.shape and (out.detach().float() - summed).abs().max() <= tol:
            note = "returns the SUM-pooled [B, total_D]"
    return compare(tol, note=note, **parts)


@probe("2 Dense SUM/MEAN fwd + grad vs reference; optim.SGD 5 steps vs nn.EmbeddingBag")
def _() -> str:
    results = {mode: dense_case([(10, 4), (7, 8)], mode=mode) for mode in ("sum", "mean")}
    g = gen(21)
    init = make_tables(g, [(10, 4), (7, 8)])
    steps = make_steps(g, init, [0, 1], 5, "sum")
    m = make_dense(init)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    bags = [torch.nn.EmbeddingBag.from_pretrained(w.clone(), freeze=False, mode="sum") for w in init]
    ref_opt = torch.optim.SGD([b.weight for b in bags], lr=LR)
    got_out, want_out = [], []
    for st in steps:
        indices, offsets = flatten_bags(st.bags)
        out = m(indices, offsets)
        out.backward(st.grad)
        opt.step()
        opt.zero_grad()
        got_out.append(out.detach())
        cols = []
        for f, fb in enumerate(st.bags):
            idx, off = flatten_bags([fb])
            cols.append(bags[f](idx, off[:-1]))
        ref = torch.cat(cols, 1)
        ref.backward(st.grad)
        ref_opt.step()
        ref_opt.zero_grad()
        want_out.append(ref.detach())
    results["SGD 5 steps"] = compare(
        fwd=(flat(got_out), flat(want_out)),
        weights=(flat(m.split_embedding_weights()), flat([b.weight for b in bags])),
    )
    return combine(**results)


@probe("2 Dense backward: spurious 'autograd kernel was not registered' UserWarning")
def _() -> str:
    g = gen(22)
    init = make_tables(g, [(10, 4)])
    st = make_steps(g, init, [0], 1, "sum")[0]
    m = make_dense(init)
    indices, offsets = flatten_bags(st.bags)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m(indices, offsets).backward(st.grad)
    hits = [w for w in caught if "autograd kernel was not registered" in str(w.message)]
    return "ok (warning still emitted)" if hits else "ok (no warning any more)"


probe("2 Dense any D (3 and 5)")(lambda: dense_case([(10, 3), (7, 5)]))
probe("2 Dense unsorted feature_table_map [0,1,0]")(lambda: dense_case([(6, 4), (5, 4)], ftm=[0, 1, 0]))
probe("2 Dense FP16 weights")(lambda: dense_case([(10, 4), (7, 8)], tol=TOL_HALF, weights_precision=SparseType.FP16))
probe("2 Dense int32 indices/offsets")(lambda: dense_case([(10, 4), (7, 8)], idx_dtype=torch.int32))
probe("2 Dense weighted SUM (fwd, weight grad, psw grad)")(lambda: dense_case([(10, 4), (7, 8)], weighted=True))
probe("2 Dense weighted MEAN (fwd, weight grad, psw grad)")(
    lambda: dense_case([(10, 4), (7, 8)], mode="mean", weighted=True)
)
probe("2 Dense PoolingMode.NONE")(lambda: dense_case([(10, 4), (7, 4)], mode="none"))
probe("2 Dense VBE batch_size_per_feature_per_rank")(lambda: dense_case([(10, 4), (7, 4)], vbe=[[2, 3], [1, 2]]))
probe("2 Dense BF16 weights")(lambda: dense_case([(10, 4), (7, 8)], tol=1e-2, weights_precision=SparseType.BF16))


def dense_output_dtype(out_dtype: SparseType, torch_dtype: torch.dtype) -> str:
    g = gen(23)
    init = make_tables(g, [(10, 4)])
    st = make_steps(g, init, [0], 1, "sum")[0]
    m = make_dense(init, output_dtype=out_dtype)
    indices, offsets = flatten_bags(st.bags)
    out = m(indices, offsets)
    if out.dtype != torch_dtype:
        return f"WRONG (output dtype {out.dtype}, asked for {torch_dtype})"
    return compare(1e-2, fwd=(out, ref_lookup(init, [0], st.bags, "sum")))


probe("2 Dense output_dtype FP16")(lambda: dense_output_dtype(SparseType.FP16, torch.float16))
probe("2 Dense output_dtype BF16")(lambda: dense_output_dtype(SparseType.BF16, torch.bfloat16))


# ---------------------------------------------------------------------------------------------------------------
# section 3: IntNBitTableBatchedEmbeddingBagsCodegen (inference)


def hfp8_decode(q: torch.Tensor, ebits: int = 4, bias: int = 7) -> torch.Tensor:
    """Decode fbgemm's HFP8 bytes (sign, ebits exponent, rest mantissa; subnormals, no inf/nan) to fp32."""
    q = q.to(torch.int32)
    mbits = 7 - ebits
    sign = torch.where(q & 0x80 != 0, -1.0, 1.0)
    e = (q >> mbits) & ((1 << ebits) - 1)
    mant = (q & ((1 << mbits) - 1)).float() / (1 << mbits)
    normal = torch.pow(2.0, (e - bias).float()) * (1 + mant)
    subnormal = 2.0 ** (1 - bias) * mant
    return sign * torch.where(e == 0, subnormal, normal)


def dequantize(q: torch.Tensor, scale_shift: torch.Tensor | None, ty: SparseType, dim: int) -> torch.Tensor:
    """Plain-torch decode of quantize_embs' output (codes + fp16 scale/bias per row)."""
    if ty == SparseType.FP32:
        return q.contiguous().view(torch.float32)[:, :dim]
    if ty == SparseType.FP16:
        return q.contiguous().view(torch.float16).float()[:, :dim]
    if ty == SparseType.FP8:
        return hfp8_decode(q)[:, :dim]
    assert scale_shift is not None
    ss = scale_shift.contiguous().view(torch.float16).float()
    bits = {SparseType.INT8: 8, SparseType.INT4: 4, SparseType.INT2: 2}[ty]
    per_byte = 8 // bits
    q32 = q.to(torch.int32)
    codes = torch.stack([(q32 >> (bits * k)) & ((1 << bits) - 1) for k in range(per_byte)], 2).reshape(q.shape[0], -1)
    return codes[:, :dim].float() * ss[:, :1] + ss[:, 1:2]


def intnbit_case(
    types: Sequence[SparseType],
    mode: str = "sum",
    weighted: bool = False,
    out_dtype: SparseType = SparseType.FP32,
    dim: int = 8,
) -> str:
    g = gen(30)
    src = [torch.randn(12, dim, generator=g) for _ in types]
    fp8 = FP8QuantizationConfig(4, 7)
    qs = [quantize_embs(w, ty, fp8 if ty == SparseType.FP8 else None) for w, ty in zip(src, types)]
    deq = [dequantize(q, ss, ty, dim) for (q, ss), ty in zip(qs, types)]
    kwargs: dict[str, object] = {}
    if SparseType.FP8 in types:
        kwargs.update(fp8_exponent_bits=4, fp8_exponent_bias=7)
    m = IntNBitTableBatchedEmbeddingBagsCodegen(
        [(f"t{i}", 12, dim, ty, EmbeddingLocation.HOST) for i, ty in enumerate(types)],
        device="cpu",
        pooling_mode=MODES[mode],
        output_dtype=out_dtype,
        weight_lists=qs,
        **kwargs,
    )
    fmap = list(range(len(types)))
    bags = make_bags(g, [12] * len(types), [4] * len(types))
    psw = torch.rand(n_ids(bags), generator=g) + 0.5 if weighted else None
    indices, offsets = flatten_bags(bags, torch.int32)
    out = m(indices, offsets, per_sample_weights=psw)
    want = ref_lookup(deq, fmap, bags, mode, psw)
    vs_src = ref_lookup(src, fmap, bags, mode, psw)
    tol = 1e-4 if out_dtype == SparseType.FP32 else 2e-2
    note = ""
    if out.shape == vs_src.shape and out.dtype.is_floating_point:
        note = f"vs fp32 source {(out.float() - vs_src).abs().max().item():.2f}"
    elif not out.dtype.is_floating_point:
        note = f"output dtype {out.dtype}"
    return compare(tol, note=note, fwd=(out, want))


for _ty in ("FP32", "FP16", "INT8", "INT4", "INT2", "FP8"):
    probe(f"3 IntNBit {_ty} SUM/MEAN/NONE vs dequantized reference")(
        lambda ty=_ty: combine(
            **{mode: intnbit_case([getattr(SparseType, ty)], mode) for mode in ("sum", "mean", "none")}
        )
    )
probe("3 IntNBit mixed types across tables (INT8, INT4, FP16)")(
    lambda: intnbit_case([SparseType.INT8, SparseType.INT4, SparseType.FP16])
)
probe("3 IntNBit weighted SUM and MEAN (INT4)")(
    lambda: combine(**{mode: intnbit_case([SparseType.INT4], mode, weighted=True) for mode in ("sum", "mean")})
)
probe("3 IntNBit weighted NONE (INT4)")(lambda: intnbit_case([SparseType.INT4], "none", weighted=True))
probe("3 IntNBit output FP16 and BF16 (INT4)")(
    lambda: combine(
        **{o.name: intnbit_case([SparseType.INT4], out_dtype=o) for o in (SparseType.FP16, SparseType.BF16)}
    )
)
probe("3 IntNBit output INT8 (INT8 table)")(lambda: intnbit_case([SparseType.INT8], out_dtype=SparseType.INT8))
probe("3 IntNBit D=6 (INT4)")(lambda: intnbit_case([SparseType.INT4], dim=6))


# ---------------------------------------------------------------------------------------------------------------
# section 4: sparse and jagged ops


def autograd_check(out: torch.Tensor, want: torch.Tensor, leaf: torch.Tensor, ref_leaf: torch.Tensor) -> str:
    """Backprop the same random cotangent through the op's output and the reference; compare leaf grads."""
    if not out.requires_grad:
        return "WRONG (output does not require grad)"
    c = torch.randn(want.shape, generator=gen(99))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (out.float() * c).sum().backward()
    (want * c).sum().backward()
    return compare(grad=(leaf.grad, ref_leaf.grad))


def ref_bucketize(
    lengths: torch.Tensor,
    indices: torch.Tensor,
    my_size: int,
    rule: Callable[[int, int], tuple[int, int]],
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Bucket-major output of a per-id rule(bag, id) -> (bucket, new id); ids keep their order within a bag.
    Returns lengths [my_size * bags], indices, weights, pos (index within the original bag), unbucketize permute."""
    n_bags = len(lengths)
    buckets: list[list[list[tuple[int, int, int]]]] = [[[] for _ in range(n_bags)] for _ in range(my_size)]
    start = 0
    for bag in range(n_bags):
        for k in range(int(lengths[bag])):
            p, new = rule(bag, int(indices[start + k]))
            buckets[p][bag].append((new, k, start + k))
        start += int(lengths[bag])
    entries = [e for p in range(my_size) for bag in range(n_bags) for e in buckets[p][bag]]
    new_lengths = torch.tensor([len(buckets[p][bag]) for p in range(my_size) for bag in range(n_bags)])
    new_indices = torch.tensor([e[0] for e in entries], dtype=torch.int64)
    pos = torch.tensor([e[1] for e in entries], dtype=torch.int64)
    unbucketize = torch.empty(len(entries), dtype=torch.int64)
    for j, e in enumerate(entries):
        unbucketize[e[2]] = j
    new_weights = weights[torch.tensor([e[2] for e in entries], dtype=torch.int64)] if weights is not None else None
    return new_lengths, new_indices, new_weights, pos, unbucketize


def block_rule(block_sizes: Sequence[int], my_size: int, feature_of_bag: Sequence[int]) -> Callable:
    def rule(bag: int, idx: int) -> tuple[int, int]:
        bs = block_sizes[feature_of_bag[bag]]
        if idx < bs * my_size:
            return idx // bs, idx % bs
        return idx % my_size, idx // my_size

    return rule


def block_bucketize_case(dtype: torch.dtype, my_size: int = 3, vbe: bool = False, uneven: bool = False) -> str:
    g = gen(40)
    T = 2
    batch = [3, 2] if vbe else [3, 3]
    lengths = torch.cat([torch.randint(0, 5, (b,), generator=g) for b in batch])
    block_sizes = [4, 5]
    indices = torch.randint(0, 25, (int(lengths.sum()),), generator=g)  # some ids past block_size * my_size
    weights = torch.rand(len(indices), generator=g)
    feature_of_bag = [f for f in range(T) for _ in range(batch[f])]
    kwargs: dict[str, object] = {}
    if vbe:
        kwargs.update(batch_size_per_feature=torch.tensor(batch, dtype=dtype), max_B=max(batch))
    rule = block_rule(block_sizes, my_size, feature_of_bag)
    if uneven:
        bounds = [[0, 3, 10, 25], [0, 12, 13, 25]]
        kwargs["block_bucketize_pos"] = [torch.tensor(b, dtype=dtype) for b in bounds]

        def rule(bag: int, idx: int) -> tuple[int, int]:
            b = bounds[feature_of_bag[bag]]
            p = max(i for i in range(my_size) if b[i] <= idx)
            return p, idx - b[p]

    want = ref_bucketize(lengths, indices, my_size, rule, weights)
    got = FBGEMM.block_bucketize_sparse_features(
        lengths.to(dtype),
        indices.to(dtype),
        True,
        True,
        torch.tensor(block_sizes, dtype=dtype),
        my_size,
        weights,
        **kwargs,
    )
    note = "" if got[1].dtype == dtype else f"indices dtype {got[1].dtype}"
    return compare(
        note=note,
        lengths=(got[0], want[0]),
        indices=(got[1], want[1]),
        weights=(got[2], want[2]),
        pos=(got[3], want[3]),
        unbucketize_permute=(got[4], want[4]),
    )


probe("4 block_bucketize_sparse_features int64 (weights, bucketize_pos, sequence)")(
    lambda: block_bucketize_case(torch.int64)
)
probe("4 block_bucketize_sparse_features int32 (weights, bucketize_pos, sequence)")(
    lambda: block_bucketize_case(torch.int32)
)
probe("4 block_bucketize_sparse_features uneven block_bucketize_pos")(
    lambda: block_bucketize_case(torch.int64, uneven=True)
)
probe("4 block_bucketize_sparse_features VBE batch_size_per_feature + max_B")(
    lambda: block_bucketize_case(torch.int64, vbe=True)
)
probe("4 block_bucketize_sparse_features my_size=1")(lambda: block_bucketize_case(torch.int64, my_size=1))


@probe("4 block_bucketize_sparse_features autograd of weights")
def _() -> str:
    lengths = torch.tensor([2, 1, 3, 0])
    indices = torch.tensor([1, 7, 3, 0, 8, 5])
    weights = torch.rand(6, generator=gen(41)).requires_grad_()
    ref_w = weights.detach().clone().requires_grad_()
    rule = block_rule([4, 4], 2, [0, 0, 1, 1])
    want = ref_bucketize(lengths, indices, 2, rule, ref_w)[2]
    got = FBGEMM.block_bucketize_sparse_features(lengths, indices, False, False, torch.tensor([4, 4]), 2, weights)
    assert want is not None and got[2] is not None
    return autograd_check(got[2], want, weights, ref_w)


@probe("4 bucketize_sparse_features (id % my_size, weights, pos)")
def _() -> str:
    g = gen(42)
    lengths = torch.randint(0, 5, (6,), generator=g)
    indices = torch.randint(0, 30, (int(lengths.sum()),), generator=g)
    weights = torch.rand(len(indices), generator=g)
    want = ref_bucketize(lengths, indices, 3, lambda bag, idx: (idx % 3, idx // 3), weights)
    got = FBGEMM.bucketize_sparse_features(lengths, indices, True, 3, weights)
    return compare(
        lengths=(got[0], want[0]), indices=(got[1], want[1]), weights=(got[2], want[2]), pos=(got[3], want[3])
    )


def ref_permute_segments(
    permute: Sequence[int], seg_lengths: torch.Tensor, values: torch.Tensor, weights: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), seg_lengths.cumsum(0)])
    idx = torch.cat([torch.arange(int(starts[p]), int(starts[p + 1])) for p in permute])
    return values[idx], (weights[idx] if weights is not None else None)


def permute_case(op: str, permute_dtype: torch.dtype = torch.int32, grad: bool = False, dup: bool = True) -> str:
    """Forward with duplicate permute entries; autograd of the weights with a bijective permute unless dup."""
    g = gen(43)
    T, B = 3, 4
    lengths = torch.randint(0, 4, (T, B), generator=g)
    values = torch.randint(0, 100, (int(lengths.sum()),), generator=g)
    weights = torch.rand(len(values), generator=g).requires_grad_(grad)
    ref_w = weights.detach().clone().requires_grad_(grad)
    permute = [2, 0, 2, 1] if dup or not grad else [2, 0, 1]
    if op == "permute_1D_sparse_data":
        seg = lengths.reshape(-1)
        permute = [5, 0, 11, 3, 3, 7] if dup or not grad else [5, 0, 11, 3, 7, 1, 2, 4, 6, 8, 9, 10]
        want_lengths = seg[permute]
        got = FBGEMM.permute_1D_sparse_data(torch.tensor(permute, dtype=permute_dtype), seg, values, weights)
    else:
        seg = lengths.sum(1)
        want_lengths = lengths[permute]
        got = getattr(FBGEMM, op)(torch.tensor(permute, dtype=permute_dtype), lengths, values, weights)
    want_v, want_w = ref_permute_segments(permute, seg, values, ref_w)
    assert want_w is not None
    if grad:
        assert got[2] is not None
        return autograd_check(got[2], want_w, weights, ref_w)
    return compare(lengths=(got[0], want_lengths), values=(got[1], want_v), weights=(got[2], want_w))


probe("4 permute_2D_sparse_data int32 permute (with duplicates)")(lambda: permute_case("permute_2D_sparse_data"))
probe("4 permute_2D_sparse_data int64 permute")(lambda: permute_case("permute_2D_sparse_data", torch.int64))
probe("4 permute_2D_sparse_data autograd of weights")(
    lambda: permute_case("permute_2D_sparse_data", grad=True, dup=False)
)


@probe("4 permute_2D_sparse_data autograd of weights, duplicate permute entries")
def _() -> str:
    # its backward misbehaves differently on every run (garbage sizes, an invalid gradient, a crash, or wrong
    # grads): run it in its own process and print one stable line for any of those
    result = run_forked(lambda: permute_case("permute_2D_sparse_data", grad=True), 30.0)
    if is_ok(result):
        return result
    return "WRONG/FAIL (varies run to run: garbage tensor sizes, invalid gradient, crash or wrong grads)"


probe("4 permute_sparse_features int32 permute")(lambda: permute_case("permute_sparse_features"))
probe("4 permute_sparse_features autograd of weights")(
    lambda: permute_case("permute_sparse_features", grad=True, dup=False)
)
probe("4 permute_1D_sparse_data int32 permute")(lambda: permute_case("permute_1D_sparse_data"))
probe("4 permute_1D_sparse_data autograd of weights")(
    lambda: permute_case("permute_1D_sparse_data", grad=True, dup=False)
)


@probe("4 asynchronous_complete/exclusive/inclusive_cumsum (int32, int64, float, 2-D complete)")
def _() -> str:
    results = {}
    for dtype in (torch.int32, torch.int64, torch.float32):
        x = torch.tensor([3, 0, 2, 5, 1], dtype=dtype)
        inc = x.cumsum(0).to(dtype)
        zero = torch.zeros(1, dtype=dtype)
        results[f"complete {dtype}"] = compare(c=(FBGEMM.asynchronous_complete_cumsum(x), torch.cat([zero, inc])))
        results[f"exclusive {dtype}"] = compare(
            c=(FBGEMM.asynchronous_exclusive_cumsum(x), torch.cat([zero, inc[:-1]]))
        )
        results[f"inclusive {dtype}"] = compare(c=(FBGEMM.asynchronous_inclusive_cumsum(x), inc))
    x2 = torch.tensor([[1, 2, 3], [4, 0, 6]])
    want2 = torch.cat([torch.zeros(2, 1, dtype=torch.int64), x2.cumsum(1)], 1)
    results["2-D complete"] = compare(c=(FBGEMM.asynchronous_complete_cumsum(x2), want2))
    return combine(**results)


def expand_case(complete: bool) -> str:
    in_lengths = torch.tensor([3, 1, 4])
    permute = [2, 0, 1]
    out_lengths = in_lengths[permute]
    in_off = torch.cat([torch.zeros(1, dtype=torch.int64), in_lengths.cumsum(0)])
    out_off = torch.cat([torch.zeros(1, dtype=torch.int64), out_lengths.cumsum(0)])
    want = torch.cat([torch.arange(int(in_off[p]), int(in_off[p]) + int(in_lengths[p])) for p in permute])
    if not complete:
        in_off, out_off = in_off[:-1], out_off[:-1]
    got = FBGEMM.expand_into_jagged_permute(torch.tensor(permute), in_off, out_off, int(out_lengths.sum()))
    return compare(permute=(got, want))


probe("4 expand_into_jagged_permute, complete (T+1) offsets")(lambda: expand_case(True))
probe("4 expand_into_jagged_permute, exclusive (T) offsets")(lambda: expand_case(False))


def jagged_data(d: int | None = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([2, 0, 4, 1])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    shape = (int(lengths.sum()), d) if d else (int(lengths.sum()),)
    return torch.randn(shape, generator=gen(44)), lengths, offsets


def ref_padded(values: torch.Tensor, lengths: torch.Tensor, max_len: int, pad: float = 0.0) -> torch.Tensor:
    out = torch.full((len(lengths), max_len, *values.shape[1:]), pad, dtype=values.dtype)
    start = 0
    for b, n in enumerate(lengths.tolist()):
        k = min(n, max_len)
        out[b, :k] = values[start : start + k]  # autograd records the copy into out
        start += n
    return out


@probe("4 jagged_to_padded_dense 1-D and 2-D values, truncation, autograd")
def _() -> str:
    results = {}
    for d in (None, 3):
        values, lengths, offsets = jagged_data(d)
        v = values.clone().requires_grad_()
        rv = values.clone().requires_grad_()
        got = FBGEMM.jagged_to_padded_dense(v, [offsets], [3], -1.0)  # bag of 4 is truncated to 3
        want = ref_padded(rv, lengths, 3, -1.0)
        results[f"fwd d={d}"] = compare(fwd=(got, want))
        results[f"grad d={d}"] = autograd_check(got, want, v, rv)
    return combine(**results)


@probe("4 dense_to_jagged fwd + autograd")
def _() -> str:
    _, lengths, offsets = jagged_data()
    dense = torch.randn(4, 4, 3, generator=gen(45))
    d, rd = dense.clone().requires_grad_(), dense.clone().requires_grad_()
    got = FBGEMM.dense_to_jagged(d, [offsets])[0]
    want = torch.cat([rd[b, :n] for b, n in enumerate(lengths.tolist())])
    return combine(fwd=compare(fwd=(got, want)), grad=autograd_check(got, want, d, rd))


@probe("4 jagged_2d_to_dense fwd + autograd")
def _() -> str:
    values, lengths, offsets = jagged_data()
    v, rv = values.clone().requires_grad_(), values.clone().requires_grad_()
    got = FBGEMM.jagged_2d_to_dense(v, offsets, 4)
    want = ref_padded(rv, lengths, 4)
    return combine(fwd=compare(fwd=(got, want)), grad=autograd_check(got, want, v, rv))


@probe("4 jagged_1d_to_dense (int64 values, padding -1)")
def _() -> str:
    _, lengths, offsets = jagged_data()
    values = torch.arange(10, 10 + int(lengths.sum()))
    got = FBGEMM.jagged_1d_to_dense(values, offsets, 3, -1)
    return compare(fwd=(got, ref_padded(values, lengths, 3, -1)))


@probe("4 jagged_index_select fwd + autograd")
def _() -> str:
    values, lengths, offsets = jagged_data()
    v, rv = values.clone().requires_grad_(), values.clone().requires_grad_()
    sel = torch.tensor([2, 0, 2, 3])
    got = FBGEMM.jagged_index_select(v, lengths, sel)
    want = torch.cat([rv[int(offsets[b]) : int(offsets[b + 1])] for b in sel.tolist()])
    return combine(
        fwd=compare(values=(got[0], want), lengths=(got[1], lengths[sel])),
        grad=autograd_check(got[0], want, v, rv),
    )


@probe("4 jagged_dense_elementwise_add fwd + autograd")
def _() -> str:
    values, lengths, offsets = jagged_data()
    y = torch.randn(4, 3, 3, generator=gen(46))
    v, rv = values.clone().requires_grad_(), values.clone().requires_grad_()
    got = FBGEMM.jagged_dense_elementwise_add(v, [offsets], y)
    want = ref_padded(rv, lengths, 3) + y
    return combine(fwd=compare(fwd=(got, want)), grad=autograd_check(got, want, v, rv))


@probe("4 pack_segments fwd + autograd")
def _() -> str:
    values, lengths, _ = jagged_data()
    v, rv = values.clone().requires_grad_(), values.clone().requires_grad_()
    got = FBGEMM.pack_segments(v, lengths, 5)
    want = ref_padded(rv, lengths, 5)
    return combine(fwd=compare(fwd=(got, want)), grad=autograd_check(got, want, v, rv))


@probe("4 invert_permute, offsets_range, lengths_range")
def _() -> str:
    p = torch.tensor([3, 0, 4, 1, 2])
    inv = torch.empty_like(p)
    inv[p] = torch.arange(5)
    lengths = [2, 0, 3, 1]
    offsets = torch.tensor([0, 2, 2, 5])
    ranges = torch.cat([torch.arange(n) for n in lengths])
    return combine(
        invert_permute=compare(p=(FBGEMM.invert_permute(p), inv)),
        offsets_range=compare(r=(FBGEMM.offsets_range(offsets, 6), ranges)),
        lengths_range=compare(r=(FBGEMM.lengths_range(torch.tensor(lengths)), ranges)),
    )


def segment_sum_case(grad: bool) -> str:
    B = 2
    csr = torch.tensor([0, 1, 3, 4])
    values = torch.randn(8, generator=gen(47))
    v, rv = values.clone().requires_grad_(), values.clone().requires_grad_()
    got = FBGEMM.segment_sum_csr(B, csr, v)
    want = torch.stack([rv[int(csr[i]) * B : int(csr[i + 1]) * B].sum() for i in range(len(csr) - 1)])
    return autograd_check(got, want, v, rv) if grad else compare(fwd=(got, want))


probe("4 segment_sum_csr forward")(lambda: segment_sum_case(False))
probe("4 segment_sum_csr autograd")(lambda: segment_sum_case(True))


@probe("4 keyed_jagged_index_select_dim1")
def _() -> str:
    T, B = 2, 3
    lengths = torch.tensor([2, 0, 1, 3, 1, 2])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    values = torch.arange(100, 100 + int(lengths.sum()))
    sel = torch.tensor([2, 0])
    got = FBGEMM.keyed_jagged_index_select_dim1(values, lengths, offsets, sel, B)
    bags = [t * B + b for t in range(T) for b in sel.tolist()]
    want_v = torch.cat([values[int(offsets[k]) : int(offsets[k + 1])] for k in bags])
    return compare(values=(got[0], want_v), lengths=(got[1], lengths[bags]))


@probe("4 bounds_check_indices WARNING: out-of-range id set to 0 in place")
def _() -> str:
    indices = torch.tensor([1, 12, 3, 4, 10])
    offsets = torch.tensor([0, 2, 3, 5])
    warning = torch.zeros(1, dtype=torch.int64)
    FBGEMM.bounds_check_indices(torch.tensor([10, 5, 5]), indices, offsets, 1, warning)
    # feature 0 has 10 rows (bags 0); here T=3, B=1: ids 1, 12 | 3 | 4, 10 against rows 10 | 5 | 5
    return compare(
        indices=(indices, torch.tensor([1, 0, 3, 4, 0])), warning_positive=((warning > 0).float(), torch.ones(1))
    )


def pooled_perm_setup() -> tuple[list[int], list[int], torch.Tensor, list[torch.Tensor]]:
    dims = [2, 3, 1, 4]
    perm = [2, 0, 3, 1]
    x = torch.randn(3, sum(dims), generator=gen(48))
    tensors = [
        torch.tensor([0, *torch.tensor(dims).cumsum(0).tolist()]),
        torch.tensor(perm),
        torch.tensor([0, *torch.tensor([dims[p] for p in perm]).cumsum(0).tolist()]),
        torch.tensor(sorted(range(len(perm)), key=lambda i: perm[i])),
    ]
    return dims, perm, x, tensors


def ref_pooled_perm(x: torch.Tensor, dims: Sequence[int], perm: Sequence[int]) -> torch.Tensor:
    return torch.cat([x.split(list(dims), 1)[p] for p in perm], 1)


@probe("4 permute_pooled_embs / _auto_grad / PermutePooledEmbeddings fwd + autograd")
def _() -> str:
    dims, perm, x, tensors = pooled_perm_setup()
    results = {
        "permute_pooled_embs": compare(fwd=(FBGEMM.permute_pooled_embs(x, *tensors), ref_pooled_perm(x, dims, perm)))
    }
    for name in ("auto_grad", "module"):
        v, rv = x.clone().requires_grad_(), x.clone().requires_grad_()
        if name == "auto_grad":
            got = FBGEMM.permute_pooled_embs_auto_grad(v, *tensors)
        else:
            got = PermutePooledEmbeddings(dims, perm, device=torch.device("cpu"))(v)
        want = ref_pooled_perm(rv, dims, perm)
        results[name] = combine(fwd=compare(fwd=(got, want)), grad=autograd_check(got, want, v, rv))
    return combine(**results)


def sequence_case(two_d: bool, grad: bool = False) -> str:
    g = gen(49)
    lengths = torch.randint(0, 4, (3, 2), generator=g)
    n = int(lengths.sum())
    emb = torch.randn((n, 4) if two_d else (n,), generator=g)
    v, rv = emb.clone().requires_grad_(), emb.clone().requires_grad_()
    permute = [2, 0, 1]
    got = FBGEMM.permute_sequence_embeddings(torch.tensor(permute, dtype=torch.int32), lengths, v)
    want, _ = ref_permute_segments(permute, lengths.sum(1), rv, None)
    if grad:
        return autograd_check(got[1], want, v, rv)
    return compare(lengths=(got[0], lengths[permute]), values=(got[1], want))


probe("4 permute_sequence_embeddings 1-D values")(lambda: sequence_case(False))
probe("4 permute_sequence_embeddings [N, D] values")(lambda: sequence_case(True))
probe("4 permute_sequence_embeddings autograd (1-D)")(lambda: sequence_case(False, grad=True))


# ---------------------------------------------------------------------------------------------------------------
# runner


def run_one(fn: Callable[[], str]) -> str:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return attempt(fn)


def _child(fn: Callable[[], str], conn: multiprocessing.connection.Connection) -> None:
    conn.send(run_one(fn))
    conn.close()


def run_forked(fn: Callable[[], str], timeout: float) -> str:
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(fn, send))
    proc.start()
    send.close()
    result = None
    if recv.poll(timeout):
        try:
            result = recv.recv()
        except EOFError:
            result = None
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return result or f"FAIL (timeout after {timeout:.0f} s)"
    if result is None:
        return f"FAIL (process died, exit code {proc.exitcode})"
    return result


def versions() -> str:
    parts = [f"torch {torch.__version__}"]
    for dist in ("fbgemm-gpu-cpu", "fbgemm-gpu", "fbgemm_gpu_cpu"):
        try:
            parts.append(f"{dist} {importlib.metadata.version(dist)}")
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run only probes whose row name contains this text")
    parser.add_argument("--no-fork", action="store_true", help="run probes in this process")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per probe (forked runs)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    fork = not args.no_fork and "fork" in multiprocessing.get_all_start_methods()
    print(f"# {versions()}, python {sys.version.split()[0]}, {os.cpu_count()} cpus", flush=True)
    t0 = time.perf_counter()
    for name, fn in PROBES:
        if args.only and args.only not in name:
            continue
        result = run_forked(fn, args.timeout) if fork else run_one(fn)
        print(f"{name} | {result}", flush=True)
    print(f"# {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
