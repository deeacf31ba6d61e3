"""Quantized comms (pipeline/output_dist.py) stay within their documented bound of fp32, at 2 and 4 processes.

Two levels. The pooled output dist alone on random layouts (whole tables, row blocks that add up, column
shards, data-parallel columns; unequal batches), every precision and loss scale: each output element within
``u * sum_k |p_k|`` (plus the wire type's spacing at zero per block) of the fp32 exchange, each pooled gradient
within ``u * |g|``. Then whole sharded collections through ``shard_modules`` and through TorchRec's sharder
API (``DistributedModelParallel`` with ``qcomm_codecs_registry``): outputs within ``u`` times the pooled
absolute weights, table gradients within ``u`` times the gradients of the absolute output gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from lightning_rec.distributed import (
    CommOp,
    CommType,
    DistributedModelParallel,
    EmbeddingBagCollectionSharder,
    EmbeddingCollectionSharder,
    QCommsConfig,
    get_qcomm_codecs_registry,
)
from lightning_rec.pipeline.output_dist import OutputDistKind, PooledOutputDist, pooled_codecs
from lightning_rec.pipeline.routing import build_routing
from lightning_rec.sharding import ShardingPlan, column_wise, data_parallel, row_wise, shard_modules, table_wise
from lightning_rec.testing import run_distributed
from tests.distributed.test_place_exchange import _layout

UNIT = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, None: 0.0}
TINY = {torch.float16: 2.0**-24, torch.bfloat16: 0.0, None: 0.0}  # spacing at zero (bf16 keeps fp32's range)
CONFIGS = [
    QCommsConfig(forward_precision=CommType.FP16, backward_precision=CommType.BF16),
    QCommsConfig(forward_precision=CommType.BF16, backward_precision=CommType.FP16, backward_loss_scale=1024.0),
    QCommsConfig(forward_precision=CommType.FP16, backward_precision=CommType.FP16, forward_loss_scale=8.0),
]


def _codecs(config: QCommsConfig):
    codecs = pooled_codecs(get_qcomm_codecs_registry(config))
    assert codecs is not None
    return codecs


def _output_dist_job(rank: int, ws: int, seeds: list[int]) -> None:
    group = dist.new_group(list(range(ws)))
    batches = [3, 0, 2, 4][:ws]
    b = batches[rank]
    for seed in seeds:
        feature_table, dims, shards = _layout(seed, ws)
        local = [t for t, sh in enumerate(shards) if sh and any(s.rank == rank for s in sh)]
        rt = build_routing(feature_table, dims, shards, local, group_rank=rank, group_size=ws)
        gen = torch.Generator().manual_seed(seed * 10 + rank)
        dp_width = sum(rt.feat_off[f + 1] - rt.feat_off[f] for f in rt.dp_features)
        flat = PooledOutputDist(rt, group)
        # magnitudes over many binades, a few below fp16's normal range
        pooled0 = torch.randn(sum(batches), rt.cols_from[rank], generator=gen) * 10.0 ** torch.randint(
            -6, 3, (sum(batches), rt.cols_from[rank]), generator=gen
        )
        dp0 = torch.randn(b, dp_width, generator=gen) if rt.dp_tables else None
        coef = torch.randn(b, rt.feat_off[-1], generator=gen) * 10.0 ** torch.randint(
            -5, 2, (b, rt.feat_off[-1]), generator=gen
        )
        n_blocks = ws + 1
        with torch.no_grad():
            bound_sum = flat(pooled0.abs(), None if dp0 is None else dp0.abs(), batches, b)
        for config in CONFIGS:
            codecs = _codecs(config)
            quantized = PooledOutputDist(rt, group, codecs)
            assert flat.kind is OutputDistKind.FLAT and quantized.kind is OutputDistKind.QUANTIZED
            results = []
            for out_dist in (flat, quantized):
                pooled = pooled0.clone().requires_grad_(True)
                dp = None if dp0 is None else dp0.clone().requires_grad_(True)
                out = out_dist(pooled, dp, batches, b)
                (out * coef).sum().backward()
                results.append((out.detach(), pooled.grad, None if dp is None else dp.grad))
            (o32, g32, d32), (oq, gq, dq) = results
            fwd, bwd = codecs.forward, codecs.backward
            u, tiny = UNIT[fwd.dtype], TINY[fwd.dtype] / (fwd.scale or 1.0)
            limit = (1.01 * u + 4 * 2.0**-24) * bound_sum + n_blocks * tiny
            where = f"seed {seed} rank {rank}/{ws} {codecs}"
            assert ((oq - o32).abs() <= limit).all(), f"{where}: output off by {(oq - o32).abs().max()}"
            if b and sum(rt.cols_from):  # rows came through the exchange: the bound is not vacuous, they rounded
                assert not torch.equal(oq, o32), where
            ub, tiny_b = UNIT[bwd.dtype], TINY[bwd.dtype] / (bwd.scale or 1.0)
            assert ((gq - g32).abs() <= 1.01 * ub * g32.abs() + tiny_b).all(), f"{where}: pooled grad off"
            assert (d32 is None and dq is None) or torch.equal(d32, dq), f"{where}: data-parallel grads changed"
    dist.destroy_process_group(group)


@pytest.mark.parametrize("ws", [2, 4])
def test_pooled_output_dist_within_bound_of_fp32(ws: int) -> None:
    run_distributed(_output_dist_job, ws, list(range(10)))


def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t{i}",
            num_embeddings=40 + 7 * i,
            embedding_dim=8,
            feature_names=[f"f{i}"],
            pooling=PoolingType.MEAN if i == 3 else PoolingType.SUM,
        )
        for i in range(5)
    ]


def _plan(ws: int) -> ShardingPlan:
    return ShardingPlan(
        {
            "": {
                "t0": table_wise(rank=ws - 1),
                "t1": row_wise(),
                "t2": column_wise(ranks=[0, 1]),
                "t3": row_wise(),
                "t4": data_parallel(),
            }
        }
    )


def _batch(rank: int, step: int) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(100 * rank + step)
    b = 3 + rank
    lengths = torch.randint(0, 4, (5 * b,), generator=gen)
    values = torch.cat([torch.randint(0, 40 + 7 * (i // b), (int(n),), generator=gen) for i, n in enumerate(lengths)])
    return KeyedJaggedTensor([f"f{i}" for i in range(5)], values, lengths=lengths)


def _collection_job(rank: int, ws: int, via_dmp: bool) -> None:
    config = CONFIGS[0]
    fwd, bwd = _codecs(config).forward, _codecs(config).backward
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in EmbeddingBagCollection(_tables()).state_dict().items()}
    kjt = _batch(rank, 0)
    coef = torch.randn(kjt.stride(), 40, generator=torch.Generator().manual_seed(rank))
    # fp32, quantized, and fp32 again on |coef| (its table gradients bound the quantized model's error)
    runs = [(False, coef), (True, coef), (False, coef.abs())]
    outs, grads = [], []
    for quantized, c in runs:
        ebc = EmbeddingBagCollection(_tables())
        ebc.load_state_dict(state)
        registry = get_qcomm_codecs_registry(config) if quantized else None
        if via_dmp:
            sharders = [EmbeddingBagCollectionSharder(qcomm_codecs_registry=registry), EmbeddingCollectionSharder()]
            model = DistributedModelParallel(ebc, plan=_plan(ws), sharders=sharders)
        else:
            model = shard_modules(ebc, _plan(ws), qcomm_codecs_registry=registry)
        out = model(kjt).values()
        (out * c).sum().backward()
        outs.append(out.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    abs_model = EmbeddingBagCollection(_tables())  # unsharded, |weights|: the pooled absolute values
    abs_model.load_state_dict({k: v.abs() for k, v in state.items()})
    with torch.no_grad():
        bound = abs_model(kjt).values()
    diff = (outs[1] - outs[0]).abs()
    assert (diff <= (1.01 * UNIT[fwd.dtype] + 2.0**-22) * bound + 3 * 2.0**-24).all(), diff.max()
    assert not torch.equal(outs[1], outs[0])  # fp16 rounding happened somewhere
    # each pooled gradient a shard receives is off by at most u_b of itself, so a row's gradient by at most
    # u_b times the sum of its bags' absolute gradients
    for name, g32 in grads[0].items():
        gq, gabs = grads[1][name], grads[2][name]
        if ".t4." in name:  # data-parallel: its pooled rows never travel
            assert torch.equal(gq, g32), name
            continue
        diff = (gq - g32).abs()
        assert (diff <= (1.01 * UNIT[bwd.dtype] + 2.0**-22) * gabs + 1e-30).all(), f"rank {rank} {name}: {diff.max()}"


@pytest.mark.parametrize("ws", [2, 4])
def test_sharded_collection_within_bound_of_fp32(ws: int) -> None:
    run_distributed(_collection_job, ws, False)


def test_dmp_with_torchrec_registry_within_bound_of_fp32() -> None:
    run_distributed(_collection_job, 2, True)


def _refusals_job(rank: int, ws: int) -> None:
    ebc = EmbeddingBagCollection(_tables())
    registry = get_qcomm_codecs_registry(
        QCommsConfig(forward_precision=CommType.FP16), comm_ops=[CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL]
    )
    with pytest.raises(ValueError, match="pooled embeddings only"):
        DistributedModelParallel(
            ebc,
            plan=_plan(ws),
            sharders=[EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder(qcomm_codecs_registry=registry)],
        )
    mixed = {
        **get_qcomm_codecs_registry(
            QCommsConfig(forward_precision=CommType.FP16), comm_ops=[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL]
        ),
        **get_qcomm_codecs_registry(
            QCommsConfig(forward_precision=CommType.BF16), comm_ops=[CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER]
        ),
    }
    with pytest.raises(ValueError, match="same codecs"):
        shard_modules(EmbeddingBagCollection(_tables()), _plan(ws), qcomm_codecs_registry=mixed)


def test_mismatched_registries_are_refused_on_every_rank() -> None:
    run_distributed(_refusals_job, 2)
