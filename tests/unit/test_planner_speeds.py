"""Profile-guided speeds: the fit from timings, the JSON file and its refusals, the planner using the speeds,
and the profiling run's plumbing (no wall-clock assertions: only that it measured something and fitted it)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from lightning_rec import EmbeddingBagConfig, KeyedJaggedTensor
from lightning_rec.plans.planner import Hardware, Planner, ProfiledSpeeds, SpeedsError, TableProfile, Topology
from lightning_rec.plans.planner.auto import automatic_plan
from lightning_rec.plans.planner.cost import SHARDED_COLLECTIVES, exchange_latency
from lightning_rec.plans.planner.fit import (
    TableTiming,
    Timings,
    calibrate_step,
    fit_latency,
    fit_speeds,
    reference_mixed_plan,
    reference_plan,
)
from lightning_rec.plans.planner.profile import profile_speeds, take
from lightning_rec.sharding import ShardingPlan, data_parallel, table_wise

HW = Hardware.defaults("cpu")
INFO = {"device": "cpu", "device_name": "test CPU", "machine": "box", "versions": {"torch": "x"}, "created": "2026"}


def _timing(name: str, grads: str = "sparse", **kw) -> TableTiming:
    base = dict(
        name=name,
        rows=1000,
        dim=16,
        elem=4,
        features=1,
        ids=2.0,
        batch=100.0,
        grads=grads,
        state=(0, 0),
        lookup_s=1.1e-3,
        update_s=0.6e-3,
        lookup_tiny_s=0.1e-3,
        update_tiny_s=0.1e-3,
    )
    base.update(kw)
    return TableTiming(**base)


def test_fit_gives_the_speeds_that_reproduce_the_measured_work() -> None:
    t = _timing("a")
    # the grouped step's work is the table's (1 ms lookup + 0.5 ms update): no scaling
    sp = fit_speeds(Timings([t], group_s=1.5e-3 + 2e-4, group_tiny_s=2e-4), HW, INFO)
    (p,) = sp.tables
    ids = 200
    assert math.isclose(p.lookup_bandwidth, ids * (16 * 4 + HW.lookup_overhead_bytes) / 1e-3)
    assert math.isclose(p.update_bandwidth, ids * (2 * 16 * 4) / 0.5e-3)
    assert math.isclose(sp.step_overhead, 2e-4) and math.isclose(sp.group_scale, 1.0)
    assert sp.intra_host_bandwidth is None and sp.collective_latency is None
    # a grouped step doing the same work in half the time: every table twice as fast
    fast = fit_speeds(Timings([t], group_s=0.75e-3 + 2e-4, group_tiny_s=2e-4), HW, INFO)
    assert math.isclose(fast.tables[0].lookup_bandwidth, 2 * p.lookup_bandwidth)
    assert math.isclose(fast.group_scale, 0.5)


def test_fit_of_fused_tables_keeps_the_default_ratio_and_measures_the_exchange() -> None:
    t = _timing("a", grads="fused", update_s=0.0, update_tiny_s=0.0)
    timings = Timings([t], 1e-3, 0.0, processes=2, a2a_tiny_s=1e-4, a2a_big_s=1.1e-3, a2a_bytes=1e6, latency_a2a_s=1e-4)
    (p,) = fit_speeds(timings, HW, INFO).tables
    assert math.isclose(p.lookup_bandwidth / p.update_bandwidth, HW.lookup_bandwidth / HW.update_bandwidth)
    ids = 200
    modelled = ids * (64 + HW.lookup_overhead_bytes) / p.lookup_bandwidth + ids * 128 / p.update_bandwidth
    assert math.isclose(modelled, 1e-3)  # the measured time less the one-sample time
    sp = fit_speeds(timings, HW, INFO)
    assert sp.collective_latency == 1e-4 and math.isclose(sp.intra_host_bandwidth, 1e6 / 1e-3)  # type: ignore[arg-type]


def test_latency_fit_makes_a_step_of_both_kinds_take_what_was_measured() -> None:
    # 4 ranks: an all-to-all is 2 hops in the cost model, the data-parallel sync 12 ring hops
    lat = fit_latency(3e-3, 10e-3, 4)
    assert lat is not None
    both = exchange_latency({"table_wise", "data_parallel"}, 4, lat)
    assert math.isclose(both, SHARDED_COLLECTIVES * 3e-3 + 10e-3)
    # one kind measured: its own hops; one rank: nothing crosses
    assert fit_latency(None, 12e-3, 4) == 1e-3 and fit_latency(2e-3, None, 4) == 1e-3
    assert fit_latency(2e-3, None, 2) == 2e-3 and fit_latency(1e-3, 1e-3, 1) is None
    timings = Timings([_timing("a")], 2e-3, 0.0, processes=4, hosts=2, latency_a2a_s=3e-3, latency_ring_s=10e-3)
    sp = fit_speeds(timings, HW, INFO)
    assert sp.collective_latency == lat and sp.hosts == 2 and sp.intra_host_bandwidth is None
    assert "4 process(es) on 2 hosts, measured exchange" in sp.describe()


def test_profiled_latency_reaches_the_data_parallel_sync_across_hosts() -> None:
    tables = [EmbeddingBagConfig(100, 16, f"t{i}", [f"f{i}"]) for i in range(4)]
    topo = Topology(4, 4, 2, host_link="1gbit")
    dp = ShardingPlan({"": {t.name: data_parallel() for t in tables}})
    tw = ShardingPlan({"": {t.name: table_wise(i) for i, t in enumerate(tables)}})
    est = {}
    for lat in (1e-4, 1.2e-3):
        sp = _profile(collective_latency=lat, hosts=2)
        planner = Planner(topo, batch_size=512, gradients="sparse", speeds=sp)
        assert planner.topology.hardware.collective_latency == lat  # type: ignore[union-attr]
        # the host link still sets the speed across hosts; the profile only its latency
        assert planner.topology.hardware.inter_host_bandwidth == 1.25e8 / 2  # type: ignore[union-attr]
        est[lat] = {k: planner.estimate(tables, p).latency_s for k, p in (("dp", dp), ("tw", tw))}
    # the sync's 12 ring hops and the all-to-alls' 6 x 2 are charged the profiled latency
    assert math.isclose(est[1.2e-3]["dp"] - est[1e-4]["dp"], 12 * 1.1e-3)
    assert math.isclose(est[1.2e-3]["tw"] - est[1e-4]["tw"], SHARDED_COLLECTIVES * 2 * 1.1e-3)


def test_calibration_on_a_mixed_step_finds_the_latency_its_sync_waits() -> None:
    tables = [EmbeddingBagConfig(100 * (i + 1), 16, f"t{i}", [f"f{i}"]) for i in range(4)]
    pooling = {f"f{i}": 1.0 for i in range(4)}
    sp = _profile(collective_latency=2e-4, step_overhead=1e-4)
    zero = dataclasses.replace(sp, collective_latency=0.0, step_overhead=0.0)
    topo = Topology(4, local_size=2)
    planner = Planner(topo, batch_size=512, pooling_factors=pooling, gradients="sparse", speeds=zero)
    mixed = reference_mixed_plan(tables, 4)
    assert mixed is not None
    kinds = {n: ps.sharding_type.value for n, ps in mixed.plan[""].items()}
    assert kinds == {"t0": "data_parallel", "t1": "data_parallel", "t2": "table_wise", "t3": "table_wise"}
    tw, mx = (planner.estimate(tables, p).step_time_ms / 1e3 for p in (reference_plan(tables, 4), mixed))
    # steps that waited 1.5 ms a hop (12 all-to-all hops; the sync 12 more) and 3 ms whatever the plan
    step, step_mixed = tw + 12 * 1.5e-3 + 3e-3, mx + 24 * 1.5e-3 + 3e-3
    args = (tables, step, 4, 512, pooling, "sgd", "sparse")
    got = calibrate_step(sp, *args, step_mixed_s=step_mixed, local_size=2)
    assert math.isclose(got.collective_latency, 1.5e-3) and math.isclose(got.step_overhead, 3e-3)  # type: ignore[arg-type]
    # a sync no slower than the tiny collectives alone: their latency stays
    got = calibrate_step(sp, *args, step_mixed_s=mx + 12 * 1.5e-3 + 3e-3, local_size=2)
    assert got.collective_latency == 2e-4 and math.isclose(got.step_overhead, 3e-3 + 12 * 1.5e-3 - 12 * 2e-4)
    assert reference_mixed_plan(tables[:1], 4) is None


def test_intra_host_speed_is_bounded_when_the_big_exchange_is_lost_in_noise() -> None:
    timings = Timings([_timing("a")], 2e-3, 0.0, processes=2, a2a_tiny_s=3e-4, a2a_big_s=2e-4, a2a_bytes=2e5)
    sp = fit_speeds(timings, HW, INFO)
    assert sp.intra_host_bandwidth is not None and math.isclose(sp.intra_host_bandwidth, 2e5 / 2e-5)


def test_link_share_is_fitted_to_the_all_to_all_over_every_host() -> None:
    # 2 hosts x 2 ranks, 1e6 bytes per peer: each rank sends 2e6 across and 1e6 within its host
    timings = Timings(
        [_timing("a")], 2e-3, 0.0, processes=4, hosts=2, a2a_tiny_s=1e-4, a2a_big_s=1.1e-3, a2a_bytes=1e6,
        latency_a2a_s=1e-3, world_a2a_big_s=41e-3, world_a2a_peer_bytes=1e6,
    )  # fmt: skip
    sp = fit_speeds(timings, HW, INFO)
    # within: 1e6 bytes at the fitted 1e9 B/s (1 ms); less the tiny exchange (1 ms): 2e6 bytes in 39 ms
    assert sp.inter_host_bandwidth is not None and math.isclose(sp.inter_host_bandwidth, 2e6 / 39e-3)
    assert sp.hardware(HW).inter_host_bandwidth == sp.inter_host_bandwidth
    assert "link 0.82 Gbit/s" in sp.describe()  # the share times the host's 2 ranks, in bits
    # the planner's topology takes it; a link the user names still wins
    planner = Planner(Topology(4, 4, 2), speeds=sp)
    assert planner.topology.hardware.inter_host_bandwidth == sp.inter_host_bandwidth  # type: ignore[union-attr]
    named = Planner(Topology(4, 4, 2, host_link="1gbit"), speeds=sp)
    assert named.topology.hardware.inter_host_bandwidth == 125e6 / 2  # type: ignore[union-attr]
    one_host = fit_speeds(dataclasses.replace(timings, hosts=1), HW, INFO)
    assert one_host.inter_host_bandwidth is None


def test_fit_skips_tables_without_ids_and_floors_the_fixed_cost() -> None:
    empty = _timing("empty", ids=0.0)
    noisy = _timing("noisy", lookup_tiny_s=5e-3)  # one sample "slower" than the batch: noise
    sp = fit_speeds(Timings([empty, noisy], 2e-3, 0.0), HW, INFO)
    assert [p.name for p in sp.tables] == ["noisy"] and sp.tables[0].lookup_bandwidth > 0


def _profile(device: str = "cpu", **kw) -> ProfiledSpeeds:
    tables = (
        TableProfile("small", 1000, 16, 4, 1, 1.0, "sparse", 512, 0.1, 0.05, 3e10, 4e10),
        TableProfile("big", 1_000_000, 16, 4, 1, 20.0, "sparse", 512, 1.0, 0.5, 1e9, 2e9),
    )
    return ProfiledSpeeds(device, "a CPU", "box", {"torch": "x"}, "2026-11-28T10:00:00+00:00", 2, tables, **kw)


def test_json_round_trip_and_refusals(tmp_path) -> None:
    sp = _profile(intra_host_bandwidth=2e9, collective_latency=1e-4, step_overhead=1e-3)
    f = tmp_path / "speeds.json"
    sp.save(f)
    d = json.loads(f.read_text())
    assert d["format"].startswith("lightning_rec.planner_speeds/") and d["machine"] == "box"
    back = ProfiledSpeeds.load(f, "cpu")
    assert back == sp and back.source == str(f)
    with pytest.raises(SpeedsError, match=r"measured on cpu .*this plan is for cuda"):
        ProfiledSpeeds.load(f, "cuda")
    with pytest.raises(SpeedsError, match="measured on cpu"):
        Planner(Topology(2, device="cuda"), speeds=str(f))
    (tmp_path / "other.json").write_text(json.dumps({"format": "something/9"}))
    with pytest.raises(SpeedsError, match="not a speeds file of this version"):
        ProfiledSpeeds.load(tmp_path / "other.json")
    (tmp_path / "bad.json").write_text(json.dumps({**d, "tables": [{"name": "x"}]}))
    with pytest.raises(SpeedsError, match="malformed"):
        ProfiledSpeeds.load(tmp_path / "bad.json")
    (tmp_path / "text.json").write_text("not json")
    with pytest.raises(SpeedsError, match="not a JSON speeds file"):
        ProfiledSpeeds.load(tmp_path / "text.json")
    with pytest.raises(SpeedsError, match="cannot read speeds file"):
        ProfiledSpeeds.load(tmp_path / "missing.json")
    with pytest.raises(SpeedsError, match="not a positive number"):
        dataclasses.replace(sp, tables=(dataclasses.replace(sp.tables[0], lookup_bandwidth=0.0),))
    with pytest.raises(TypeError, match="ProfiledSpeeds or a path"):
        Planner(speeds=3)  # type: ignore[arg-type]


def test_tables_match_their_own_then_their_bucket_then_the_nearest() -> None:
    sp = _profile()
    own = EmbeddingBagConfig(1000, 16, "small", ["f"])
    same_bucket = EmbeddingBagConfig(900, 16, "other", ["g"])  # 57.6 KB: small's bucket (4**7-4**8), one id
    near = EmbeddingBagConfig(4000, 16, "near", ["h"])  # one bucket up, no profiled table there
    multi = EmbeddingBagConfig(100_000, 32, "multi", ["m"])  # several ids: only big has that pooling
    assert sp.match(own, 1.0, "sparse") == ("own", [sp.tables[0]])
    assert sp.match(same_bucket, 1.0, "sparse") == ("bucket", [sp.tables[0]])
    assert sp.match(near, 1.0, "sparse") == ("nearest", [sp.tables[0]])
    assert sp.match(multi, 10.0, "sparse") == ("nearest", [sp.tables[1]])
    assert sp.match(own, 1.0, "fused") == ("default", [])  # profiled with other gradients
    assert sp.table_speeds(own, 1.0, "fused", HW) == (HW.lookup_bandwidth, HW.update_bandwidth)


def _tables() -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(1000, 16, "small", ["f"]), EmbeddingBagConfig(1_000_000, 16, "big", ["b"])]


def test_planner_estimates_follow_the_speeds() -> None:
    pooling = {"f": 1.0, "b": 20.0}
    plan = ShardingPlan({"": {"small": table_wise(0), "big": table_wise(1)}})
    default = Planner(Topology(2), batch_size=512, pooling_factors=pooling, gradients="sparse")
    sp = _profile(step_overhead=2e-3, collective_latency=1e-3, intra_host_bandwidth=1e8)
    profiled = Planner(Topology(2), batch_size=512, pooling_factors=pooling, gradients="sparse", speeds=sp)
    d, p = default.estimate(_tables(), plan), profiled.estimate(_tables(), plan)
    # lookup and update scale with the speeds: rank 0 holds "small" (30 / 40 GB/s), rank 1 "big" (1 / 2 GB/s)
    assert math.isclose(p.time[0, 0], d.time[0, 0] * HW.lookup_bandwidth / 3e10)
    assert math.isclose(p.time[1, 1], d.time[1, 1] * HW.update_bandwidth / 2e9)
    # the measured exchange and latency replace the defaults; the fixed cost adds to every rank
    assert math.isclose(p.time[3, 0], d.time[3, 0] * HW.intra_host_bandwidth / 1e8)
    assert math.isclose(p.latency_s, 6 * 1e-3 + 2e-3)
    assert "speeds" not in d.settings and p.settings["speeds"].startswith("profile (box, cpu a CPU, 2026-11-28T10:00")
    assert p.settings["speeds"].endswith("tables: 2 own")


def test_search_and_reference_agree_with_per_table_speeds() -> None:
    tables = [EmbeddingBagConfig(1000 * 4**i, 32, f"t{i}", [f"f{i}"]) for i in range(8)]
    profiles = tuple(
        TableProfile(t.name, t.num_embeddings, 32, 4, 1, 1.0, "sparse", 512, 1.0, 1.0, 1e9 * (i + 1), 3e9 / (i + 1))
        for i, t in enumerate(tables[:5])
    )
    sp = dataclasses.replace(_profile(), tables=profiles)
    planner = Planner(Topology(4, local_size=2, host_memory="1GB"), batch_size=256, gradients="sparse", speeds=sp)
    plan = planner.plan(tables)
    chosen, again = planner.explain(), planner.estimate(tables, plan)
    # the search's terms and the reference (estimate: per shard, summed with bincount) use the same speeds; their
    # sums may differ in the last bit (another order of additions), a wrong speed by far more
    np.testing.assert_allclose(chosen.time, again.time, rtol=1e-12)
    np.testing.assert_array_equal(chosen.memory, again.memory)
    assert "5 own" in chosen.settings["speeds"] and "3 nearest" in chosen.settings["speeds"]


def test_automatic_plan_takes_speeds_from_a_file(tmp_path) -> None:
    f = tmp_path / "s.json"
    _profile(step_overhead=1e-3).save(f)
    planner = automatic_plan(_tables(), 2, 2, 2, gradients="sparse", speeds=str(f))
    planner.plan(_tables())
    assert str(f) in planner.explain().settings["speeds"]


def _batches(n: int = 3, batch: int = 16) -> list[KeyedJaggedTensor]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        lengths = torch.cat([torch.ones(batch, dtype=torch.long), torch.randint(0, 4, (batch,), generator=g)])
        ids = torch.cat(
            [
                torch.randint(0, 1000, (batch,), generator=g),
                torch.randint(0, 5000, (int(lengths[batch:].sum()),), generator=g),
            ]
        )
        out.append(KeyedJaggedTensor(["f", "b"], ids, lengths=lengths))
    return out


def test_take_selects_features_and_samples() -> None:
    kjt = _batches(1)[0]
    sub = take(kjt, ["b"], 2, torch.device("cpu"))
    assert sub.keys() == ["b"] and sub.stride() == 2
    n = int(kjt.lengths()[16:18].sum())
    assert torch.equal(sub.values(), kjt.values()[16 : 16 + n])
    with pytest.raises(ValueError, match=r"no feature \['nope'\]"):
        take(kjt, ["nope"], None, torch.device("cpu"))


@pytest.mark.parametrize("spec", [None, {"kind": "sgd", "lr": 0.01}])
def test_profile_speeds_measures_every_table(spec) -> None:
    tables = [EmbeddingBagConfig(1000, 8, "small", ["f"]), EmbeddingBagConfig(5000, 8, "big", ["b"])]
    sp = profile_speeds(tables, _batches(), embedding_optimizer=spec, gradients="sparse", max_batches=3, repeats=1)
    assert [p.name for p in sp.tables] == ["small", "big"]
    assert all(p.grads == ("fused" if spec else "sparse") for p in sp.tables)
    assert sp.device == "cpu" and sp.processes == 1 and sp.collective_latency is None
    assert sp.tables[0].ids == 1.0 and all(p.lookup_bandwidth > 0 for p in sp.tables)
    assert not torch.distributed.is_initialized()  # its own process group is gone


def test_calibrate_step_puts_the_unexplained_time_in_the_fixed_cost() -> None:
    tables = _tables()
    sp = _profile(step_overhead=1e-4)
    pooling = {"f": 1.0, "b": 20.0}
    planner = Planner(Topology(2), batch_size=512, pooling_factors=pooling, gradients="sparse", speeds=sp)
    est = planner.estimate(tables, reference_plan(tables, 2)).step_time_ms / 1e3
    fitted = calibrate_step(sp, tables, est + 5e-3, 2, 512, pooling, "sgd", "sparse")
    assert math.isclose(fitted.step_overhead, 5e-3 + 1e-4)
    # a step the model already overestimates keeps the lookups' own fixed cost
    assert calibrate_step(sp, tables, 0.0, 2, 512, pooling, "sgd", "sparse").step_overhead == 1e-4
