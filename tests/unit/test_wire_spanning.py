"""wire.spanning: pieces that already lie back to back in one buffer go on the wire as that buffer (no
pack or unpack copy on the torch.distributed path); anything else is copied as before."""

from __future__ import annotations

import torch

from lightning_rec.transport import wire


def test_split_pieces_span_their_buffer() -> None:
    x = torch.arange(24, dtype=torch.float32)
    pieces = list(torch.split(x, [5, 0, 7, 12]))
    whole = wire.spanning(pieces)
    assert whole is not None and whole.data_ptr() == x.data_ptr() and whole.numel() == 24 * 4
    assert torch.equal(whole.view(torch.float32), x)
    assert wire.gather(pieces).data_ptr() == x.data_ptr()  # no copy
    tail = list(torch.split(x, [4, 20]))[1:]  # a suffix of the buffer: a view starting at its first piece
    assert wire.spanning(tail).data_ptr() == tail[0].data_ptr()


def test_anything_else_is_not_spanned() -> None:
    x = torch.arange(24, dtype=torch.float32)
    a, b, c = torch.split(x, [8, 8, 8])
    assert wire.spanning([a, c]) is None  # a gap
    assert wire.spanning([b, a]) is None  # out of order
    assert wire.spanning([x.view(4, 6)[:, :3]]) is None  # strided
    assert wire.spanning([a, torch.arange(8, dtype=torch.float32)]) is None  # another buffer
    assert wire.spanning([]) is None
    out = wire.gather([a, c])
    assert out.data_ptr() != x.data_ptr() and torch.equal(out.view(torch.float32), torch.cat([a, c]))
