"""TorchRec's golden training example (examples/golden_training/train_dlrm.py), ported by changing imports.

Only the import block differs from TorchRec's script, plus: ``List[int]`` annotations read ``list[int]`` (this
repository's lint), and the training loop records the losses and can seed the data (for the test in
tests/distributed). Quantized comms stay as TorchRec has them: fp16 / bf16 on NCCL, none on gloo.
Run it on 2 CPU processes with either

    torchrun --nproc_per_node 2 examples/from_torchrec.py
    python examples/from_torchrec.py --spawn 2          # starts the processes itself (gloo)

Add ``--iterations N --num-embeddings R --embedding-dim D`` for a smaller or larger run.
"""

import argparse
import os

import torch
import torch.multiprocessing as mp
from torch import distributed as dist
from torch.utils.data import IterableDataset

# -- the imports: TorchRec's names, from lightning_rec ----------------------------------------------------
from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig  # torchrec.modules.*
from lightning_rec.data import (  # torchrec.datasets.criteo
    DEFAULT_CAT_NAMES,
    DEFAULT_INT_NAMES,
    RandomRecDataset,  # torchrec.datasets.random
)
from lightning_rec.distributed import (  # torchrec.distributed / torchrec.optim
    CommType,
    DistributedModelParallel,
    EmbeddingBagCollectionSharder,
    KeyedOptimizerWrapper,
    QCommsConfig,
    RowWiseAdagrad,
    TrainPipelineSparseDist,
    apply_optimizer_in_backward,
    get_qcomm_codecs_registry,
    in_backward_optimizer_filter,
)
from lightning_rec.models.dlrm import DLRM, DLRMTrain  # torchrec.models.dlrm


def _get_random_dataset(
    num_embeddings: int,
    batch_size: int = 32,
    seed: int | None = None,
) -> IterableDataset:
    return RandomRecDataset(
        keys=DEFAULT_CAT_NAMES,
        batch_size=batch_size,
        hash_size=num_embeddings,
        ids_per_feature=1,
        num_dense=len(DEFAULT_INT_NAMES),
        manual_seed=seed,
    )


def train(
    num_embeddings: int = 1024**2,
    embedding_dim: int = 128,
    dense_arch_layer_sizes: list[int] | None = None,
    over_arch_layer_sizes: list[int] | None = None,
    learning_rate: float = 0.1,
    num_iterations: int = 1000,
    seed: int | None = None,
) -> list[float]:
    """Construct and train a DLRM on random data, SPMD on every rank; returns this rank's losses."""
    if dense_arch_layer_sizes is None:
        dense_arch_layer_sizes = [64, embedding_dim]
    if over_arch_layer_sizes is None:
        over_arch_layer_sizes = [64, 1]

    # Init process_group , device, rank, backend
    rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device: torch.device = torch.device(f"cuda:{rank}")
        backend = "nccl"
        torch.cuda.set_device(device)
    else:
        device: torch.device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)

    # Construct DLRM module
    eb_configs = [
        EmbeddingBagConfig(
            name=f"t_{feature_name}",
            embedding_dim=embedding_dim,
            num_embeddings=num_embeddings,
            feature_names=[feature_name],
        )
        for feature_idx, feature_name in enumerate(DEFAULT_CAT_NAMES)
    ]
    dlrm_model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=eb_configs, device=torch.device("meta")),
        dense_in_features=len(DEFAULT_INT_NAMES),
        dense_arch_layer_sizes=dense_arch_layer_sizes,
        over_arch_layer_sizes=over_arch_layer_sizes,
        dense_device=device,
    )
    train_model = DLRMTrain(dlrm_model)

    apply_optimizer_in_backward(
        RowWiseAdagrad,
        train_model.model.sparse_arch.parameters(),
        {"lr": learning_rate},
    )
    qcomm_codecs_registry = (
        get_qcomm_codecs_registry(
            qcomms_config=QCommsConfig(
                forward_precision=CommType.FP16,
                backward_precision=CommType.BF16,
            )
        )
        if backend == "nccl"
        else None
    )
    sharder = EmbeddingBagCollectionSharder(qcomm_codecs_registry=qcomm_codecs_registry)

    model = DistributedModelParallel(
        module=train_model,
        device=device,
        sharders=[sharder],
    )

    non_fused_optimizer = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=learning_rate),
    )
    # TorchRec overlaps comm/compute/device transfer here; lightning_rec's pipeline runs the steps in order
    train_pipeline = TrainPipelineSparseDist(
        model,
        non_fused_optimizer,
        device,
    )

    # train model
    train_iterator = iter(
        _get_random_dataset(
            num_embeddings=num_embeddings,
            seed=None if seed is None else seed + dist.get_rank(),
        )
    )
    losses = []
    for _ in range(int(num_iterations)):
        loss, _logits, _labels = train_pipeline.progress(train_iterator)
        losses.append(float(loss))
    return losses


def _spawned(rank: int, world_size: int, port: int, kwargs: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    losses = train(**kwargs)
    if rank == 0:
        print(f"rank 0: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spawn", type=int, default=0, help="start this many gloo processes (no torchrun)")
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--num-embeddings", type=int, default=1024**2)
    parser.add_argument("--embedding-dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    kwargs = dict(
        num_embeddings=args.num_embeddings,
        embedding_dim=args.embedding_dim,
        num_iterations=args.iterations,
        seed=args.seed,
    )
    if args.spawn:
        port = 29500 + os.getpid() % 1000
        mp.spawn(_spawned, args=(args.spawn, port, kwargs), nprocs=args.spawn)
    else:
        losses = train(**kwargs)
        if dist.get_rank() == 0:
            print(f"rank 0: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
