"""Two ranks of a sharded model over gloo; rank 1 exits mid-step, rank 0 raises and ends on its error.

Run as a script by ``test_peer_gone_exit.py``: ``peer_gone_ranks.py RANK PORT OUT``. Rank 0 writes what it
raised to OUT, then exits 1 (``SystemExit``, as a user's script ends on an uncaught error). To make the race
at its exit likely, rank 0 runs on one CPU and every thread but its main one at nice 19: the gloo worker that
completed the failed collective then lets go of its tensors mostly once the main thread sleeps, which, without
the library's exit handler, is often after the interpreter began finalizing (an abort, -6).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from datetime import timedelta
from pathlib import Path

# run as a script from a checkout: the ranks import lightning_rec from it, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from lightning_rec.sharding import ShardingPlan, data_parallel, shard_modules, table_wise

DIES_AT_STEP = 2


def _starve_other_threads() -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    main = threading.get_native_id()
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != main:
            with contextlib.suppress(OSError):  # the thread ended meanwhile
                os.setpriority(os.PRIO_PROCESS, int(tid), 19)


def main(rank: int, port: str, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LIGHTNING_REC_SHM="0")  # gloo only
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    tables = [
        EmbeddingBagConfig(name="whole", num_embeddings=20, embedding_dim=8, feature_names=["a"]),
        EmbeddingBagConfig(name="replicated", num_embeddings=10, embedding_dim=4, feature_names=["b"]),
    ]
    model = shard_modules(
        EmbeddingBagCollection(tables), ShardingPlan({"": {"whole": table_wise(1), "replicated": data_parallel()}})
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    try:
        for step in range(100):
            lengths = torch.randint(0, 3, (2 * 8,), generator=g)
            values = torch.randint(0, 10, (int(lengths.sum()),), generator=g)
            out_ = model(KeyedJaggedTensor(["a", "b"], values, lengths=lengths, stride=8))
            if step == 0 and rank == 0:
                _starve_other_threads()  # every group exists by now
            if step == DIES_AT_STEP and rank == 1:
                os._exit(0)  # rank 0 is then in this step's exchanges
            opt.zero_grad()
            out_.values().pow(2).sum().backward()
            opt.step()
    except RuntimeError as e:  # the peer-gone error
        out.write_text(json.dumps({"error": f"{type(e).__name__}: {e}", "step": step}))
        raise SystemExit(1) from None
    out.write_text(json.dumps({"error": "", "step": step}))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))
