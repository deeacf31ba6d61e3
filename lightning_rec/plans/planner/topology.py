"""What a plan is for: the cluster's sizes and memory (:class:`Topology`), its speeds (:class:`Hardware`),
per-table limits (:class:`TableConstraint`), and the planner's error."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

from lightning_rec.configs import ShardingType
from lightning_rec.plans.kinds import ParameterSharding
from lightning_rec.plans.mesh import MeshInfo

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}


def parse_bytes(value: int | float | str | None, what: str = "memory") -> int | None:
    """``"80GB"`` -> 80e9 bytes (SI), ``"64GiB"`` -> 64 * 2**30; ints and floats are bytes; None stays None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a size such as 80GB or 64GiB, got {value!r}")
    if isinstance(value, (int, float)):
        if not value > 0 or not math.isfinite(value):
            raise ValueError(f"{what}: must be a positive number of bytes, got {value!r}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?i?)[bB]?\s*", str(value))
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{what}: expected a size such as 80GB, 64GiB or 1TB, got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


_RATE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(bit|b|B)(?:ps|/s)?\s*")


def parse_rate(value: int | float | str, what: str = "host_link") -> float:
    """A link speed in bytes per second: ``"1gbit"`` (tc's spelling), ``"25Gbit/s"`` or ``"100Gb/s"`` are bits per
    second, ``"12.5GB/s"`` bytes per second (SI prefixes); ints and floats are bytes per second."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a speed such as 1gbit or 12.5GB/s, got {value!r}")
    if isinstance(value, (int, float)):
        if not value > 0 or not math.isfinite(value):
            raise ValueError(f"{what}: must be a positive number of bytes per second, got {value!r}")
        return float(value)
    m = _RATE.fullmatch(str(value))
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{what}: expected a speed such as 1gbit, 100Gb/s or 12.5GB/s, got {value!r}")
    n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    return n if m.group(3) == "B" else n / 8  # "bit" and "b" are bits (as tc and NIC vendors write them)


def human_rate(bytes_per_s: float) -> str:
    """Bytes per second as bits per second, the way links are sold (``1 Gbit/s``)."""
    bits = 8 * bytes_per_s
    for unit, size in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= size:
            return f"{bits / size:.3g} {unit}"
    return f"{bits:.3g} bit/s"


def human_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1 (``2.94 MiB``), for people to read."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_ms(ms: float) -> str:
    """Milliseconds to 0.001 ms, and to two significant digits below that (a GPU's per-table times), never a
    bare ``0.000`` for a time that is not zero."""
    if ms == 0 or abs(ms) >= 0.0005:
        return f"{ms:.3f}"
    return f"{ms:.{1 - math.floor(math.log10(abs(ms)))}f}"


@dataclass(frozen=True)
class Hardware:
    """Speeds the cost model assumes; bandwidths in bytes per second.

    ``lookup_bandwidth``: embedding bytes a lookup processes per second, forward and backward together
    (each id also costs ``lookup_overhead_bytes``); ``update_bandwidth``: bytes per second of an optimizer
    step over rows (weight, gradient, state); ``host_lookup_bandwidth``: lookups of tables kept in host
    memory; ``bucketize_rate``: ids per second a sender sorts into row blocks.
    The CPU / gloo defaults were fitted to ``benchmarks/results/sharding.md``, the lookup and update speeds
    then lowered by a fifth for every rank of a host being busy at once, as in a balanced plan's step (the
    ranks share the memory system: a local step measured 18-49% slower with both ranks of a 2-core host
    running one, ``benchmarks/results/planner.md``); the CUDA / NCCL ones are
    round numbers for a current GPU node (NVLink within a host, a 200 Gb/s NIC per GPU across hosts).
    """

    lookup_bandwidth: float
    update_bandwidth: float
    intra_host_bandwidth: float
    inter_host_bandwidth: float
    host_lookup_bandwidth: float
    bucketize_rate: float
    collective_latency: float
    lookup_overhead_bytes: float = 64.0

    @staticmethod
    def defaults(device: str = "cpu", backend: str | None = None) -> Hardware:
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        backend = backend or ("nccl" if device == "cuda" else "gloo")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if device == "cpu":
            hw = Hardware(3.2e9, 4.8e9, 1e9, 1e9, 3.2e9, 2.7e7, 2e-4)
        else:
            hw = Hardware(1e12, 1.5e12, 1.5e11, 2.5e10, 2e10, 5e9, 3e-5)
        if backend == "gloo" and device == "cuda":  # gloo moves GPU tensors through host memory over TCP
            hw = replace(hw, intra_host_bandwidth=5e9, inter_host_bandwidth=2e9, collective_latency=2e-4)
        return hw


@dataclass(frozen=True)
class Topology:
    """The cluster a plan is for.

    Args:
        world_size: all ranks (``replicas x model_parallel_size``).
        model_parallel_size: ranks of one model-parallel group, the ranks plans speak of (default: world).
        local_size: ranks per host within that group (default: the whole group is one host).
        device_memory: per rank, for tables (weights, optimizer state, gradients, lookup buffers); an int
            in bytes or a string such as ``"80GB"``; None: unlimited.
        host_memory: per host, for tables kept in host memory (looked up at ``host_lookup_bandwidth``);
            None: tables stay in device memory.
        device, backend: pick default ``hardware`` speeds (``"cpu"``/``"gloo"``, ``"cuda"``/``"nccl"``).
        hardware: explicit speeds (see :class:`Hardware`).
        host_link: each host's link to the other hosts, per direction: ``"1gbit"``, ``"100Gb/s"``, ``"12.5GB/s"``
            or bytes per second. Every rank of a host sends across at once in the all-to-alls, so the link is
            shared: it sets ``hardware.inter_host_bandwidth`` to ``host_link / ranks_per_host`` (whatever
            ``hardware`` or the device's defaults said). None: the hardware's own inter-host speed.
        replicas_within_host: the 2D arrangement (``plans/mesh.py``): each host holds whole replica groups and
            each model-parallel group spreads over the hosts; the replicas' sync then stays on a host, and a
            host's link is shared by ``local_size x replicas`` ranks. Default: model parallel within a host.
    """

    world_size: int = 1
    model_parallel_size: int | None = None
    local_size: int | None = None
    device_memory: int | str | None = None
    host_memory: int | str | None = None
    device: str = "cpu"
    backend: str | None = None
    hardware: Hardware | None = None
    host_link: int | float | str | None = None
    replicas_within_host: bool = False

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen: fields resolved once here
        for k in ("world_size", "model_parallel_size", "local_size"):
            v = getattr(self, k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"{k} must be a positive int, got {v!r}")
        mp = self.model_parallel_size or self.world_size
        if self.world_size % mp:
            raise ValueError(f"model_parallel_size={mp} must divide world_size={self.world_size}")
        local = self.local_size or mp
        if mp % local:
            raise ValueError(f"local_size={local} (ranks per host) must divide model_parallel_size={mp}")
        set_("model_parallel_size", mp)
        set_("local_size", local)
        set_("device_memory", parse_bytes(self.device_memory, "device_memory"))
        set_("host_memory", parse_bytes(self.host_memory, "host_memory"))
        if self.hardware is None:
            set_("hardware", Hardware.defaults(self.device, self.backend))
        if self.host_link is not None:
            # from the link itself, not the current speed: replace() runs this again on the result
            link = parse_rate(self.host_link)
            set_("host_link", link)
            # one host: nothing crosses, and its estimates stay those without a link; several, also when the
            # shard group is a whole host: the replicas' sync crosses then
            if self.world_size > self.ranks_per_host:
                shared = link / self.ranks_per_host
                set_("hardware", replace(cast(Hardware, self.hardware), inter_host_bandwidth=shared))

    @property
    def replicas(self) -> int:
        return self.world_size // self.model_parallel_size  # type: ignore[operator]

    @property
    def ranks_per_host(self) -> int:
        """Ranks on one host: a shard group's ``local_size``, times the replicas where they share the host."""
        return self.local_size * (self.replicas if self.replicas_within_host else 1)  # type: ignore[operator]

    @property
    def num_hosts(self) -> int:
        return self.model_parallel_size // self.local_size  # type: ignore[operator]

    @staticmethod
    def from_mesh(mesh: MeshInfo, **kwargs: Any) -> Topology:
        """The topology of a built mesh (world, model-parallel group, ranks per host); ``kwargs`` set the
        other fields (``device_memory``, ``host_memory``, ``device``, ``backend``, ``hardware``, ``host_link``)."""
        kwargs.setdefault("replicas_within_host", mesh.replicas_within_host)
        return Topology(mesh.world_size, mesh.model_parallel_size, mesh.local_size, **kwargs)


@dataclass(frozen=True)
class TableConstraint:
    """Per-table limits: the sharding types the planner may use, or one fixed placement."""

    sharding_types: Sequence[ShardingType | str] | None = None
    placement: ParameterSharding | None = None
    allow_host_memory: bool = True


class PlannerError(ValueError):
    """No plan fits: the message says which tables and how much memory is missing."""
