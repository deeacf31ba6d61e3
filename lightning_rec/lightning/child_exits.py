"""Ranks that Lightning's launcher started: their exit codes reach the launching process's exit code.

With ``python train.py`` and ``devices=N``, Lightning's launcher starts ranks 1..N-1 from rank 0 and watches
them only while rank 0 runs (from a daemon thread). A rank that failed after rank 0 finished (an abort at exit,
an error in its last write) went unnoticed: a scheduler reading the job's exit code saw rank 0's alone. Here
rank 0, on its way out, waits for the ranks it started (up to a minute; one still running then is killed) and,
if one failed, names it and exits non-zero. Ranks the launcher itself stopped (after an error on rank 0, or a
SIGTERM) are not reported: the job already ends with that error.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from typing_extensions import override

from lightning_rec import _compat

WAIT_S = 60.0
_launchers: list[Any] = []


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was ended by {signal.Signals(-code).name}"
        except ValueError:
            return f"was ended by signal {-code}"
    return f"exited with code {code}"


def report_children(wait_s: float = WAIT_S) -> list[str]:
    """Wait for the ranks this process's launchers started; return one line per rank that failed."""
    if getattr(sys, "last_value", None) is not None:
        return []  # this process is failing with its own error; the ranks see its connections close
    failed: list[str] = []
    deadline = time.monotonic() + wait_s
    for launcher in _launchers:
        if getattr(launcher, "stopped_children", False):
            continue
        for local_rank, proc in enumerate(getattr(launcher, "procs", []), start=1):
            try:
                code = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                failed.append(
                    f"local rank {local_rank} (pid {proc.pid}) was still running {wait_s:.0f} s after this one"
                )
                continue
            if code != 0:
                failed.append(f"local rank {local_rank} (pid {proc.pid}) {_describe(code)}")
    return failed


def _at_exit() -> None:
    failed = report_children()
    if failed:
        sys.stdout.flush()
        print(
            "lightning_rec: this job's other processes did not all succeed after this one finished: "
            + "; ".join(failed)
            + ". Exiting with code 1 (their output above says why)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)  # an exit handler cannot change the exit code otherwise


def _watch(launcher: Any) -> None:
    if not _launchers:
        # registered before the process group exists, so it runs after the handlers that close it
        atexit.register(_at_exit)
    if not any(seen is launcher for seen in _launchers):
        _launchers.append(launcher)


class TrainerLauncher(_compat.TrainerPopenLauncher):
    """Lightning's Trainer popen launcher, reporting ranks that fail after rank 0 finished."""

    stopped_children = False  # the launcher stopped its ranks itself (after an error on rank 0, or a SIGTERM)

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        _watch(self)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def kill(self, signum: Any) -> None:
        self.stopped_children = True
        super().kill(signum)


class FabricLauncher(_compat.FabricPopenLauncher):
    """Lightning Fabric's popen launcher, reporting ranks that fail after rank 0 finished (Fabric's launcher has
    no ``kill``: nothing stops its ranks but their own exit)."""

    @override
    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        _watch(self)
        return super().launch(function, *args, **kwargs)


def reporting(launcher: Any) -> Any:
    """``launcher`` as its reporting subclass where it is Lightning's popen launcher; otherwise unchanged."""
    for lightning_cls, ours in (
        (_compat.TrainerPopenLauncher, TrainerLauncher),
        (_compat.FabricPopenLauncher, FabricLauncher),
    ):
        if type(launcher) is lightning_cls:
            replacement = ours.__new__(ours)
            replacement.__dict__.update(launcher.__dict__)
            return replacement
    return launcher
