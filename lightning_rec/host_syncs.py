"""Count the host syncs a piece of code would make on CUDA, on any device (the CPU included).

On a GPU, the host waits for the device whenever it needs a value the device computes: a scalar read
(``.item()``, ``int(t)``, ``bool(t)``), a tensor read into Python (``.tolist()``), and every op whose output
size depends on the data (``nonzero``, ``unique``, ``masked_select``, boolean indexing, ``repeat_interleave``
without ``output_size``, ``bincount``). Each one stops the host from queueing more kernels until the device
catches up: the step becomes host-bound. These are properties of the code, not of the device, so they can be
counted where the code runs on the CPU: :class:`HostSyncCounter` intercepts every op torch dispatches (and
``Tensor.tolist``, which does not dispatch on the CPU) while it is active.

    with HostSyncCounter() as syncs:
        loss = model(batch).sum()
        loss.backward()
    print(syncs.total, syncs.by_op)   # e.g. 3 Counter({'tolist': 2, 'aten._local_scalar_dense': 1})
"""

from __future__ import annotations

import collections
import threading
import traceback
from typing import Any

import torch

from lightning_rec import _compat

_aten = torch.ops.aten
# ops whose output size is read from the data: the host must see the device's result to allocate it
_DATA_DEPENDENT = {
    _aten._local_scalar_dense,
    _aten.nonzero,
    _aten._unique,
    _aten._unique2,
    _aten.unique_dim,
    _aten.unique_consecutive,
    _aten.masked_select,
    _aten.bincount,
    _aten.equal,  # returns a Python bool
    _aten.is_nonzero,
}


# reads of tensors that live on the host on every backend, so never make a device wait: the shared-memory
# transport's (CPU tensors only), the SIGTERM flags (a gloo group's CPU tensors, NCCL or not) and torch optimizers'
# step counters (CPU scalars unless capturable / fused)
_HOST_ONLY = (
    "lightning_rec/transport/shm.py",
    "lightning_rec/transport/wire.py",
    "lightning_rec/lightning/preemption.py",
    "torch/optim/",
)


# frames between the line that reads and this counter (dispatch, dynamo's wrappers)
_MACHINERY = ("lightning_rec/host_syncs.py", "torch/_compile.py", "torch/_dynamo/", "torch/utils/_python_dispatch.py")


class HostSyncCounter(_compat.TorchDispatchMode):
    """Counts, by op, what would make the host wait for a CUDA device while the ``with`` block runs.

    ``by_op``: a Counter of op names (``"tolist"`` for ``Tensor.tolist``); ``total``: their sum.
    ``where=True`` also records, per op, the innermost lightning_rec frame that issued it (``by_site``).
    Only the thread that entered the block is counted, and not reads of tensors that stay on the host on every
    backend (the shared-memory transport's buffers, the SIGTERM flags, torch optimizers' step counters).
    """

    def __init__(self, where: bool = False) -> None:
        super().__init__()
        self.by_op: collections.Counter[str] = collections.Counter()
        self.by_site: collections.Counter[str] = collections.Counter()
        self._where = where
        self._tolist: Any = None
        self._thread = threading.get_ident()

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def _count(self, name: str) -> None:
        stack = traceback.extract_stack()[:-2]
        reader = next((f for f in reversed(stack) if not any(m in f.filename for m in _MACHINERY)), None)
        if reader is not None and any(part in reader.filename for part in _HOST_ONLY):
            return
        self.by_op[name] += 1
        if self._where:
            for frame in reversed(stack):
                if "lightning_rec" in frame.filename and not frame.filename.endswith("host_syncs.py"):
                    self.by_site[f"{name} at {frame.filename.rsplit('lightning_rec/', 1)[-1]}:{frame.lineno}"] += 1
                    break
            else:
                self.by_site[f"{name} outside lightning_rec"] += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in _DATA_DEPENDENT or (
            packet is _aten.repeat_interleave
            and func is not _aten.repeat_interleave.self_int
            and kwargs.get("output_size") is None
        ):
            self._count(str(packet))
        elif packet is _aten.index and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())
        ):
            self._count("aten.index (boolean mask)")
        return func(*args, **kwargs)

    def __enter__(self) -> HostSyncCounter:
        original = torch.Tensor.tolist
        counter = self

        def tolist(t: torch.Tensor) -> Any:
            if threading.get_ident() == counter._thread and t.numel() > 0:
                counter._count("tolist")
            return original(t)

        self._tolist = original
        torch.Tensor.tolist = tolist  # type: ignore[method-assign, assignment]
        self._thread = threading.get_ident()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
