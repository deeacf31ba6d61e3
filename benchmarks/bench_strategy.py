"""Trainer(strategy="rec_sharded") vs the same training loop written by hand over shard_modules.

Both run on 2 gloo CPU processes with the same model, plan, data and optimizer; the ratio is the
strategy's overhead. Runs alternate (hand, strategy, hand, strategy, ...) and the figure is the median
of per-round ratios, so both sides see the same machine load.

    python benchmarks/bench_strategy.py [--rounds 3] [--steps 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TABLES, ROWS, DIM, BATCH, IDS = 26, 20_000, 32, 1024, 8
WARMUP = 3  # steps excluded from the timing on both sides


def _model():
    import lightning as L

    from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.ebc = EmbeddingBagCollection(
                [
                    EmbeddingBagConfig(name=f"t{i}", num_embeddings=ROWS, embedding_dim=DIM, feature_names=[f"f{i}"])
                    for i in range(TABLES)
                ],
                sparse_grad=True,
            )
            self.head = torch.nn.Sequential(torch.nn.Linear(TABLES * DIM, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

        def forward(self, kjt):
            return self.head(self.ebc(kjt).values()).squeeze(1)

        def training_step(self, batch, _):
            kjt, y = batch
            return torch.nn.functional.binary_cross_entropy_with_logits(self(kjt), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Model()


class _Batches(torch.utils.data.IterableDataset):
    def __init__(self, steps: int, rank: int) -> None:
        self.steps, self.rank = steps, rank

    def __iter__(self):
        from lightning_rec import KeyedJaggedTensor

        g = torch.Generator().manual_seed(self.rank)
        for _ in range(self.steps):
            lengths = torch.randint(0, 2 * IDS, (TABLES * BATCH,), generator=g)
            values = (torch.rand(int(lengths.sum()), generator=g) ** 4 * ROWS).long()
            yield (
                KeyedJaggedTensor([f"f{i}" for i in range(TABLES)], values, lengths=lengths),
                (torch.rand(BATCH, generator=g) < 0.3).float(),
            )


def _plan():
    from lightning_rec import ShardingPlan, row_wise, table_wise

    return ShardingPlan({"ebc": {f"t{i}": (row_wise() if i % 2 else table_wise(i % 4 // 2)) for i in range(TABLES)}})


def _hand(rank: int, ws: int, steps: int) -> float:
    from torch.nn.parallel import DistributedDataParallel

    from lightning_rec import shard_modules

    model = shard_modules(_model(), _plan())
    model.head = DistributedDataParallel(model.head)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = list(_Batches(steps, rank))
    start = 0.0
    for i, (kjt, y) in enumerate(batches):
        if i == WARMUP:
            torch.distributed.barrier()
            start = time.perf_counter()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(kjt), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.distributed.barrier()
    return time.perf_counter() - start


def _strategy(rank: int, ws: int, steps: int) -> float:
    import lightning as L

    from lightning_rec import RecShardedStrategy

    class Timer(L.Callback):
        # the same steps as the hand-written loop: from the start of step WARMUP to the end of the last
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == WARMUP:
                torch.distributed.barrier()
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == steps - 1:
                torch.distributed.barrier()
                self.seconds = time.perf_counter() - self.start

    timer = Timer()
    batches = list(_Batches(steps, rank))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=ws,
        strategy=RecShardedStrategy(plan=_plan()),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[timer],
    )
    trainer.fit(_model(), train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    return timer.seconds


def main() -> None:
    from lightning_rec.testing import run_distributed

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    ratios, hand_sps, strat_sps = [], [], []
    for _ in range(args.rounds):
        h = max(run_distributed(_hand, 2, args.steps, timeout_s=600))
        s = max(run_distributed(_strategy, 2, args.steps, init_process_group=False, timeout_s=600))
        hand_sps.append(2 * BATCH * (args.steps - WARMUP) / h)
        strat_sps.append(2 * BATCH * (args.steps - WARMUP) / s)
        ratios.append(s / h)
    lines = [
        "# Strategy overhead (2 gloo CPU processes)",
        "",
        f"Workload: {TABLES} tables x {ROWS:,} rows x {DIM} dims, half table_wise half row_wise, batch {BATCH} per "
        f"rank, ~{IDS} ids per bag, sparse-grad SGD, {args.steps} steps ({WARMUP} untimed warm-up) x {args.rounds} rounds, machine: "
        f"{os.cpu_count()} cores.",
        "",
        "| loop | median samples/s |",
        "|---|---:|",
        f"| hand-written over shard_modules + DDP(head) | {statistics.median(hand_sps):,.0f} |",
        f"| Trainer(strategy=RecShardedStrategy) | {statistics.median(strat_sps):,.0f} |",
        "",
        f"Median per-round time ratio strategy / hand: **{statistics.median(ratios):.3f}** "
        f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)})",
    ]
    text = "\n".join(lines) + "\n"
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "strategy.md")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
