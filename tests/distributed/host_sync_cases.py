"""Training steps whose host syncs are counted (``lightning_rec.host_syncs``): one collection whose tables all use
one sharding type, pooled or sequence, fused SGD or torch SGD, the plain loop or ``TrainPipelineSparseDist``.
Used by ``tests/distributed/test_host_syncs.py`` (upper bounds) and ``benchmarks/bench_host_syncs.py``.
"""

from __future__ import annotations

import contextlib
import itertools

import torch
from torch import nn

from lightning_rec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from lightning_rec.data import Batch
from lightning_rec.distributed import TrainPipelineSparseDist
from lightning_rec.host_syncs import HostSyncCounter
from lightning_rec.sharding import (
    ShardingPlan,
    column_wise,
    data_parallel,
    fused_optimizer,
    grid_shard,
    row_wise,
    shard_modules,
    table_row_wise,
    table_wise,
)

ROWS = (40, 24, 16)
DIM = 8
BATCH = 16
KINDS = ("data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "grid_shard")


def _spec(kind: str, i: int, ws: int):
    return {
        "data_parallel": lambda: data_parallel(),
        "table_wise": lambda: table_wise(i % ws),
        "row_wise": lambda: row_wise(),
        "column_wise": lambda: column_wise([0, 1 % ws]),
        "table_row_wise": lambda: table_row_wise(0),
        "grid_shard": lambda: grid_shard([0]),
    }[kind]()


class _Model(nn.Module):
    def __init__(self, pooled: bool) -> None:
        super().__init__()
        names = [f"t{i}" for i in range(len(ROWS))]
        if pooled:
            self.coll = EmbeddingBagCollection(
                [EmbeddingBagConfig(r, DIM, n, [f"f{i}"]) for i, (r, n) in enumerate(zip(ROWS, names))]
            )
        else:
            self.coll = EmbeddingCollection(
                [EmbeddingConfig(r, DIM, n, [f"f{i}"]) for i, (r, n) in enumerate(zip(ROWS, names))]
            )
        self.pooled = pooled
        self.dense = nn.Linear(3, DIM)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.coll(batch.sparse)
        if self.pooled:
            emb = out.values().view(-1, len(ROWS), DIM).sum(1)
        else:  # each position's vector summed per sample, with the lengths the batch already holds on the host
            emb = sum(jt.values().sum() for jt in out.values()) * torch.ones(batch.dense.shape[0], DIM)
        logits = (emb * self.dense(batch.dense)).sum(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels), logits.detach()


def _batches(rank: int, n: int) -> list[Batch]:
    g = torch.Generator().manual_seed(7 + rank)
    out = []
    for _ in range(n):
        lengths = torch.randint(0, 4, (len(ROWS) * BATCH,), generator=g)
        per = lengths.view(len(ROWS), BATCH).sum(1).tolist()
        ids = torch.cat([torch.randint(0, r, (k,), generator=g) for r, k in zip(ROWS, per)])
        kjt = KeyedJaggedTensor([f"f{i}" for i in range(len(ROWS))], ids, lengths=lengths)
        out.append(Batch(torch.randn(BATCH, 3, generator=g), kjt, torch.randint(0, 2, (BATCH,), generator=g).float()))
    return out


def count_step(rank: int, ws: int, kind: str, pooled: bool, fused: bool, pipelined: bool, where: bool):
    torch.manual_seed(0)
    model = _Model(pooled)
    plan = ShardingPlan({"coll": {f"t{i}": _spec(kind, i, ws) for i in range(len(ROWS))}})
    model = shard_modules(model, plan, embedding_optimizer={"kind": "sgd", "lr": 0.1} if fused else None)
    dense = [p for n, p in model.named_parameters() if not n.startswith("coll.")]
    opt = torch.optim.SGD(dense if fused else list(model.parameters()), lr=0.1)
    fopt = fused_optimizer(model)
    counter = HostSyncCounter(where=where)
    if pipelined:

        class _Both(torch.optim.Optimizer):
            def __init__(self) -> None:
                self.param_groups = opt.param_groups

            def zero_grad(self, set_to_none: bool = True) -> None:
                opt.zero_grad(set_to_none)

            def step(self, closure=None) -> None:
                opt.step()
                if fopt is not None:
                    fopt.step()

        pipeline = TrainPipelineSparseDist(model, _Both(), torch.device("cpu"))
        it = iter(_batches(rank, 4))
        pipeline.progress(it)
        pipeline.progress(it)
        with counter:
            pipeline.progress(it)
    else:
        for step, batch in enumerate(_batches(rank, 3)):
            with counter if step == 2 else contextlib.nullcontext():
                opt.zero_grad()
                loss, _ = model(batch)
                loss.backward()
                opt.step()
                if fopt is not None:
                    fopt.step()
    return counter.total, dict(counter.by_op), dict(counter.by_site)


def all_counts(rank: int, ws: int, where: bool) -> list:
    rows = []
    for pooled, kind, fused, pipelined in itertools.product((True, False), KINDS, (False, True), (False, True)):
        if fused and not pooled:
            continue  # sequence collections have no fused kernel yet
        rows.append(((pooled, kind, fused, pipelined), count_step(rank, ws, kind, pooled, fused, pipelined, where)))
    return rows


def main_job_counts(rank: int, ws: int, fused: bool) -> dict:
    """The main job's model (``lightning_rec.models.DLRM``) under ``Trainer(strategy="rec_sharded")`` with a
    mixed plan: the host syncs of its third training step (Lightning's loop, logging and both optimizers
    included), by op and by the library line that issued them."""
    import lightning as L

    from lightning_rec import RecShardedStrategy
    from lightning_rec.models import DLRM

    cards = {"user id": 23, "item": 31, "geo.city": 7, "hist": 17}
    plan = ShardingPlan(
        {
            "sparse_arch.embedding_bag_collection": {
                "user id": row_wise(),
                "item": table_wise(1 % ws),
                "geo.city": column_wise([1 % ws, 0]),
                "hist": data_parallel(),
            }
        }
    )
    torch.manual_seed(0)
    model = DLRM(
        num_dense=3,
        feature_names=list(cards),
        num_embeddings_per_feature=list(cards.values()),
        embedding_dim=8,
        dense_arch_layer_sizes=[8, 8],
        over_arch_layer_sizes=[8, 1],
        plan=plan,
    )
    g = torch.Generator().manual_seed(100 + rank)
    data = []
    for _ in range(4):
        lengths = torch.randint(0, 3, (len(cards) * BATCH,), generator=g)
        per = lengths.view(len(cards), BATCH).sum(1).tolist()
        ids = torch.cat([torch.randint(0, n, (k,), generator=g) for n, k in zip(cards.values(), per)])
        kjt = KeyedJaggedTensor(list(cards), ids, lengths=lengths)
        data.append((torch.randn(BATCH, 3, generator=g), kjt, torch.randint(0, 2, (BATCH,), generator=g).float()))
    counter = HostSyncCounter(where=True)

    class Count(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 2:
                counter.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 2:
                counter.__exit__(None, None, None)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=ws,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        callbacks=[Count()],
        strategy=RecShardedStrategy(embedding_optimizer={"kind": "adagrad", "lr": 0.1} if fused else None),
    )
    trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    return {"total": counter.total, "by_op": dict(counter.by_op), "by_site": dict(counter.by_site)}
