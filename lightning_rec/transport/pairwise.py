"""Exchanges through torch.distributed as point-to-point messages, every receive posted before any send.

Why not gloo's all-to-all: it posts, peer after peer, a send and then a receive, and its TCP pairs write a
message only once the receiver has announced a buffer for it, an announcement that travels on the same
connection as the data going the other way. A rank that reaches the exchange later than its peer finds the
peer's announcement waiting and writes its whole message at once; its own announcement then queues behind
those bytes, and the peer's message starts only once they have crossed. On a slow link the two directions
then run one after the other instead of side by side: on 2 simulated hosts at 1 Gbit/s, 1.7 MB each way
between two pairs of ranks took 36 ms (peers 5 ms apart) and 50 ms (20 ms apart) by all-to-all, 28 and 35 ms
received first (``docs/ARCHITECTURE.md``, "What crosses between hosts"). Posting every receive first sends
every announcement ahead of any data. Only the peers that exchange bytes take part: none with zero bytes
either way (both sides know the sizes), so a sparse exchange (each rank one peer per other host) sends no
empty messages.

CPU tensors only (gloo): on NCCL, receives issued one by one ahead of the sends would each hold the stream
until its peer sends, and both peers would wait on each other. Messages are bytes (``uint8``): one
contiguous buffer per peer and direction. The works are waited by the
caller (:func:`wait_all`) before any of those buffers is reused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def start(
    sends: Sequence[torch.Tensor | None], recvs: Sequence[torch.Tensor | None], group: dist.ProcessGroup | None
) -> list[dist.Work]:
    """Receive each ``recvs[s]`` from group rank ``s``, then send each ``sends[d]`` to group rank ``d`` (1-D
    contiguous byte tensors; empty ones, None and this rank's own are skipped): the works, in flight."""
    me = dist.get_rank(group)
    works = [
        dist.irecv(t, group=group, group_src=s) for s, t in enumerate(recvs) if s != me and t is not None and t.numel()
    ]
    works += [
        dist.isend(t, group=group, group_dst=d) for d, t in enumerate(sends) if d != me and t is not None and t.numel()
    ]
    return [w for w in works if w is not None]


def wait_all(works: list[dist.Work]) -> None:
    for w in works:
        w.wait()
