"""Distributed checkpoints: a torch.distributed.checkpoint (DCP) directory keyed by unsharded names.

Layout of a checkpoint directory::

    <path>/.metadata, <path>/__*_*.distcp    DCP: {"state_dict": {unsharded key: tensor},
                                                   "optimizer_<i>": {"<leaf>/<param name>/<state>": tensor}}
    <path>/meta.pt                          everything else (loops, callbacks, schedulers, hyper-parameters,
                                            optimizer hyper-parameters and the layout of their state, the plan,
                                            a CRC-32 of every stored piece)

Sharded tables and their optimizer state are written as DTensors over the whole table (in row blocks of at
most 32 MiB), so DCP reshards them on load into any world size, 2D layout or plan (one process included);
replicated tensors are written once. On disk a sharded tensor is its pieces with their offsets, the same
format ShardedTensors wrote, so checkpoints from before DTensor state load unchanged. Optimizer state is
keyed by parameter name, never by position, in a plan-independent form (:mod:`lightning_rec.checkpoint.optim_state`).

Modules: ``atomic`` (all-or-nothing writes) and ``collective`` (ranks agreeing; both also used by
:mod:`lightning_rec.export`), ``placement`` (where shards sit), ``optim_state`` (optimizer state by name),
``safe`` (loading without running code), ``storage`` (DCP reader/writer with checksums), ``directory``
(save / load), ``errors``.
"""

from lightning_rec.checkpoint.atomic import resolve
from lightning_rec.checkpoint.directory import (
    FORMAT,
    META_FILE,
    is_checkpoint_dir,
    load,
    read_checkpoint,
    read_meta,
    save,
    write,
)
from lightning_rec.checkpoint.errors import CheckpointError, DiskFullError, UnsafeCheckpointError
from lightning_rec.checkpoint.optim_state import optimizer_state
from lightning_rec.checkpoint.placement import sharding_layout

__all__ = [
    "FORMAT",
    "META_FILE",
    "CheckpointError",
    "DiskFullError",
    "UnsafeCheckpointError",
    "is_checkpoint_dir",
    "load",
    "optimizer_state",
    "read_checkpoint",
    "read_meta",
    "resolve",
    "save",
    "sharding_layout",
    "write",
]
