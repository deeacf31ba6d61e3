"""Host syncs per training step (what would make a CUDA host wait for its device), counted on CPU for every
sharding type, pooled and sequence, fused and not, with and without the train pipeline: none may be added.

The bounds are the counts measured when they were last lowered (``benchmarks/results/host_syncs.md``): a
change that adds a sync fails here and must either remove it or justify raising the bound.
"""

from __future__ import annotations

from lightning_rec.testing import run_distributed
from tests.distributed.host_sync_cases import all_counts

# (pooled, sharding) -> most host syncs in one step (forward, backward, optimizer steps) on any rank
FUSED_DATA_PARALLEL = 4  # a fused data-parallel table all-gathers the union of the batches: no touched rows
BOUNDS = {
    (True, "data_parallel"): 8,  # the touched rows of the sparse gradient all-reduce: unique, gather, unique
    (True, "table_wise"): 3,  # ids per key (split sizes), the id check's verdict, the input dist's header
    (True, "column_wise"): 3,
    (True, "row_wise"): 4,  # + the row blocks' split sizes
    (True, "table_row_wise"): 4,
    (True, "grid_shard"): 4,
    (False, "data_parallel"): 9,
    (False, "table_wise"): 3,
    (False, "column_wise"): 3,
    (False, "row_wise"): 4,
    (False, "table_row_wise"): 4,
    (False, "grid_shard"): 4,
}


def test_host_syncs_per_step_stay_within_their_bounds() -> None:
    results = run_distributed(all_counts, 2, True, timeout_s=600)
    over = []
    for i, ((pooled, kind, fused, pipelined), _) in enumerate(results[0]):
        total = max(r[i][1][0] for r in results)
        bound = FUSED_DATA_PARALLEL if fused and kind == "data_parallel" else BOUNDS[(pooled, kind)]
        if total > bound:
            sites = results[0][i][1][2]
            over.append(
                f"{'pooled' if pooled else 'sequence'} {kind} fused={fused} pipeline={pipelined}: {total} > {bound} {sites}"
            )
    assert not over, "host syncs per step grew:\n" + "\n".join(over)
    # the counter sees the syncs it should: the sharded steps make at least the input dist's header read
    assert all(r[1][0] >= 1 for r in results[0])
