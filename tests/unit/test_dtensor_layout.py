"""DTensor state without processes: which tilings map onto placements, and no ShardedTensor anywhere (issue 15).

(The DTensors themselves, their placements against torch's own gather, and checkpoints through them:
tests/distributed/test_dtensor_state.py.)
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import lightning_rec
from lightning_rec.plans.shard_geometry import ShardMeta, dtensor_placement

PACKAGE = Path(lightning_rec.__file__).parent


def test_dtensor_placement_math() -> None:
    def sm(*rows_cols_rank):
        return [ShardMeta(*x) for x in rows_cols_rank]

    assert dtensor_placement(sm((0, 3, 0, 4, 0), (3, 3, 0, 4, 1), (6, 3, 0, 4, 2), (9, 1, 0, 4, 3)), 10, 4, 4) == (
        "shard",
        0,
    )
    # torch.chunk leaves the last rank empty: 5 rows on 4 ranks are 2, 2, 1, 0
    assert dtensor_placement(sm((0, 2, 0, 4, 0), (2, 2, 0, 4, 1), (4, 1, 0, 4, 2), (5, 0, 0, 4, 3)), 5, 4, 4) == (
        "shard",
        0,
    )
    assert dtensor_placement(sm((0, 3, 0, 4, 1), (3, 2, 0, 4, 0)), 5, 4, 2) is None  # ranks out of order
    assert dtensor_placement(sm((0, 2, 0, 4, 0), (2, 3, 0, 4, 1)), 5, 4, 2) is None  # not torch.chunk's sizes
    assert dtensor_placement(sm((0, 6, 0, 4, 0), (0, 6, 4, 4, 1)), 6, 8, 2) == ("shard", 1)
    assert dtensor_placement(sm((0, 6, 0, 8, 1)), 6, 8, 2) == ("owner", 1)
    assert dtensor_placement(sm((0, 3, 0, 4, 0), (3, 3, 0, 4, 1), (0, 3, 4, 4, 2), (3, 3, 4, 4, 3)), 6, 8, 4) is None
    assert dtensor_placement(sm((0, 3, 0, 8, 0), (3, 3, 0, 8, 1)), 6, 8, 4) is None  # half the group


def test_nothing_describes_or_filters_sharded_tensors() -> None:
    # torch deprecates ShardedTensor; nothing may use it, and no warning about it may be hidden
    assert not [f for f in warnings.filters if f[1] is not None and "ShardedTensor" in f[1].pattern]
    users = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if re.search(r"torch\.distributed\._shard\b|import .*ShardedTensor", p.read_text())
    ]
    assert users == [], users
