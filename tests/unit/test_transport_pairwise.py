"""The pairwise exchange posts every receive before any send, and skips this rank and the empty messages.

The order is the point of ``transport/pairwise.py`` (a receive announced after a send's bytes lets the two
directions of a link run one after the other), so it is checked here on recorded calls, without processes.
"""

from __future__ import annotations

import pytest
import torch

from lightning_rec.transport import pairwise


class _Work:
    def __init__(self, calls: list[tuple[str, int]], op: str, peer: int) -> None:
        self.calls, self.op, self.peer = calls, op, peer

    def wait(self) -> None:
        self.calls.append(("wait_" + self.op, self.peer))


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    seen: list[tuple[str, int]] = []

    def irecv(t: torch.Tensor, group: object = None, group_src: int | None = None) -> _Work:
        assert group_src is not None and t.is_contiguous()
        seen.append(("recv", group_src))
        return _Work(seen, "recv", group_src)

    def isend(t: torch.Tensor, group: object = None, group_dst: int | None = None) -> _Work:
        assert group_dst is not None and t.is_contiguous()
        seen.append(("send", group_dst))
        return _Work(seen, "send", group_dst)

    monkeypatch.setattr(pairwise.dist, "irecv", irecv)
    monkeypatch.setattr(pairwise.dist, "isend", isend)
    monkeypatch.setattr(pairwise.dist, "get_rank", lambda group=None: 1)
    return seen


def test_every_receive_is_posted_before_any_send(calls: list[tuple[str, int]]) -> None:
    def msg(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.uint8)

    # rank 1 of 4: sends to 0 and 3, receives from 2 and 3; its own and the empty ones are skipped
    works = pairwise.start([msg(8), msg(8), msg(0), msg(4)], [None, msg(8), msg(16), msg(4)], None)
    assert calls == [("recv", 2), ("recv", 3), ("send", 0), ("send", 3)]
    pairwise.wait_all(works)
    assert calls[4:] == [("wait_recv", 2), ("wait_recv", 3), ("wait_send", 0), ("wait_send", 3)]


def test_nothing_to_exchange_posts_nothing(calls: list[tuple[str, int]]) -> None:
    assert (
        pairwise.start([None, torch.zeros(3, dtype=torch.uint8)], [torch.zeros(0, dtype=torch.uint8), None], None) == []
    )
    assert calls == []
