"""The search: tables (or groups kept together) largest first, each where the estimated step time of the
slowest rank grows least (ties: less total work, then the earlier candidate), among placements that fit
every rank's memory. Deterministic for the same inputs.

Which placements are tried for a table is each sharding kind's business (``plans/kinds.py``); this
module scores them with the cost model and keeps the best.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import cast

import numpy as np
from torch import nn

from lightning_rec.configs import BaseEmbeddingConfig, ShardingType
from lightning_rec.plans.kinds import KINDS, ParameterSharding, placement_of
from lightning_rec.plans.plan import ShardingPlan, data_parallel, resolve_table, table_wise
from lightning_rec.plans.planner.candidates import Candidate, Probes, Space, divisors, in_host_memory, score, why
from lightning_rec.plans.planner.checks import check_fixed, check_fused, check_names, check_total, no_candidate, no_fit
from lightning_rec.plans.planner.cost import GRADIENTS, OPTIMIZER_STATE, CostModel, Load, TableStats, exchange_latency
from lightning_rec.plans.planner.inputs import PlacedCollection, plan_entries, table_stats
from lightning_rec.plans.planner.report import PlanReport, TableChoice, placement_label
from lightning_rec.plans.planner.speeds import ProfiledSpeeds, resolve_speeds, speeds_label
from lightning_rec.plans.planner.terms import load_of, placement_terms, prepare, whole
from lightning_rec.plans.planner.topology import PlannerError, TableConstraint, Topology
from lightning_rec.plans.shard_geometry import ShardMeta


class Planner:
    """Chooses a sharding plan by estimated step time, within memory budgets.

    Args:
        topology: the cluster (:class:`Topology`); default one CPU rank.
        batch_size: samples per rank per step.
        pooling_factors: ``{feature name: mean ids per sample}``; others use ``default_pooling_factor``.
        optimizer: kind of the embedding optimizer, which fixes its state size (see ``OPTIMIZER_STATE``); or
            ``{table name: kind}`` for tables with their own optimizers (the others: ``"sgd"``).
        gradients: ``"dense"``, ``"sparse"`` or ``"fused"`` (updated inside backward; data_parallel is
            then only used where a constraint allows it); or ``{table name: one of those}`` for some tables;
            default: each collection's ``sparse_grad``, dense for bare table lists.
        constraints: ``{table name: TableConstraint}`` (allowed types, a fixed placement).
        together: groups of table names that get one placement together (same type and ranks).
        min_column_width: narrowest column shard considered for column_wise / grid_shard.
        speeds: a :class:`ProfiledSpeeds` or the path of its JSON file (``lightning-rec profile``): speeds measured
            on the job's own data, per table, and of the exchange; default: the topology's :class:`Hardware`.

    ``plan(model or tables)`` returns a ``ShardingPlan``; ``explain()`` the last :class:`PlanReport`;
    ``estimate(model or tables, plan)`` the same report for any given plan.
    """

    def __init__(
        self,
        topology: Topology | None = None,
        *,
        batch_size: int = 512,
        pooling_factors: Mapping[str, float] | None = None,
        default_pooling_factor: float = 1.0,
        optimizer: str | Mapping[str, str] = "sgd",
        gradients: str | Mapping[str, str] | None = None,
        constraints: Mapping[str, TableConstraint] | None = None,
        together: Sequence[Sequence[str]] = (),
        min_column_width: int = 32,
        speeds: ProfiledSpeeds | str | os.PathLike[str] | None = None,
    ) -> None:
        topology = topology if topology is not None else Topology()
        self.speeds = resolve_speeds(speeds, topology.device)
        if self.speeds is not None:
            topology = replace(topology, hardware=self.speeds.hardware(topology.hardware))  # type: ignore[arg-type]
        self.topology = topology
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int (samples per rank per step), got {batch_size!r}")
        per_table = dict(optimizer) if isinstance(optimizer, Mapping) else {}
        for name, kind in [("<default>", "sgd" if per_table else optimizer), *per_table.items()]:
            if kind not in OPTIMIZER_STATE:
                raise ValueError(f"table {name}: unknown optimizer {kind!r}; expected one of {list(OPTIMIZER_STATE)}")
        table_grads = dict(gradients) if isinstance(gradients, Mapping) else {}
        for name, g in [("<default>", None if table_grads else gradients), *table_grads.items()]:
            if g is not None and g not in GRADIENTS:
                raise ValueError(f"table {name}: gradients must be one of {GRADIENTS} or None, got {g!r}")
        self.pooling_factors = dict(pooling_factors or {})
        for f, v in [("<default>", default_pooling_factor), *self.pooling_factors.items()]:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"pooling factor of feature {f!r} must be a number >= 0 (ids per sample), got {v!r}")
        self.batch_size, self.default_pooling_factor = batch_size, float(default_pooling_factor)
        self.optimizer = "sgd" if per_table else cast(str, optimizer)
        self.gradients = None if table_grads else cast("str | None", gradients)
        self.table_optimizers, self.table_gradients = per_table, table_grads
        self.constraints = dict(constraints or {})
        for name, c in self.constraints.items():
            if not isinstance(c, TableConstraint):
                raise TypeError(f"constraint for table {name!r} must be a TableConstraint, got {type(c).__name__}")
            for st in c.sharding_types or ():
                ParameterSharding(st)  # raises naming the valid types
        self.together = [list(g) for g in together]
        self.min_column_width = min_column_width
        self._model = CostModel(self.topology, batch_size)
        self._last: PlanReport | None = None
        self._base: dict[tuple[int, ...], tuple[float, float]] = {}
        self._kinds: dict[tuple[int, ...], list[ShardingType]] = {}
        self._scratch: Load | None = None

    # -- inputs --------------------------------------------------------------------------------------------
    def _entries(
        self, model_or_tables: nn.Module | Sequence[BaseEmbeddingConfig]
    ) -> list[tuple[str, BaseEmbeddingConfig, str, list[ShardMeta] | None]]:
        entries = plan_entries(model_or_tables, self.gradients)
        return [(p, t, self.table_gradients.get(t.name, g), s) for p, t, g, s in entries]

    def _optimizer_of(self, table: str) -> str:
        return self.table_optimizers.get(table, self.optimizer)

    def _stats(self, path: str, t: BaseEmbeddingConfig, grads: str) -> TableStats:
        kind = self._optimizer_of(t.name)
        pf, default = self.pooling_factors, self.default_pooling_factor
        return table_stats(path, t, grads, self.topology, kind, pf, default, self.speeds)

    def _settings(self, stats: list[TableStats]) -> dict:
        settings = {
            "batch_size": self.batch_size,
            "default_pooling_factor": self.default_pooling_factor,
            "optimizer": self.optimizer if not self.table_optimizers else f"per table {self.table_optimizers}",
            "gradients": self.gradients
            or (f"per table {self.table_gradients}" if self.table_gradients else None)
            or "per collection",
            "min_column_width": self.min_column_width,
        }
        if self.speeds is not None:  # the defaults go unnamed, as before profiles existed
            settings["speeds"] = speeds_label(
                self.speeds, [self.speeds.match(s.config, s.ids, s.grads)[0] for s in stats]
            )
        return settings

    def _report(self, stats: list[TableStats], choices: list[TableChoice], load: Load, notes: list[str]) -> PlanReport:
        plan: dict[str, dict[str, ParameterSharding]] = {}
        for s, c in zip(stats, choices):
            plan.setdefault(s.path, {})[s.config.name] = c.sharding
        latency = self._latency({ShardingType(c.sharding.sharding_type).value for c in choices})
        latency += self.speeds.step_overhead if self.speeds is not None else 0.0
        settings = self._settings(stats)
        return PlanReport(
            ShardingPlan(plan), choices, self.topology, settings, load.time, load.mem, load.host, latency, notes
        )

    def _latency(self, kinds: set[str]) -> float:
        lat = self.topology.hardware.collective_latency  # type: ignore[union-attr]
        return exchange_latency(kinds, self.topology.world_size, lat)

    # -- public ----------------------------------------------------------------------------------------------
    def estimate(
        self, model_or_tables: nn.Module | Sequence[BaseEmbeddingConfig], plan: ShardingPlan | None = None
    ) -> PlanReport:
        """The cost model's report for ``plan`` (default: the placement of ``model``'s sharded collections)."""
        M, L = self.topology.model_parallel_size, self.topology.local_size
        assert M is not None and L is not None  # resolved by Topology.__post_init__
        entries = self._entries(model_or_tables)
        total = self._model.empty()
        choices, stats = [], []
        for path, t, grads, shards in entries:
            s = self._stats(path, t, grads)
            if plan is not None:
                mod = plan.get_plan_for_module(path)
                if mod is None or t.name not in mod:
                    raise ValueError(f"the plan has no entry for table {t.name!r} of module {path!r}")
                ps = mod[t.name]
                shards = resolve_table(t, ps, M, L)  # type: ignore[arg-type]
            elif shards is None and not self._is_sharded(model_or_tables, path):
                raise ValueError(f"table {t.name!r} of module {path!r} is not sharded; pass the plan to estimate")
            load = self._model.of_shards(s, shards)
            total += load
            ps = plan.plan[path][t.name] if plan is not None else placement_of(shards, M, L)
            choices.append(self._choice(s, ps, load, False, fixed=True))
            stats.append(s)
        return self._report(stats, choices, total, [])

    @staticmethod
    def _is_sharded(model: nn.Module | Sequence[BaseEmbeddingConfig], path: str) -> bool:
        return hasattr(model, "get_submodule") and isinstance(model.get_submodule(path), PlacedCollection)

    def plan(self, model_or_tables: nn.Module | Sequence[BaseEmbeddingConfig]) -> ShardingPlan:
        """A plan for every unsharded collection of ``model`` (or for a list of table configs, module ``""``)."""
        entries = [e for e in self._entries(model_or_tables) if e[3] is None]
        self._last = self._plan([self._stats(p, t, g) for p, t, g, _ in entries])
        return self._last.plan

    def explain(self) -> PlanReport:
        """The report of the last :meth:`plan` call."""
        if self._last is None:
            raise RuntimeError("explain() describes the last plan: call plan(...) first")
        return self._last

    # -- search ----------------------------------------------------------------------------------------------
    def _choice(
        self, s: TableStats, ps: ParameterSharding, load: Load, offload: bool, fixed: bool = False
    ) -> TableChoice:
        per_rank = load.mem[:3].sum(0) + load.mem[3]
        t = load.time.sum(0)
        return TableChoice(
            s.path,
            s.config.name,
            ps,
            float(per_rank.max()) + float(load.host.max(initial=0)),
            float(per_rank.sum() + load.host.sum()),
            float(1e3 * t.max()),
            offload,
            fixed,
        )

    def _units(self, stats: list[TableStats]) -> list[list[int]]:
        by_name: dict[str, list[int]] = {}
        for i, s in enumerate(stats):
            by_name.setdefault(s.config.name, []).append(i)
        seen: dict[int, int] = {}
        units = []
        for g, group in enumerate(self.together):
            members = [i for n in group for i in by_name.get(n, [])]
            for i in members:
                if i in seen:
                    raise ValueError(
                        f"table {stats[i].config.name!r} is in two 'together' groups: "
                        f"{self.together[seen[i]]} and {group}"
                    )
                seen[i] = g
            units.append(sorted(members))
        units += [[i] for i in range(len(stats)) if i not in seen]
        return units

    def _allowed(self, stats: list[TableStats], unit: list[int]) -> list[ShardingType]:
        key = tuple(unit)
        if key not in self._kinds:
            self._kinds[key] = self._allowed_kinds(stats, unit)
        return self._kinds[key]

    def _allowed_kinds(self, stats: list[TableStats], unit: list[int]) -> list[ShardingType]:
        allowed = list(ShardingType)
        for i in unit:
            c = self.constraints.get(stats[i].config.name)
            if c is not None and c.sharding_types is not None:
                mine = {ParameterSharding(x).sharding_type for x in c.sharding_types}
                allowed = [a for a in allowed if a in mine]
            # fused data-parallel copies each look up the whole world's batch (the union), a cost not modelled
            # here: never chosen automatically (a plan or a constraint may still ask for it)
            if stats[i].grads == "fused" and not (c is not None and c.sharding_types is not None):
                allowed = [a for a in allowed if a != ShardingType.DATA_PARALLEL]
        if not allowed:
            names = [stats[i].config.name for i in unit]
            raise PlannerError(
                f"tables {names}: no sharding type is allowed by their constraints"
                + (
                    " (data_parallel is excluded with fused gradients)"
                    if any(stats[i].grads == "fused" for i in unit)
                    else ""
                )
            )
        return allowed

    def _unit_load(self, stats: list[TableStats], unit: list[int], ps: ParameterSharding, offload: bool) -> Load:
        if len(unit) == 1:
            return self._model.of_placement(stats[unit[0]], ps, offload)
        total = self._model.empty()
        for i in unit:
            total += self._model.of_placement(stats[i], ps, offload)
        return total

    def _unit_loads(self, stats: list[TableStats], unit: list[int], ps: ParameterSharding) -> tuple[Load, Load]:
        """The unit's load with its tables in device memory and in host memory, computed together."""
        if len(unit) == 1:
            return self._model.of_placement(stats[unit[0]], ps, both=True)
        device, host = self._model.empty(), self._model.empty()
        for i in unit:
            d, h = self._model.of_placement(stats[i], ps, both=True)
            device += d
            host += h
        return device, host

    def _base_size(self, stats: list[TableStats], unit: list[int]) -> tuple[float, float]:
        """The memory and work summed over every rank and part of the unit's table-wise load (data-parallel where
        that is all it may be): its size for ordering."""
        key = tuple(unit)
        if key not in self._base:
            only_dp = self._allowed(stats, unit) == [ShardingType.DATA_PARALLEL]
            ps = data_parallel() if only_dp else table_wise(0)
            if len(unit) == 1:
                load = load_of(self._model, placement_terms(self._model, stats[unit[0]], ps), self._scratch)
            else:
                load = self._unit_load(stats, unit, ps, False)
            self._base[key] = (load.mem.sum(), load.time.sum())
        return self._base[key]

    def _widths(self, stats: list[TableStats], unit: list[int]) -> list[int]:
        """Numbers of column shards the unit's widths allow."""
        if any(stats[i].state[1] for i in unit):
            return []  # per-row optimizer state over a column shard is not the full row's: never split columns
        dims = [stats[i].dim for i in unit]
        # fbgemm's fused kernel takes only pieces a multiple of 4 wide (F6): other splits would be refused
        fused = any(stats[i].grads == "fused" for i in unit)
        return [
            k
            for k in divisors(math.gcd(*dims))
            if k > 1 and min(dims) // k >= self.min_column_width and not (fused and any(d // k % 4 for d in dims))
        ]

    def _prepare(self, stats: list[TableStats], units: list[list[int]]) -> None:
        """The per-shard values of every single table's placements (its candidates' shapes, on probe ranks and
        hosts, and its table-wise base), computed together for all tables."""
        topo = self.topology
        items = []
        for unit in units:
            if len(unit) == 1:
                allowed = self._allowed(stats, unit)
                space = Probes(topo, self._widths(stats, unit))
                s = stats[unit[0]]
                items += [(s, ps) for st in allowed for ps in KINDS[st].candidates(space)]
                items.append((s, table_wise(0)))
        prepare(self._model, items)

    def _candidates(
        self, stats: list[TableStats], unit: list[int], allowed: list[ShardingType], tot: np.ndarray, used: np.ndarray
    ) -> list[tuple[Candidate, Candidate | None]]:
        """The unit's placements in device memory, each with its twin in host memory (None: not allowed); the
        terms of a single table's twins are left for :meth:`_twins` to compute where they can matter."""
        topo = self.topology
        budget = np.inf if topo.device_memory is None else topo.device_memory
        space = Space(self._model, topo, [stats[i] for i in unit], self._widths(stats, unit), tot, budget - used)
        offload = topo.host_memory is not None and all(
            self.constraints.get(stats[i].config.name, TableConstraint()).allow_host_memory for i in unit
        )
        out = []
        for ps in (ps for st in allowed for ps in KINDS[st].candidates(space)):
            c = Candidate(ps)
            both = offload and c.kind != ShardingType.DATA_PARALLEL
            host = Candidate(None, True) if both else None  # type: ignore[arg-type]  # its placement once needed
            if len(unit) == 1:
                c.terms = placement_terms(self._model, stats[unit[0]], ps)
            elif both:  # tables kept together: their summed per-part loads
                host.sharding = in_host_memory(ps)  # type: ignore[union-attr]
                c.load, host.load = self._unit_loads(stats, unit, ps)  # type: ignore[union-attr]
                c.terms, host.terms = whole(c.load), whole(host.load)  # type: ignore[union-attr]
            else:
                c.load = self._unit_load(stats, unit, ps, False)
                c.terms = whole(c.load)
            out.append((c, host))
        return out

    def _twins(
        self, stats: list[TableStats], unit: list[int], pairs: list[tuple[Candidate, Candidate | None]], mode: str
    ) -> list[tuple[int, Candidate]]:
        """The host-memory twins that can be chosen or be the runner-up, with their index among all candidates.

        Looking up in host memory is never faster (``host_lookup_bandwidth <= lookup_bandwidth``): a twin's
        per-rank time is then at least its device placement's, element for element, so placing by time it
        can only win, or be the runner-up, where that placement does not fit, or where no other sharding type
        competes. Elsewhere its terms are skipped: the choices and runner-ups are those of scoring it.
        """
        hw = self.topology.hardware
        every = (
            mode != "time"
            or hw.host_lookup_bandwidth > hw.lookup_bandwidth  # type: ignore[union-attr]
            or len({c.kind for c, _ in pairs}) < 2
        )
        out: list[tuple[int, Candidate | None]] = []
        for c, host in pairs:
            if host is None:
                continue
            if host.terms is None and (every or not c.fits):
                host.terms = placement_terms(self._model, stats[unit[0]], c.sharding, host_only=True)
                host.sharding = in_host_memory(c.sharding)
            if host.terms is not None:
                out.append((len(pairs) + len(out), host))  # the index it has among all candidates
            else:
                out.append((len(pairs) + len(out), None))
        return [(n, h) for n, h in out if h is not None]

    def _score(
        self, cands: list, tot: np.ndarray, used: np.ndarray, host: np.ndarray, rem: float, mode: str, added: Callable
    ) -> None:
        for extra in {added(c) for _, c in cands}:  # against the totals plus the latency its type adds
            score([x for x in cands if added(x[1]) == extra], self.topology, tot + extra, used, host, rem, mode)

    def _plan(self, stats: list[TableStats]) -> PlanReport:
        check_names(stats, self.pooling_factors, self.constraints, self.together)
        check_fused(stats)
        self._base = {}
        self._kinds = {}  # the sharding types each unit may use
        self._scratch = self._model.empty()  # per-part arrays filled and read within one step, not kept
        topo, model = self.topology, self._model
        total = model.empty()
        choices: list[TableChoice | None] = [None] * len(stats)
        notes: list[str] = []
        units = []
        for unit in self._units(stats):
            fixed = [i for i in unit if self.constraints.get(stats[i].config.name, TableConstraint()).placement]
            if fixed:
                for i in unit:
                    c = self.constraints.get(stats[i].config.name)
                    if c is None or c.placement is None:
                        raise ValueError(
                            f"table {stats[i].config.name!r} is kept together with tables that have a "
                            "fixed placement: give it the same placement"
                        )
                    check_fixed(self.topology, self._optimizer_of(stats[i].config.name), stats[i], c.placement)
                    load = model.of_placement(stats[i], c.placement)
                    total += load
                    choices[i] = self._choice(stats[i], c.placement, load, False, fixed=True)
            elif unit:
                units.append(unit)
        self._prepare(stats, units)
        check_total(self.topology, stats, [(float(self._base_size(stats, u)[0]), u) for u in units], total)
        if topo.replicas > 1 and any(s.grads == "fused" for s in stats):
            notes.append(
                "fused tables under replica groups look up the union of the replicas' batches; the "
                "estimates do not include that extra lookup"
            )
        failures = []
        for mode in ("time", "memory"):
            # a second pass places by memory balance when the time-first pass leaves a table without room
            best: PlanReport | None = None
            # uncharged, no table pays an exchange's latency; charged, none starts one only many repay: keep the faster
            for charge in (False, True) if mode == "time" else (False,):
                trial = Load(total.time.copy(), total.mem.copy(), total.host.copy())
                trial_choices = list(choices)
                failure = self._greedy(stats, units, trial, trial_choices, mode, charge)
                if failure is not None:
                    failures.append(failure)
                    break
                # _greedy set every entry
                report = self._report(stats, cast(list[TableChoice], trial_choices), trial, list(notes))
                if best is None or report.step_time_ms < best.step_time_ms:
                    best = report
            if best is not None and not (mode == "time" and failures):
                if mode == "memory":
                    best.notes.append("placed by memory balance: placing by time first left a table without room")
                return best
        raise PlannerError(failures[0])

    def _order(self, stats: list[TableStats], units: list[list[int]]) -> tuple[list[list[int]], list[float]]:
        """Units largest first (memory and work shares), and each one's least total work (its table-wise cost)."""
        mem, work = [], []
        for unit in units:
            m, w = self._base_size(stats, unit)
            mem.append(m)
            work.append(w)
        mem_a, work_a = np.array(mem), np.array(work)
        size = mem_a / max(mem_a.sum(), 1e-30) + work_a / max(work_a.sum(), 1e-30)
        order = np.lexsort((np.arange(len(units)), -size))
        return [units[i] for i in order], [float(work_a[i]) for i in order]

    def _greedy(
        self, stats: list[TableStats], units: list[list[int]], total: Load, choices: list, mode: str, charge: bool
    ) -> str | None:
        ordered, work = self._order(stats, units)
        remaining = float(sum(work))
        present = {c.sharding.sharding_type.value for c in choices if c is not None}
        for unit, own_work in zip(ordered, work):
            remaining -= own_work
            allowed = self._allowed(stats, unit)
            tot, used = total.time.sum(0), total.mem.sum(0)
            pairs = self._candidates(stats, unit, allowed, tot, used)
            base = self._latency(present) if charge else 0.0
            added = lambda c, b=base: self._latency(present | {c.kind.value}) - b if charge else 0.0  # noqa: E731
            self._score(list(enumerate(c for c, _ in pairs)), tot, used, total.host, remaining, mode, added)
            twins = self._twins(stats, unit, pairs, mode)
            self._score(twins, tot, used, total.host, remaining, mode, added)
            cands = [c for c, _ in pairs] + [h for _, h in twins]
            if not cands:
                raise PlannerError(no_candidate(self.topology, self.min_column_width, stats, unit, allowed))
            fitting = sorted((c for c in cands if c.fits), key=lambda c: c.key)
            if not fitting:
                return no_fit(self.topology, stats, unit, cands, total, sum(x is not None for x in choices))
            best = fitting[0]
            present.add(best.kind.value)
            if best.load is None:  # the candidates of one table carry only sums over the parts
                assert best.terms is not None
                best.load = load_of(self._model, best.terms, self._scratch)
            total += best.load
            # the runner-up is the best other sharding type; another placement of the same type only if none
            others = sorted((c for c in cands if c is not best), key=lambda c: (c.kind == best.kind, not c.fits, c.key))
            for i in unit:
                # a unit of one table: its load is the candidate's
                own = best.load if len(unit) == 1 else self._model.of_placement(stats[i], best.sharding, best.offload)
                ch = self._choice(stats[i], best.sharding, own, best.offload)
                if others:
                    ru = others[0]
                    ch.runner_up = placement_label(ru.sharding) + (" [host mem]" if ru.offload else "")
                    ch.rejected_because = ru.short if not ru.fits else why(best, ru)
                else:
                    ch.rejected_because = "the only allowed placement"
                choices[i] = ch
        return None
