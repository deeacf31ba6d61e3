"""Run a function on N CPU processes (gloo), with every rank's traceback propagated to the caller."""

from __future__ import annotations

import atexit
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.queues import SimpleQueue
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_rec import transport

# what a rank reports when a peer failed first (gloo's closed connections, the shared-memory transport)
_FOLLOWER_ERRORS = ("Connection closed", "remote worker", "left the group")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_job(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple,
    timeout_s: float,
    init: bool,
    per_node: int,
) -> tuple[int, bool, Any]:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % per_node),
        LOCAL_WORLD_SIZE=str(per_node),
        NODE_RANK=str(rank // per_node),
    )
    torch.set_num_threads(1)
    try:
        if init:
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
        # plain pickle copies tensor bytes; the queue's own pickler would pass shared-memory handles
        # that die with this process
        return rank, True, pickle.dumps(fn(rank, world_size, *args))
    except BaseException:
        return rank, False, traceback.format_exc()
    finally:
        transport.close_all()  # peers waiting in a shared-memory collective raise now, as gloo's would
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(rank: int, jobs: SimpleQueue[Any], results: SimpleQueue[Any]) -> None:
    """A pooled rank: runs jobs until told to stop, each from the same clean environment and defaults."""
    environ = dict(os.environ)
    while (job := jobs.get()) is not None:
        os.environ.clear()
        os.environ.update(environ)
        torch.set_default_dtype(torch.float32)
        results.put(_run_job(job[0], rank, *job[1:]))


class _Pool:
    """``world_size`` spawned processes kept between runs: starting one (imports) costs seconds per test."""

    def __init__(self, world_size: int, daemon: bool) -> None:
        ctx = mp.get_context("spawn")
        self.results = ctx.SimpleQueue()
        self.jobs = [ctx.SimpleQueue() for _ in range(world_size)]
        self.procs = [
            ctx.Process(target=_serve, args=(r, self.jobs[r], self.results), daemon=daemon) for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)


_POOLS: dict[tuple[int, bool], _Pool] = {}


@atexit.register
def _close_pools() -> None:
    # registered after multiprocessing's own exit hook, so it runs first: non-daemon ranks would block exit
    while _POOLS:
        _POOLS.popitem()[1].close()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 180.0,
    init_process_group: bool = True,
    ranks_per_node: int | None = None,
    daemon: bool = True,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return results by rank.

    The torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) is set, so a Lightning
    Trainer built inside ``fn`` joins these processes instead of launching its own; pass
    ``init_process_group=False`` to let it create the process group itself. ``ranks_per_node`` pretends
    the processes run on ``world_size / ranks_per_node`` nodes (NODE_RANK, LOCAL_RANK), as two launcher
    invocations on one machine would. ``daemon=False`` lets ``fn`` start processes of its own (DataLoader
    workers).

    The processes are spawned once per (world size, daemon) and reused while runs succeed; each run gets a
    fresh process group, environment and default dtype, and any failure replaces the processes, so a
    failed run never leaks into the next. ``fn`` must be importable (a module-level function). If any rank
    raises, the first failing rank's traceback is raised here as a RuntimeError; a rank that dies or hangs
    is reported instead of waiting.
    """
    key = (world_size, daemon)
    pool = _POOLS.get(key)
    if pool is None or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.close()
        pool = _POOLS[key] = _Pool(world_size, daemon)
    port = _free_port()
    for r in range(world_size):
        pool.jobs[r].put((fn, world_size, port, args, timeout_s, init_process_group, ranks_per_node or world_size))
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s + 30
    while len(results) + len(errors) < world_size:
        if not pool.results.empty():
            rank, ok, payload = pool.results.get()
            (results if ok else errors)[rank] = payload
            continue
        dead = [r for r, p in enumerate(pool.procs) if not p.is_alive() and r not in results and r not in errors]
        if dead or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    if errors or len(results) < world_size:
        del _POOLS[key]
        pool.close()
    if errors:
        # a rank that crashed first makes its peers fail with "connection closed": show the cause first
        order = sorted(errors, key=lambda r: (any(m in errors[r] for m in _FOLLOWER_ERRORS), r))
        text = "\n".join(f"--- rank {r} of {world_size} ---\n{errors[r]}" for r in order)
        raise RuntimeError(f"ranks {order} failed:\n{text}")
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        codes = {r: pool.procs[r].exitcode for r in missing}
        raise RuntimeError(f"ranks {missing} of {world_size} died or timed out (exit codes {codes})")
    return [pickle.loads(results[r]) for r in range(world_size)]
