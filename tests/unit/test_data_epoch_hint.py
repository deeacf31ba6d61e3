"""A resume that brings no loader state (Lightning, from a checkpoint taken at the end of an epoch) starts the
trainer's epoch, not epoch 0 again."""

from __future__ import annotations

import torch

from lightning_rec.data import ClickLoader, SyntheticClicks


def _first(loader: ClickLoader) -> torch.Tensor:
    return next(iter(loader)).sparse.values()


def test_epoch_hint_starts_a_fresh_loader_at_the_trainers_epoch() -> None:
    ds = lambda: SyntheticClicks(256, 64, size=1e-4)  # noqa: E731  (train split: fresh rows every epoch)
    plain = ClickLoader(ds())
    epochs = [_first(plain) for _ in range(3)]
    assert not torch.equal(epochs[0], epochs[2])
    epoch = [2]
    hinted = ClickLoader(ds(), epoch_hint=lambda: epoch[0])
    assert torch.equal(_first(hinted), epochs[2])  # nothing loaded: the trainer's epoch
    # a loaded mid-epoch position wins over the hint; and the hint never moves an epoch back
    resumed = ClickLoader(ds(), epoch_hint=lambda: epoch[0])
    it = iter(resumed)
    next(it)
    state = resumed.state_dict()
    again = ClickLoader(ds(), epoch_hint=lambda: 0)
    again.load_state_dict(state)
    assert torch.equal(_first(again), list(ClickLoader(ds(), epoch_hint=lambda: 2))[1].sparse.values())
    epoch[0] = 1
    assert torch.equal(_first(hinted), _first(ClickLoader(ds(), epoch_hint=lambda: 3)))  # epoch 3, not 1
