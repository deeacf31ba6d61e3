"""SIGTERM under ``rec_sharded``: every rank stops at the same step, whichever rank the scheduler signalled.

Lightning's own handler broadcasts from inside the signal handler, on the signalled rank only: the other
ranks are in another collective (every sharded lookup is one), so the job hangs. Here the handler only
records the signal (and passes it on to the processes Lightning's launcher started, as Lightning does);
at the start of every training batch the ranks agree on "did any rank get SIGTERM", and all of them stop
before the same batch, raising ``SIGTERMException`` with exit code 143 (a preempted job is not a success).
Checkpoints already written stay as they are (saves are all-or-nothing).

Between the processes of one host the agreement is an all-reduce through shared memory (microseconds): the
ranks stop before the batch after the signal. Through gloo (ranks on several hosts, or the transport off) a
round trip costs about a millisecond and more: there each rank's flag travels asynchronously during a batch
(an all-to-all of one int per rank) and is read at the start of the next one, so the ranks stop one batch
later, and the step does not wait for it.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_rec import transport
from lightning_rec.data.loader import status_group
from lightning_rec.transport import inflight

EXIT_CODE = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM


class AgreedStop:
    """Replaces the SIGTERM handler while installed; :meth:`check` is collective over the world."""

    def __init__(self, launcher: Any = None) -> None:
        self.signalled = False
        self._children = launcher  # Lightning's launcher, when it started this job's other ranks
        # the flags in flight through gloo (every rank sent them at the same batch; read at the next)
        self._pending: tuple[torch.Tensor, Any] | None = None
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if not self.signalled and self._children is not None:
            self._children.kill(signum)  # the ranks Lightning's launcher started get it too
        self.signalled = True  # nothing collective here: the other ranks are busy in their own collectives

    def check(self) -> None:
        """Raise ``SIGTERMException`` on every rank if any rank was signalled: at this call through shared
        memory, else at the call after the one that sent the flags (see the module's docstring)."""
        group = status_group()
        if transport.shared_group(group) is not None:
            flag = torch.tensor([int(self.signalled)], dtype=torch.int64)
            transport.all_reduce_sum(flag, group)
            if int(flag):
                raise SIGTERMException(EXIT_CODE)
            return
        if self._pending is not None:
            flags, work = self._pending
            self._pending = None
            work.wait()
            if bool(flags.any()):
                raise SIGTERMException(EXIT_CODE)
        world = dist.get_world_size(group)
        flags = torch.empty(world, dtype=torch.int64)
        mine = torch.full((world,), int(self.signalled), dtype=torch.int64)
        work = dist.all_to_all_single(flags, mine, group=group, async_op=True)
        self._pending = (flags, inflight.track(work, flags, mine))

    def close(self) -> None:
        """Restore the previous handler; the flags still in flight (sent at the last batch by every rank) are
        waited for, not left running past the fit."""
        if self._pending is not None:
            _, work = self._pending
            self._pending = None
            work.settle()
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
