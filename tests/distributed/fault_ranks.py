"""Two ranks under a parent that does not reap them; rank 1 dies, rank 0 reports what it saw.

Run as a script by ``test_faults.py``: ``fault_ranks.py SCENARIO OUT``. Scenarios:

- ``zombie``: rank 1 exits between two sharded forwards and stays a zombie; rank 0 writes the error of its
  second forward, how long it took, rank 1's process state then, and its groups' timeouts.
- ``setup_after_create`` / ``setup_after_connect``: rank 1 is SIGKILLed inside the shared-memory transport's
  set-up (once its memory files exist / once it opened rank 0's); rank 0 writes its error and how many
  memory files it still holds.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

# run as a script from a checkout: the ranks import lightning_rec from it, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

WORLD_TIMEOUT_S = 60


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0].decode()
    except OSError:
        return "gone"


def _setup_kill(rank: int, out: str, moment: str) -> None:
    import gc
    import signal

    import torch

    from lightning_rec import transport
    from lightning_rec.transport import shm

    if rank == 1:

        def die(method):
            def wrapped(self, *args):
                method(self, *args)
                os.kill(os.getpid(), signal.SIGKILL)

            return wrapped

        if moment == "after_create":
            shm._SharedGroup.__init__ = die(shm._SharedGroup.__init__)
        else:
            shm._SharedGroup.connect = die(shm._SharedGroup.connect)
    error = ""
    try:
        transport.all_reduce_sum(torch.ones(4), None)
    except Exception as e:  # what the user would see
        error = f"{type(e).__name__}: {e}"
    gc.collect()
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            held += shm._PREFIX in os.readlink(f"/proc/self/fd/{fd}")
    _write(out, {"error": error, "open_memory_files": held, "killed_at": moment})


def _write(out: str, result: dict) -> None:
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.rename(out + ".tmp", out)
    os._exit(0)


def _rank(rank: int, port: int, out: str, peer_pid, scenario: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
    )
    import torch
    import torch.distributed as dist

    from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, _compat, transport
    from lightning_rec.plans.mesh import init_2d_mesh
    from lightning_rec.sharding import ShardingPlan, row_wise, shard_modules

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=WORLD_TIMEOUT_S))
    if scenario.startswith("setup_"):
        _setup_kill(rank, out, scenario.removeprefix("setup_"))
    mesh = init_2d_mesh(2, 1)
    tables = [EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=4, feature_names=["f"])]
    model = shard_modules(EmbeddingBagCollection(tables), ShardingPlan({"": {"t": row_wise()}}))
    kjt = KeyedJaggedTensor(["f"], torch.tensor([1, 7]), lengths=torch.tensor([1, 1]))
    model(kjt)
    timeouts = [_compat.group_timeout(g).total_seconds() for g in (model.shard_group, mesh.shard_group)]
    shared = transport.shared_group(model.shard_group) is not None
    if rank == 1:
        os._exit(3)  # dies without leaving the group; its parent does not reap it
    while _state(peer_pid.value) not in ("Z", "gone"):
        time.sleep(0.01)
    was = _state(peer_pid.value)
    t0 = time.monotonic()
    try:
        model(kjt)
        error = ""
    except Exception as e:  # what the user would see
        error = f"{type(e).__name__}: {e}"
    result = {
        "elapsed_s": time.monotonic() - t0,
        "error": error,
        "peer_state": was,
        "timeouts": timeouts,
        "shared": shared,
    }
    _write(out, result)


def main(scenario: str, out: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    peer_pid = ctx.Value("i", 0)
    procs = [ctx.Process(target=_rank, args=(r, port, out, peer_pid, scenario)) for r in range(2)]
    for p in procs:
        p.start()
    peer_pid.value = procs[1].pid
    # no join, no is_alive (both reap): the dead rank stays a zombie while rank 0 waits for it
    deadline = time.monotonic() + 3 * WORLD_TIMEOUT_S
    while not os.path.exists(out) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
