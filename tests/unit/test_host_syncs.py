"""HostSyncCounter counts what would make a CUDA host wait for its device, and nothing else."""

from __future__ import annotations

import torch

from lightning_rec.host_syncs import HostSyncCounter


def test_counts_reads_and_data_dependent_shapes_only() -> None:
    x = torch.tensor([1, 0, 2])
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = torch.optim.Adagrad([p])
    original = torch.Tensor.tolist
    with HostSyncCounter(where=True) as syncs:
        x.tolist()  # a read into Python
        x.sum().item()  # a scalar read
        bool(x.any())
        x.nonzero()  # output sizes that depend on the data
        torch.unique(x)
        x[x > 0]
        torch.repeat_interleave(x)
        torch.equal(x, x)
        # no sync: sizes known on the host
        torch.repeat_interleave(x, 2)
        torch.repeat_interleave(x, x, output_size=3)
        x.cumsum(0) + 1
        x[torch.tensor([0, 2])]
        torch.empty(0, dtype=torch.long).tolist()  # nothing to read
        opt.step()  # torch's optimizers read their step counters, CPU scalars on every device
    assert syncs.by_op == {
        "tolist": 1,
        "aten._local_scalar_dense": 2,
        "aten.nonzero": 1,
        "aten._unique2": 1,
        "aten.index (boolean mask)": 1,
        "aten.repeat_interleave": 1,
        "aten.equal": 1,
    }
    assert syncs.total == 8
    assert all(site.endswith("outside lightning_rec") for site in syncs.by_site)
    assert torch.Tensor.tolist is original  # restored on exit


def test_other_threads_are_not_counted() -> None:
    import threading

    x = torch.tensor([3, 4])
    with HostSyncCounter() as syncs:
        t = threading.Thread(target=x.tolist)
        t.start()
        t.join()
        x.tolist()
    assert syncs.by_op == {"tolist": 1}
