"""Speeds measured on a job's own data (:class:`ProfiledSpeeds`): per table, fitted from a short profiling run
(``profile.py``), kept in a small JSON file, and given to the planner (``Planner(speeds=...)``).

The default :class:`Hardware` speeds are per byte, whatever the ids: ids that keep hitting a small hot set of
rows cost less than ids spread uniformly over a big table, and the defaults were fitted on one distribution.
A profile holds, for every table it timed, the lookup and update speeds (bytes per second, in the cost model's
own accounting of bytes) that make the model's time of that table equal the measured one. A table the planner
asks about gets, in this order: its own speeds (same name, rows, width, element size and gradients), those of the
profiled tables of its size bucket (factors of 4 in bytes) and pooling (one id per feature or several), those of
the nearest size bucket with its pooling, of the nearest size bucket, else the topology's defaults.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from lightning_rec import _compat
from lightning_rec.configs import BaseEmbeddingConfig
from lightning_rec.plans.planner.topology import Hardware

FORMAT = "lightning_rec.planner_speeds/1"


class SpeedsError(ValueError):
    """A speeds file that cannot be used here (unreadable, another format, another device type)."""


class TableSpeeds(Protocol):
    """What ``inputs.table_stats`` asks of a profile: a table's (lookup, update) speeds in bytes per second."""

    def table_speeds(self, t: BaseEmbeddingConfig, ids: float, grads: str, hw: Hardware) -> tuple[float, float]: ...


def bucket_of(rows: int, dim: int, elem: int, ids: float, features: int) -> tuple[str, int]:
    """(pooling, size bucket): ``"one"`` id per feature and sample or ``"multi"``; ``floor(log4(bytes))``."""
    per_feature = ids / max(features, 1)
    return ("one" if per_feature <= 1.5 else "multi"), math.floor(math.log(max(rows * dim * elem, 1), 4))


@dataclass(frozen=True)
class TableProfile:
    """One profiled table: its shape, its ids per sample in the profiled batches, what was measured (ms per batch
    of ``batch`` samples, the fixed cost of a call taken out) and the speeds fitted to it."""

    name: str
    rows: int
    dim: int
    elem: int
    features: int
    ids: float
    grads: str
    batch: float
    lookup_ms: float  # forward + backward (with fused gradients: the update too)
    update_ms: float  # the optimizer step (0 with fused gradients)
    lookup_bandwidth: float
    update_bandwidth: float

    @property
    def bucket(self) -> tuple[str, int]:
        return bucket_of(self.rows, self.dim, self.elem, self.ids, self.features)


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


@dataclass(frozen=True)
class ProfiledSpeeds:
    """Speeds fitted on one machine from a job's own batches (see the module docstring).

    ``device``: ``"cpu"`` or ``"cuda"``, the type the profile ran on (a file from another type is refused);
    ``intra_host_bandwidth``: measured all-to-alls among the profiling processes of each host (None: profiled
    without a process group, or one process per host; the topology's speed stays); ``collective_latency``: a
    hop's latency (``cost.exchange_latency``) fitted to tiny all-to-alls and ring collectives over every
    profiling process, across the hosts' links where they span ``hosts`` hosts (``fit.fit_latency``; None:
    without a process group); ``step_overhead``: seconds a rank's step spends whatever the plan (the lookups'
    fixed cost, and with a process group what a measured training step took beyond the model's estimate of
    it), added to every estimate; ``processes``: ranks profiling at once, over every host (a host's ranks share
    its memory system, as in training); ``inter_host_bandwidth``: a rank's share of its host's link, fitted to an
    all-to-all over every profiling process on ``hosts`` > 1 hosts (``fit.fit_inter_host``; None: one host).
    """

    device: str
    device_name: str
    machine: str
    versions: Mapping[str, str]
    created: str
    processes: int
    tables: tuple[TableProfile, ...]
    intra_host_bandwidth: float | None = None
    collective_latency: float | None = None
    step_overhead: float = 0.0
    group_scale: float = 1.0  # the grouped step over the per-table sum (for the record)
    hosts: int = 1
    inter_host_bandwidth: float | None = None
    source: str | None = field(default=None, compare=False)  # the file it was read from

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise SpeedsError(f"speeds: device must be 'cpu' or 'cuda', got {self.device!r}")
        for t in self.tables:
            for v in (t.lookup_bandwidth, t.update_bandwidth):
                if not (v > 0 and math.isfinite(v)):
                    raise SpeedsError(f"speeds: table {t.name!r} has a speed that is not a positive number: {v!r}")

    # -- use -------------------------------------------------------------------------------------------------
    def check_device(self, device: str) -> None:
        """Raise :class:`SpeedsError` unless the profile was measured on this device type."""
        if device != self.device:
            where = f" ({self.source})" if self.source else ""
            raise SpeedsError(
                f"speeds{where} were measured on {self.device} ({self.device_name}, {self.machine}); this plan is "
                f"for {device}: profile on a {device} machine (lightning-rec profile --device {device}) or leave "
                "the speeds out"
            )

    def hardware(self, base: Hardware) -> Hardware:
        """``base`` with the exchange speeds this profile measured (the lookups' speeds are per table)."""
        hw = base
        if self.intra_host_bandwidth is not None:
            hw = replace(hw, intra_host_bandwidth=self.intra_host_bandwidth)
        if self.collective_latency is not None:
            hw = replace(hw, collective_latency=self.collective_latency)
        if self.inter_host_bandwidth is not None:
            hw = replace(hw, inter_host_bandwidth=self.inter_host_bandwidth)
        return hw

    def match(self, t: BaseEmbeddingConfig, ids: float, grads: str) -> tuple[str, list[TableProfile]]:
        """How table ``t`` is matched (``"own"``, ``"bucket"``, ``"nearest"``, ``"default"``) and to which tables."""
        assert t.dtype is not None  # resolved by the config's __post_init__
        rows, dim, elem = t.num_embeddings, t.embedding_dim, t.dtype.itemsize
        same = [p for p in self.tables if p.grads == grads]
        own = [p for p in same if (p.name, p.rows, p.dim, p.elem) == (t.name, rows, dim, elem)]
        if own:
            return "own", own[:1]
        if not same:
            return "default", []
        pool, size = bucket_of(rows, dim, elem, ids, len(t.feature_names))
        in_bucket = [p for p in same if p.bucket == (pool, size)]
        if in_bucket:
            return "bucket", in_bucket
        pooled = [p for p in same if p.bucket[0] == pool] or same
        # the nearest size bucket; between two equally near, the larger (slower) one
        best = min(abs(p.bucket[1] - size) - 0.5 * (p.bucket[1] > size) for p in pooled)
        return "nearest", [p for p in pooled if abs(p.bucket[1] - size) - 0.5 * (p.bucket[1] > size) == best]

    def table_speeds(self, t: BaseEmbeddingConfig, ids: float, grads: str, hw: Hardware) -> tuple[float, float]:
        """(lookup, update) bytes per second for table ``t`` (``ids`` per sample, ``grads``)."""
        _, found = self.match(t, ids, grads)
        if not found:
            return hw.lookup_bandwidth, hw.update_bandwidth
        return _geomean([p.lookup_bandwidth for p in found]), _geomean([p.update_bandwidth for p in found])

    def describe(self) -> str:
        where = f"{self.source} " if self.source else ""
        exchange = "measured exchange" if self.collective_latency is not None else "default exchange"
        on = f" on {self.hosts} hosts" if self.hosts > 1 else ""
        if self.inter_host_bandwidth is not None:
            on += f", link {8 * self.inter_host_bandwidth * self.processes / self.hosts / 1e9:.2g} Gbit/s"
        return (
            f"profile {where}({self.machine}, {self.device} {self.device_name}, {self.created[:16]}, "
            f"{len(self.tables)} tables, {self.processes} process(es){on}, {exchange})"
        )

    # -- storage ---------------------------------------------------------------------------------------------
    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("source")
        d["versions"] = dict(self.versions)
        d["tables"] = [asdict(t) for t in self.tables]
        return {"format": FORMAT, **d}

    @staticmethod
    def from_dict(d: Mapping[str, Any], source: str | None = None) -> ProfiledSpeeds:
        where = source or "speeds"
        if not isinstance(d, Mapping) or d.get("format") != FORMAT:
            got = d.get("format") if isinstance(d, Mapping) else type(d).__name__
            raise SpeedsError(f"{where}: not a speeds file of this version (format {got!r}, expected {FORMAT!r})")
        try:
            kw = {k: v for k, v in d.items() if k != "format"}
            kw["tables"] = tuple(TableProfile(**t) for t in kw["tables"])
            return ProfiledSpeeds(**kw, source=source)
        except (KeyError, TypeError) as e:
            raise SpeedsError(f"{where}: malformed speeds file ({e})") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + ".partial")
        tmp.write_text(json.dumps(self.as_dict(), indent=1) + "\n")
        os.replace(tmp, path)

    @staticmethod
    def load(path: str | os.PathLike[str], device: str | None = None) -> ProfiledSpeeds:
        """Read a speeds file; with ``device``, refuse one measured on another device type."""
        try:
            d = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as e:
            raise SpeedsError(f"cannot read speeds file {str(path)!r}: {e.strerror or e}") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SpeedsError(f"{path}: not a JSON speeds file ({e})") from None
        speeds = ProfiledSpeeds.from_dict(d, str(path))
        if device is not None:
            speeds.check_device(device)
        return speeds


def resolve_speeds(speeds: ProfiledSpeeds | str | os.PathLike[str] | None, device: str) -> ProfiledSpeeds | None:
    """A profile given as itself or as a file, checked against the plan's device type."""
    if speeds is None:
        return None
    if not isinstance(speeds, ProfiledSpeeds):
        if not isinstance(speeds, (str, os.PathLike)):
            raise TypeError(f"speeds must be a ProfiledSpeeds or a path to a speeds file, got {type(speeds).__name__}")
        return ProfiledSpeeds.load(speeds, device)
    speeds.check_device(device)
    return speeds


def speeds_label(speeds: ProfiledSpeeds, matched: list[str]) -> str:
    """The report's ``speeds`` setting: the profile, and how many tables got their own speeds, a bucket's, ..."""
    counts = {k: matched.count(k) for k in ("own", "bucket", "nearest", "default") if k in matched}
    return f"{speeds.describe()}; tables: " + ", ".join(f"{v} {k}" for k, v in counts.items())


def machine_info(device: str, device_name: str) -> dict[str, Any]:
    """Where a profile is measured: the machine, the device, the library versions and the time."""
    found = _compat.fbgemm_distribution()
    fbgemm = f"{found[0]} {found[1]}" if found else "none"
    return {
        "device": device,
        "device_name": device_name,
        "machine": platform.node() or "unknown",
        "versions": {
            "lightning_rec": getattr(sys.modules.get("lightning_rec"), "__version__", "unknown"),
            "torch": torch.__version__,
            "fbgemm_gpu": fbgemm,
            "python": platform.python_version(),
        },
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
