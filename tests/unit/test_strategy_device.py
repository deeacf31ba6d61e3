"""The strategy hands torch a device with an index (init_process_group's device_id, ShardedTensor placements)."""

from __future__ import annotations

import torch

from lightning_rec.lightning.strategy import RecShardedStrategy


def test_root_device_gets_an_index() -> None:
    s = RecShardedStrategy(parallel_devices=[torch.device("cuda"), torch.device("cuda")])
    assert s.root_device == torch.device("cuda", s.local_rank)
    assert RecShardedStrategy(parallel_devices=[torch.device("cuda", 1)]).root_device == torch.device("cuda", 1)
    assert RecShardedStrategy(parallel_devices=[torch.device("cpu")]).root_device == torch.device("cpu")
