"""KeyedTensor.regroup and kt_regroup_arguments against references written in plain torch.

The reference gathers columns by an index built from first principles (every key's column range in the
inputs laid side by side), so forward values and gradients are checked against an independent computation.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lightning_rec.sparse import KeyedTensor, kt_regroup_arguments
from lightning_rec.sparse._regroup import regroup_values

KEYS = [["a", "b"], ["c", "d", "e"], ["f"]]
WIDTHS = [[2, 3], [1, 4, 2], [5]]
# duplicates ("a" thrice, "d" twice), a skipped key ("b"), keys from every input
GROUPS = [["a", "c"], ["d", "a", "f"], ["e"], ["a", "d"]]

has_fbgemm = importlib.util.find_spec("fbgemm_gpu") is not None


def _columns(keys: list[list[str]], widths: list[list[int]], groups: list[list[str]]) -> list[torch.Tensor]:
    """Per group, the column indices into the inputs concatenated along dim 1 (last input holding a key wins)."""
    cols: dict[str, range] = {}
    base = 0
    for ks, ws in zip(keys, widths):
        for k, w in zip(ks, ws):
            cols[k] = range(base, base + w)
            base += w
    return [torch.tensor([c for k in g for c in cols[k]], dtype=torch.long) for g in groups]


def _reference(values: list[torch.Tensor], groups: list[list[str]]) -> list[torch.Tensor]:
    flat = torch.cat(values, dim=1)
    return [flat.index_select(1, idx) for idx in _columns(KEYS, WIDTHS, groups)]


def _inputs(batch: int = 3, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(batch, sum(w), generator=g, dtype=dtype) for w in WIDTHS]


def _kts(values: list[torch.Tensor]) -> list[KeyedTensor]:
    return [KeyedTensor(k, w, v) for k, w, v in zip(KEYS, WIDTHS, values)]


def _weighted_loss(outs: list[torch.Tensor]) -> torch.Tensor:
    # a different weight per output and column, so a gradient in the wrong place shows
    return sum(
        (o * torch.arange(1.0, o.numel() + 1, dtype=o.dtype).view_as(o)).sum() * (i + 1) for i, o in enumerate(outs)
    )


def test_regroup_forward_and_backward_match_plain_torch() -> None:
    values = [v.requires_grad_() for v in _inputs()]
    ref_values = [v.detach().clone().requires_grad_() for v in values]
    outs = KeyedTensor.regroup(_kts(values), GROUPS)
    refs = _reference(ref_values, GROUPS)
    assert [o.shape for o in outs] == [r.shape for r in refs]
    for o, r in zip(outs, refs):
        assert torch.equal(o, r)
    _weighted_loss(outs).backward()
    _weighted_loss(refs).backward()
    for v, r in zip(values, ref_values):
        assert v.grad is not None and r.grad is not None
        torch.testing.assert_close(v.grad, r.grad)
    # "b" is read by no group: its columns get a zero gradient
    assert torch.count_nonzero(values[0].grad[:, 2:5]) == 0


def test_regroup_as_dict_names_the_groups() -> None:
    values = _inputs()
    out = KeyedTensor.regroup_as_dict(_kts(values), GROUPS, ["g0", "g1", "g2", "g3"])
    assert list(out) == ["g0", "g1", "g2", "g3"]
    for o, r in zip(out.values(), _reference(values, GROUPS)):
        assert torch.equal(o, r)
    with pytest.raises(ValueError, match="as many keys as groups"):
        KeyedTensor.regroup_as_dict(_kts(values), GROUPS, ["g0"])


def test_key_in_several_inputs_is_read_from_the_last() -> None:
    first = KeyedTensor(["x", "y"], [2, 1], torch.zeros(2, 3, requires_grad=True))
    last = KeyedTensor(["x"], [2], torch.ones(2, 2, requires_grad=True))
    (g,) = KeyedTensor.regroup([first, last], [["y", "x"]])
    assert torch.equal(g, torch.tensor([[0.0, 1.0, 1.0]] * 2))
    g.sum().backward()
    assert torch.equal(first.values().grad, torch.tensor([[0.0, 0.0, 1.0]] * 2))
    assert torch.equal(last.values().grad, torch.ones(2, 2))


def test_regroup_along_key_dim_0_and_empty_group() -> None:
    v = torch.arange(12.0).view(6, 2)
    kt = KeyedTensor(["p", "q"], [4, 2], v, key_dim=0)
    g, empty = KeyedTensor.regroup([kt], [["q", "p"], []])
    assert torch.equal(g, torch.cat([v[4:], v[:4]]))
    assert empty.shape == (0, 2)


def test_regroup_meta_and_inference_mode() -> None:
    meta = [torch.empty(7, sum(w), device="meta") for w in WIDTHS]
    outs = KeyedTensor.regroup(_kts(meta), GROUPS)
    assert [tuple(o.shape) for o in outs] == [(7, 3), (7, 11), (7, 2), (7, 6)]
    assert all(o.is_meta for o in outs)
    with torch.inference_mode():
        values = _inputs(dtype=torch.bfloat16)
        outs = KeyedTensor.regroup(_kts(values), GROUPS)
    for o, r in zip(outs, _reference(values, GROUPS)):
        assert o.dtype == torch.bfloat16 and torch.equal(o, r)


def test_regroup_scripted_matches_eager() -> None:
    class Regroup(torch.nn.Module):
        def forward(self, kts: list[KeyedTensor]) -> list[torch.Tensor]:
            return KeyedTensor.regroup(kts, [["d", "a", "f"], ["a"]])

    values = _inputs()
    scripted = torch.jit.script(Regroup())
    for o, r in zip(scripted(_kts(values)), _reference(values, [["d", "a", "f"], ["a"]])):
        assert torch.equal(o, r)


def test_regroup_refuses_bad_input() -> None:
    values = _inputs()
    with pytest.raises(KeyError, match="key 'zz' of group 1 is in no input"):
        KeyedTensor.regroup(_kts(values), [["a"], ["zz"]])
    with pytest.raises(ValueError, match="at least one KeyedTensor"):
        KeyedTensor.regroup([], [["a"]])
    kt0 = KeyedTensor(["r"], [2], torch.zeros(2, 3), key_dim=0)
    with pytest.raises(ValueError, match="one key_dim"):
        KeyedTensor.regroup([_kts(values)[0], kt0], [["a"]])
    with pytest.raises(ValueError, match="2 tensors but 3 key lists"):
        regroup_values(values[:2], KEYS, WIDTHS, GROUPS)
    with pytest.raises(ValueError, match="input 1 has 3 keys but 2 lengths"):
        kt_regroup_arguments(values[0], KEYS, [[2, 3], [1, 4], [5]], GROUPS)


def _expected_rows() -> list[list[int]]:
    """``[input, output, input start, output start, width, jump]`` per (group, key), written out by hand."""
    return [
        [0, 0, 0, 0, 2, 3],  # a: first of 3 uses (rows 0, 3, 6): the row of the next use
        [1, 0, 0, 2, 1, 0],  # c: used once
        [1, 1, 1, 0, 4, 7],  # d: first of 2 uses (rows 2, 7)
        [0, 1, 0, 4, 2, -6],  # a: a middle use, minus the row of the next
        [2, 1, 0, 6, 5, 0],  # f
        [1, 2, 5, 0, 2, 0],  # e
        [0, 3, 0, 0, 2, -8],  # a: the last use, minus the number of rows
        [1, 3, 1, 2, 4, -8],  # d: the last use
    ]


def test_kt_regroup_arguments_layout() -> None:
    permutes, in_shapes, out_shapes, out_lengths = kt_regroup_arguments(torch.empty(0), KEYS, WIDTHS, GROUPS)
    assert permutes.dtype == in_shapes.dtype == out_shapes.dtype == torch.int32
    assert permutes.tolist() == _expected_rows()
    assert in_shapes.tolist() == [5, 7, 5]
    assert out_shapes.tolist() == out_lengths == [3, 11, 2, 6]
    # following the jumps from a key's first use visits every use in order, then leaves the table
    n = permutes.size(0)
    rows = permutes.tolist()
    for key in ("a", "d"):
        uses = [i for i, (g, k) in enumerate((g, k) for g, grp in enumerate(GROUPS) for k in grp) if k == key]
        seen, at = [uses[0]], rows[uses[0]][5]
        while abs(at) < n:
            seen.append(abs(at))
            at = rows[abs(at)][5]
        assert seen == uses and at == -n
    meta = kt_regroup_arguments(torch.empty(0, device="meta"), KEYS, WIDTHS, GROUPS)
    assert meta[0].is_meta and meta[0].shape == (8, 6) and meta[3] == [3, 11, 2, 6]


def test_kt_regroup_arguments_rows_slice_the_reference() -> None:
    # each row's slice of its input, joined per output in row order, is the plain-torch regroup
    values = _inputs()
    permutes, _, _, out_lengths = kt_regroup_arguments(values[0], KEYS, WIDTHS, GROUPS)
    outs: list[list[torch.Tensor]] = [[] for _ in GROUPS]
    for t, g, start, _, width, _ in permutes.tolist():
        outs[g].append(values[t][:, start : start + width])
    for o, r, n in zip(outs, _reference(values, GROUPS), out_lengths):
        assert torch.equal(torch.cat(o, dim=1), r) and r.size(1) == n


@pytest.mark.skipif(not has_fbgemm, reason="fbgemm-gpu not installed")
def test_kt_regroup_arguments_drive_fbgemm_permute_multi_embedding() -> None:
    importlib.import_module("fbgemm_gpu")
    # every key read: fbgemm-gpu 1.8.0's CPU backward leaves the gradient of an unread key uninitialized
    groups = [*GROUPS, ["b"]]
    values = [v.float().requires_grad_() for v in _inputs()]
    ref_values = [v.detach().clone().requires_grad_() for v in values]
    permutes, in_shapes, out_shapes, out_lengths = kt_regroup_arguments(values[0], KEYS, WIDTHS, groups)
    outs = torch.ops.fbgemm.permute_multi_embedding(values, permutes, in_shapes, out_shapes, out_lengths)
    refs = _reference(ref_values, groups)
    for o, r in zip(outs, refs):
        assert torch.equal(o, r)
    _weighted_loss(list(outs)).backward()
    _weighted_loss(refs).backward()
    for v, r in zip(values, ref_values):
        torch.testing.assert_close(v.grad, r.grad)
