"""Managed collision's global optimizer step pre-hook exists only once a managed-collision wrapper does.

Registering it when ``lightning_rec`` is imported would run it on every step of every torch optimizer in the
process. A fresh interpreter, since the hook stays once a wrapper (of any earlier test) has added it.
"""

from __future__ import annotations

import subprocess
import sys

_SCRIPT = """
import weakref

import torch

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_rec.mc import (
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    MCHManagedCollisionModule,
)
from lightning_rec.mc import embedding as mc_embedding

calls = []


# the hook reads the live wrappers once per call, whenever and however it was registered: count the reads
class Wrappers(weakref.WeakSet):
    def __iter__(self):
        calls.append(len(self))
        yield from super().__iter__()


mc_embedding._WRAPPERS = Wrappers()


def step(opt):
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    opt.step()


def managed():
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(name="t", num_embeddings=8, embedding_dim=4, feature_names=["f"])]
    )
    mcc = ManagedCollisionCollection({"t": MCHManagedCollisionModule(8, num_buckets=2)}, ebc.embedding_bag_configs())
    return ManagedCollisionEmbeddingBagCollection(ebc, mcc)


plain = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
step(plain)
step(plain)
assert calls == [] and mc_embedding._STEP_HOOK == [], (calls, mc_embedding._STEP_HOOK)

first, second = managed(), managed()
assert len(mc_embedding._STEP_HOOK) == 1, mc_embedding._STEP_HOOK
opt = torch.optim.SGD(first.parameters(), lr=0.1)
step(plain)
step(opt)
assert calls == [2, 2], calls  # one call per step, whichever optimizer, however many wrappers
# the hook did its work: the optimizer of a managed table is registered with its wrapper, the plain one is not
assert [r() for r in first._optimizers] == [opt] and second._optimizers == [], (first._optimizers, second._optimizers)
print("ok")
"""


def test_plain_optimizer_steps_do_not_run_the_hook_until_a_managed_table_exists() -> None:
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "ok", out.stdout
