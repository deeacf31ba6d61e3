"""A TorchRec-style module plan (``construct_module_sharding_plan``, with its ``sharding_spec``) shards a
collection on 2 gloo processes exactly as it says: DMP reports the same plan, every rank holds the shards the
spec lists, and the output equals the unsharded collection's."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, _compat
from lightning_rec.distributed import DistributedModelParallel
from lightning_rec.sharding import (
    ParameterSharding,
    ShardingPlan,
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from lightning_rec.testing import run_distributed


def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(10, 8, "t_rows", ["a"]),
        EmbeddingBagConfig(6, 8, "t_cols", ["b"]),
        EmbeddingBagConfig(5, 4, "t_one", ["c"]),
    ]


def _spec_plan(rank: int, world: int) -> None:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(_tables())
    reference = copy.deepcopy(ebc)
    module_plan = construct_module_sharding_plan(
        ebc,
        {"t_rows": row_wise([7, 3]), "t_cols": column_wise(size_per_rank=[2, 6]), "t_one": table_wise(1)},
        world_size=world,
        local_size=world,
        device_type="cpu",
    )
    dmp = DistributedModelParallel(ebc, plan=ShardingPlan({"": module_plan}), device=torch.device("cpu"))
    assert dmp.plan.get_plan_for_module("") == module_plan
    # this rank's weight pieces are exactly the non-empty shards the spec places here, with the unsharded values
    state = dmp.state_dict()
    for name, ps in module_plan.items():
        full = reference.embedding_bags[name].weight.detach()
        want = sorted(
            (m.shard_offsets, m.shard_sizes)
            for m in ps.sharding_spec.shards
            if m.placement.rank() == rank and min(m.shard_sizes) > 0
        )
        assert all(m.placement.device() == torch.device("cpu") for m in ps.sharding_spec.shards)
        pieces = _compat.local_pieces(state[f"embedding_bags.{name}.weight"])
        assert sorted((off, list(t.shape)) for off, t in pieces) == want, (name, rank)
        for (r0, c0), t in pieces:
            torch.testing.assert_close(t, full[r0 : r0 + t.shape[0], c0 : c0 + t.shape[1]])
    g = torch.Generator().manual_seed(rank)
    lengths = torch.randint(0, 3, (9,), generator=g)
    ids = torch.cat(
        [torch.randint(0, n, (int(lengths[3 * i : 3 * i + 3].sum()),), generator=g) for i, n in enumerate((10, 6, 5))]
    )
    kjt = KeyedJaggedTensor(["a", "b", "c"], ids, lengths=lengths)
    torch.testing.assert_close(dmp(kjt).values(), reference(kjt).values())
    # a TorchRec-style entry whose spec disagrees with its fields is refused before anything is exchanged
    bad = dict(module_plan)
    bad["t_rows"] = ParameterSharding(
        "row_wise", ranks=[0, 1], compute_kernel="dense", sharding_spec=module_plan["t_rows"].sharding_spec
    )
    with pytest.raises(ValueError, match=r"table 't_rows': sharding_spec gives shards"):
        DistributedModelParallel(
            EmbeddingBagCollection(_tables()), plan=ShardingPlan({"": bad}), device=torch.device("cpu")
        )


def test_constructed_plan_with_spec_shards_as_described() -> None:
    run_distributed(_spec_plan, 2)
