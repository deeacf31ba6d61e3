"""The fit of the planner's speeds to a profiling run's timings (``profile.py`` measures them): pure functions."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_rec.configs import BaseEmbeddingConfig
from lightning_rec.plans.plan import ShardingPlan, data_parallel, table_wise
from lightning_rec.plans.planner.cost import SHARDED_COLLECTIVES, exchange_latency
from lightning_rec.plans.planner.search import Planner
from lightning_rec.plans.planner.speeds import ProfiledSpeeds, TableProfile
from lightning_rec.plans.planner.topology import Hardware, Topology

_FLOOR = 0.1  # the least share of a measured time kept as work when the fixed cost is taken out


@dataclass
class TableTiming:
    """Seconds per batch of one table (``*_tiny``: on one sample), and what the batches held."""

    name: str
    rows: int
    dim: int
    elem: int
    features: int
    ids: float  # ids per sample
    batch: float  # samples per batch
    grads: str
    state: tuple[int, int]
    lookup_s: float  # forward + backward (fused: with the update)
    update_s: float  # the optimizer step (fused: 0)
    lookup_tiny_s: float
    update_tiny_s: float


@dataclass
class Timings:
    """What one profiling run measured (seconds), before the fit."""

    tables: list[TableTiming]
    group_s: float  # all tables together, per batch
    group_tiny_s: float
    processes: int = 1  # every profiling rank, over all hosts
    hosts: int = 1
    # all-to-alls among the ranks of each host (None: one rank per host)
    a2a_tiny_s: float | None = None
    a2a_big_s: float | None = None
    a2a_bytes: float | None = None  # bytes each rank sent the other ranks of its host in the big all-to-all
    # over every rank, 8 bytes: an all-to-all, and the data-parallel sync's two all-gathers and all-reduce
    latency_a2a_s: float | None = None
    latency_ring_s: float | None = None
    step_s: float | None = None  # a training step of the whole job, table-wise round-robin, the slowest rank
    step_mixed_s: float | None = None  # the same under reference_mixed_plan (small tables data-parallel)
    # over every rank on several hosts: an all-to-all of a step's pooled rows per peer, and that size
    world_a2a_big_s: float | None = None
    world_a2a_peer_bytes: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def fit_speeds(timings: Timings, hw: Hardware, info: Mapping[str, Any]) -> ProfiledSpeeds:
    """The speeds that make the cost model's times equal the measured ones (see the module docstring).

    A table's work is its time less its one-sample time (at least ``_FLOOR`` of it), scaled by the grouped
    step's work over the tables' summed work. Lookup speed = the bytes the model counts for the batch's lookups
    over that work; update likewise; with fused gradients (one time for both) the two keep the ratio of ``hw``'s.
    """
    work = []
    for t in timings.tables:
        wl = max(t.lookup_s - t.lookup_tiny_s, _FLOOR * t.lookup_s)
        wu = max(t.update_s - t.update_tiny_s, _FLOOR * t.update_s)
        work.append((wl, wu))
    total = sum(wl + wu for wl, wu in work)
    group_work = max(timings.group_s - timings.group_tiny_s, _FLOOR * timings.group_s)
    scale = group_work / total if total > 0 and group_work > 0 else 1.0
    profiles = []
    for t, (wl, wu) in zip(timings.tables, work):
        wl, wu = wl * scale, wu * scale
        ids = t.ids * t.batch
        if ids <= 0 or wl <= 0:
            continue  # nothing looked up: no speed to fit
        lookup_bytes = ids * (t.dim * t.elem + hw.lookup_overhead_bytes)
        row_bytes = 2 * t.dim * t.elem + 4 * (t.state[0] * t.dim + t.state[1])
        update_bytes = t.rows * (row_bytes + t.dim * t.elem) if t.grads == "dense" else ids * row_bytes
        if t.grads == "fused" or wu <= 0:
            k = (lookup_bytes / hw.lookup_bandwidth + update_bytes / hw.update_bandwidth) / (wl + wu)
            lookup_bw, update_bw = hw.lookup_bandwidth * k, hw.update_bandwidth * k
        else:
            lookup_bw, update_bw = lookup_bytes / wl, update_bytes / wu
        profiles.append(
            TableProfile(
                t.name,
                t.rows,
                t.dim,
                t.elem,
                t.features,
                t.ids,
                t.grads,
                t.batch,
                1e3 * t.lookup_s,
                1e3 * t.update_s,
                lookup_bw,
                update_bw,
            )
        )
    intra = None
    if timings.a2a_tiny_s is not None and timings.a2a_big_s is not None and timings.a2a_bytes:
        # at least a share of the big one's time is its bytes': within a host on shared memory its bytes can take
        # less than the noise of the tiny one, which would make the speed unbounded
        intra = timings.a2a_bytes / max(timings.a2a_big_s - timings.a2a_tiny_s, _FLOOR * timings.a2a_big_s)
    latency = fit_latency(timings.latency_a2a_s, timings.latency_ring_s, timings.processes)
    return ProfiledSpeeds(
        info["device"],
        info["device_name"],
        info["machine"],
        dict(info["versions"]),
        info["created"],
        timings.processes,
        tuple(profiles),
        intra,
        latency,
        timings.group_s - group_work,
        scale,
        timings.hosts,
        fit_inter_host(timings, intra or hw.intra_host_bandwidth),
    )


def fit_inter_host(timings: Timings, intra_host_bandwidth: float) -> float | None:
    """The cost model's ``inter_host_bandwidth`` (what one rank gets of its host's link while every rank of the
    host sends across, as in the all-to-alls) fitted to the all-to-all over every rank on several hosts: its
    time less the tiny one's and less what stayed on the host, over the bytes each rank sent to other hosts.
    None: one host, or not measured."""
    t, peer = timings.world_a2a_big_s, timings.world_a2a_peer_bytes
    if timings.hosts <= 1 or t is None or not peer:
        return None
    per_host = timings.processes // timings.hosts
    within = (per_host - 1) * peer / intra_host_bandwidth
    cross = (timings.processes - per_host) * peer
    return cross / max(t - (timings.latency_a2a_s or 0.0) - within, _FLOOR * t)


def fit_latency(a2a_s: float | None, ring_s: float | None, world: int) -> float | None:
    """The cost model's ``collective_latency`` (seconds a hop waits, ``cost.exchange_latency``) fitted to a tiny
    all-to-all (``log2(world)`` hops in the model) and the data-parallel sync's tiny ring collectives
    (``4 (world - 1)`` hops) over ``world`` ranks: the model's latency of a step running both kinds (its
    ``SHARDED_COLLECTIVES`` all-to-alls and one sync) equals the measured one. Either alone: its own hops."""
    if world <= 1 or (a2a_s is None and ring_s is None):
        return None
    hops_a2a, hops_ring = max(1.0, math.log2(world)), 4.0 * (world - 1)
    if ring_s is None:
        return a2a_s / hops_a2a  # type: ignore[operator]
    if a2a_s is None:
        return ring_s / hops_ring
    return (SHARDED_COLLECTIVES * a2a_s + ring_s) / (SHARDED_COLLECTIVES * hops_a2a + hops_ring)


def reference_plan(tables: Sequence[BaseEmbeddingConfig], world: int) -> ShardingPlan:
    """The plan of the profile's training step: the tables table-wise, round-robin over the ranks."""
    return ShardingPlan({"": {t.name: table_wise(i % world) for i, t in enumerate(tables)}})


def reference_mixed_plan(tables: Sequence[BaseEmbeddingConfig], world: int) -> ShardingPlan | None:
    """The plan of the profile's second training step: the smaller half of the tables (by rows x width)
    data-parallel, the rest table-wise round-robin, as plans that spare small tables the all-to-alls are;
    None with under two tables."""
    if len(tables) < 2 or world <= 1:
        return None
    by_size = sorted(tables, key=lambda t: t.num_embeddings * t.embedding_dim)
    small = {t.name for t in by_size[: len(tables) // 2]}
    big = [t for t in tables if t.name not in small]
    placed = {t.name: table_wise(i % world) for i, t in enumerate(big)}
    return ShardingPlan({"": {t.name: data_parallel() if t.name in small else placed[t.name] for t in tables}})


def calibrate_step(
    speeds: ProfiledSpeeds,
    tables: Sequence[BaseEmbeddingConfig],
    step_s: float,
    world: int,
    batch_size: int,
    pooling_factors: Mapping[str, float],
    optimizer: str,
    gradients: str,
    *,
    step_mixed_s: float | None = None,
    local_size: int | None = None,
    hardware: Hardware | None = None,
) -> ProfiledSpeeds:
    """``speeds`` with the fixed cost per step (``step_overhead``) that makes the model's estimate of
    :func:`reference_plan` equal its measured step ``step_s``: what the pipeline spends whatever the plan
    (building and splitting the batch's features, starting and waiting for its exchanges), which the byte counts
    leave out. Never below the lookups' own fixed cost, measured alone.

    With ``step_mixed_s`` (:func:`reference_mixed_plan`'s measured step) the latency per hop too: the one that
    makes the model's extra time of the mixed plan's data-parallel sync (its ``4 (world - 1)`` ring hops) what
    the two measured steps say, where that is more than the tiny collectives measured alone (``speeds``'s): in
    a step the sync's collectives also wait for the slowest rank to arrive. The topology is ``world`` ranks,
    ``local_size`` to a host (default: one host), at ``hardware``'s speeds (default: the device's)."""
    zero = replace(speeds, step_overhead=0.0)
    if step_mixed_s is not None:
        zero = replace(zero, collective_latency=0.0)

    def estimate(plan: ShardingPlan) -> float:
        planner = Planner(
            Topology(world, local_size=local_size, hardware=hardware),
            batch_size=batch_size,
            pooling_factors=pooling_factors,
            optimizer=optimizer,
            gradients=gradients,
            speeds=zero,
        )
        return planner.estimate(list(tables), plan).step_time_ms / 1e3

    left = step_s - estimate(reference_plan(tables, world))
    mixed = reference_mixed_plan(tables, world)
    if step_mixed_s is None or mixed is None:
        return replace(speeds, step_overhead=max(speeds.step_overhead, left))
    hops = exchange_latency({"table_wise"}, world, 1.0)  # the all-to-alls' hops, in both plans
    ring = exchange_latency({"table_wise", "data_parallel"}, world, 1.0) - hops
    in_step = (step_mixed_s - estimate(mixed) - left) / ring
    latency = max(speeds.collective_latency or 0.0, in_step)
    return replace(speeds, collective_latency=latency, step_overhead=max(speeds.step_overhead, left - hops * latency))
