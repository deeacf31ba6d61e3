"""Automatic sharding plans: a cost model of the sharded pipeline and a greedy search over it.

``topology`` (the cluster, its speeds, per-table constraints), ``cost`` (time and memory of a placement),
``terms`` (the same numbers per shard and per host, as the search compares them), ``candidates`` (the places
the sharding kinds may use, scored), ``search`` (the :class:`Planner`), ``checks`` (what it refuses, and the
messages saying why), ``report`` (:class:`PlanReport`), ``auto`` (the planner of the sharding entry points,
and the 2D arrangement it estimates faster),
``speeds`` (:class:`ProfiledSpeeds`, speeds measured on a job's own data) and ``profile`` (the run that measures
them, :func:`profile_speeds`).
"""

from lightning_rec.plans.planner.auto import Arrangement, automatic_plan, choose_arrangement
from lightning_rec.plans.planner.cost import GRADIENTS, MEMORY_PARTS, OPTIMIZER_STATE, TIME_PARTS, CostModel
from lightning_rec.plans.planner.report import PlanReport, TableChoice, placement_label
from lightning_rec.plans.planner.search import PlacedCollection, Planner
from lightning_rec.plans.planner.speeds import ProfiledSpeeds, SpeedsError, TableProfile
from lightning_rec.plans.planner.topology import Hardware, PlannerError, TableConstraint, Topology, parse_bytes

__all__ = [
    "GRADIENTS",
    "MEMORY_PARTS",
    "OPTIMIZER_STATE",
    "TIME_PARTS",
    "Arrangement",
    "CostModel",
    "Hardware",
    "PlacedCollection",
    "PlanReport",
    "Planner",
    "PlannerError",
    "ProfiledSpeeds",
    "SpeedsError",
    "TableChoice",
    "TableConstraint",
    "TableProfile",
    "Topology",
    "automatic_plan",
    "choose_arrangement",
    "parse_bytes",
    "placement_label",
]
