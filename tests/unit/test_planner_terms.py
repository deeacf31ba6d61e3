"""The planner's fast scoring (``planner/terms.py``) against the straightforward one, on random small inputs.

The search scores placements from per-shard and per-host terms, computes the per-shard values of many tables
at once and on distinct shard sizes only, and skips host-memory twins that cannot matter. The reference
here scores every candidate from the cost model's full per-part loads (``CostModel.of_placement``), every
twin included, with the per-rank arrays the planner used before: the plans, reports and estimates must be
the same, number for number.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_rec import EmbeddingBagConfig, EmbeddingConfig
from lightning_rec.plans.kinds import KINDS
from lightning_rec.plans.planner import OPTIMIZER_STATE
from lightning_rec.plans.planner.candidates import Candidate, in_host_memory
from lightning_rec.plans.planner.terms import Terms, load_of, placement_terms, prepare, whole
from lightning_rec.plans.planner.topology import human_bytes
from lightning_rec.sharding import (
    Planner,
    PlannerError,
    ShardingType,
    TableConstraint,
    Topology,
    column_wise,
    data_parallel,
    grid_shard,
    row_wise,
    table_row_wise,
    table_wise,
)

LAYOUTS = [(1, 1), (2, 1), (4, 2), (8, 4), (12, 3), (16, 8), (96, 6), (130, 13), (256, 8)]


class ReferencePlanner(Planner):
    """The planner with every number from full per-part loads: nothing batched, skipped or compressed."""

    def _prepare(self, stats, units) -> None:
        pass

    def _base_size(self, stats, unit):
        key = tuple(unit)
        if key not in self._base:
            only_dp = self._allowed(stats, unit) == [ShardingType.DATA_PARALLEL]
            load = self._unit_load(stats, unit, data_parallel() if only_dp else table_wise(0), False)
            self._base[key] = (load.mem.sum(), load.time.sum())
        return self._base[key]

    def _candidates(self, stats, unit, allowed, tot, used):
        pairs = super()._candidates(stats, unit, allowed, tot, used)
        out = []
        for c, host in pairs:
            c.load = self._unit_load(stats, unit, c.sharding, False)
            c.terms = whole(c.load)
            if host is not None:
                host.sharding = in_host_memory(c.sharding)
                host.load = self._unit_load(stats, unit, c.sharding, True)
                host.terms = whole(host.load)
            out.append((c, host))
        return out

    def _twins(self, stats, unit, pairs, mode):
        hosts = [h for _, h in pairs if h is not None]
        return [(len(pairs) + j, h) for j, h in enumerate(hosts)]

    def _score(self, cands: list[tuple[int, Candidate]], tot, used, host_used, remaining, mode, added) -> None:
        topo = self.topology
        budget = np.inf if topo.device_memory is None else topo.device_memory
        host_budget = np.inf if topo.host_memory is None else topo.host_memory
        for n, c in cands:
            time, mem, host = c.load.time.sum(0), c.load.mem.sum(0), c.load.host
            c.new = new = (tot + added(c)) + time  # the latency its type adds, as the search charges it
            over, host_over = used + mem - budget, host_used + host - host_budget
            c.fits = bool((over <= 0).all() and (host_over <= 0).all())
            if not c.fits:
                r = int(np.argmax(over)) if over.max() > 0 else None
                c.short = (
                    f"does not fit: rank {r} would need {human_bytes(used[r] + mem[r])} of "
                    f"{human_bytes(budget)} ({human_bytes(over[r])} short)"
                    if r is not None
                    else f"does not fit: host {int(np.argmax(host_over))} short of host memory by "
                    f"{human_bytes(host_over.max())}"
                )
            projected = max(new.max(), (new.sum() + max(remaining, 0.0)) / len(new))
            if mode == "time":
                c.key = (projected, new.sum(), n)
            else:
                c.key = ((used + mem).max() / (budget if np.isfinite(budget) else 1.0), projected, n)


@st.composite
def cases(draw):
    n = draw(st.integers(1, 10))
    rows = st.sampled_from([1, 7, 100, 999, 5_000, 200_000, 3_000_000])
    dims = draw(st.sampled_from([(16, 32, 64), (32, 64, 128, 256), (4, 8, 16)]))
    sequence = draw(st.booleans())
    tables = []
    for i in range(n):
        cls = EmbeddingConfig if sequence else EmbeddingBagConfig
        tables.append(
            cls(
                draw(rows),
                draw(st.sampled_from(dims)),
                f"t {i}",
                [f"f{i}", f"g{i}"][: draw(st.integers(1, 2))],
                dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
            )
        )
    pooling = {f: draw(st.sampled_from([0.0, 1.0, 3.0, 20.0, 50.0])) for t in tables for f in t.feature_names}
    mp, local = draw(st.sampled_from(LAYOUTS))
    replicas = draw(st.sampled_from([1, 1, 2]))
    need = sum(t.num_embeddings * t.embedding_dim * 12 for t in tables)
    memory = draw(st.sampled_from([None, int(need / mp * 1.5) + 10**5, int(need / mp * 0.6) + 10**5]))
    host = draw(st.sampled_from([None, need // 3 + 10**6, 10 * need + 10**6]))
    topo = Topology(
        mp * replicas, mp, local, device_memory=memory, host_memory=host, device=draw(st.sampled_from(["cpu", "cuda"]))
    )
    constraints = {}
    if n > 2 and draw(st.booleans()):
        constraints[tables[0].name] = TableConstraint(
            sharding_types=[
                draw(st.sampled_from(["table_wise", "row_wise", "column_wise", "data_parallel", "table_row_wise"]))
            ]
        )
        constraints[tables[1].name] = TableConstraint(allow_host_memory=False)
    together = [[tables[-1].name, tables[-2].name]] if n > 3 and draw(st.booleans()) else []
    kw = dict(
        batch_size=draw(st.sampled_from([1, 64, 512])),
        pooling_factors=pooling,
        optimizer=draw(st.sampled_from(sorted(OPTIMIZER_STATE))),
        gradients=draw(st.sampled_from(["dense", "sparse", "fused"])),
        constraints=constraints,
        together=together,
        min_column_width=draw(st.sampled_from([4, 16, 32])),
    )
    return tables, topo, kw


def _outcome(planner: Planner, tables):
    try:
        planner.plan(tables)
    except PlannerError as e:
        return str(e)
    rep = planner.explain()
    return (rep.plan.plan, [c.as_dict() for c in rep.tables], rep.time, rep.memory, rep.host_memory, rep.notes)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_plans_equal_the_reference_scoring(case) -> None:
    tables, topo, kw = case
    fast, ref = _outcome(Planner(topo, **kw), tables), _outcome(ReferencePlanner(topo, **kw), tables)
    if isinstance(ref, str) or isinstance(fast, str):
        assert fast == ref
        return
    assert fast[0] == ref[0]  # the plan
    assert fast[1] == ref[1]  # every table's choice, cost, runner-up and reason
    for a, b in zip(fast[2:5], ref[2:5]):
        np.testing.assert_array_equal(a, b)  # per-rank estimates, bit for bit
    assert fast[5] == ref[5]


def _random_placement(draw, t, mp, local):
    hosts = mp // local
    widths = [k for k in (2, 4) if t.embedding_dim % k == 0 and k <= mp]
    options = [table_wise(draw(st.integers(0, mp - 1))), row_wise(), data_parallel()]
    if widths:
        k = draw(st.sampled_from(widths))
        options.append(column_wise(draw(st.permutations(range(mp)))[:k]))
    if hosts > 1:
        options.append(table_row_wise(draw(st.integers(0, hosts - 1))))
        if t.embedding_dim % 2 == 0:
            options.append(grid_shard(draw(st.permutations(range(hosts)))[:2]))
    return draw(st.sampled_from(options))


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_terms_equal_the_cost_models_loads(data) -> None:
    # one placement's terms, computed alone or batched with other tables, equal its full load exactly
    mp, local = data.draw(st.sampled_from(LAYOUTS))
    topo = Topology(mp * data.draw(st.sampled_from([1, 3])), mp, local, device="cuda")
    planner = Planner(
        topo,
        batch_size=data.draw(st.sampled_from([1, 96])),
        optimizer=data.draw(st.sampled_from(sorted(OPTIMIZER_STATE))),
    )
    grads = data.draw(st.sampled_from(["dense", "sparse", "fused"]))
    tables = [
        EmbeddingBagConfig(data.draw(st.sampled_from([1, 5, 130, 4_099, 10**6])), 8, f"t{i}", [f"f{i}"])
        for i in range(3)
    ]
    stats = [planner._stats("", t, grads) for t in tables]
    placements = [_random_placement(data.draw, t, mp, local) for t in tables]
    for ps in placements:
        KINDS[ps.sharding_type].tiling(tables[0], ps, mp, local)  # valid
    model = planner._model
    if data.draw(st.booleans()):
        prepare(model, list(zip(stats, placements)))
    for s, ps in zip(stats, placements):
        device, host = placement_terms(model, s, ps, both=True)
        for offload, terms in ((False, device), (True, host)):
            if ps.sharding_type == ShardingType.DATA_PARALLEL and offload:
                continue
            ref = model.of_placement(s, ps, offload)
            got = load_of(model, terms, model.empty() if data.draw(st.booleans()) else None)
            for a, b in ((got.time, ref.time), (got.mem, ref.mem), (got.host, ref.host)):
                np.testing.assert_array_equal(a, b, err_msg=f"{ps} offload={offload}")
            _check_sums(terms, ref, model.M, local)


def _check_sums(terms: Terms, ref, M: int, local: int) -> None:
    tot = np.linspace(0.0, 1e-3, M)
    np.testing.assert_array_equal(terms.time_after(tot, local), tot + ref.time.sum(0))
    np.testing.assert_array_equal(terms.mem_on(M), ref.mem.sum(0))
    np.testing.assert_array_equal(terms.host_on(len(ref.host)), ref.host)
