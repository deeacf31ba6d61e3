"""JaggedTensor: one batch of variable-length rows (TorchRec's ``JaggedTensor``)."""

# no ``from __future__ import annotations``: TorchScript cannot parse some string annotations (torch.device)
import torch

from lightning_rec.sparse import _format
from lightning_rec.sparse._utils import SparseMeta, checks_enabled, lengths_and_offsets, script_lengths_and_offsets


def _padded(x: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor, n: int, pad: float) -> torch.Tensor:
    """``[bags, n, *x.shape[1:]]``: each bag's first ``n`` entries, then ``pad``."""
    b = lengths.numel()
    out = x.new_full([b, n] + list(x.shape[1:]), pad)
    total = int(offsets[-1]) if b > 0 else 0
    if total == 0 or n == 0:
        return out
    x = x[:total]  # entries past the last bag belong to no bag
    row = torch.repeat_interleave(torch.arange(b, device=x.device), lengths.long(), output_size=total)
    col = torch.arange(total, device=x.device) - offsets[:-1].long()[row]
    keep = col < n
    out[row[keep], col[keep]] = x[keep]
    return out


def _bags(x: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
    sizes = torch.jit.annotate(list[int], lengths.tolist())
    # entries past the last bag belong to no bag
    return list(torch.split(x[: sum(sizes)], sizes))


class JaggedTensor(metaclass=SparseMeta):
    """A batch of variable-length rows: ``values`` cut into bags by ``lengths`` / ``offsets``.

    Arguments in TorchRec's order: ``JaggedTensor(values, weights=None, lengths=None, offsets=None)``.
    ``values`` may have any dtype and more dimensions (one embedding per id, as ``EmbeddingCollection``
    returns); the caller's integer dtype of ``lengths`` / ``offsets`` is kept. ``torch.jit.script``-able,
    as TorchRec's: the checks run eagerly only.
    """

    # ``device`` is a property here (a method in TorchRec): TorchScript code reads ``values().device``
    __jit_unused_properties__ = ["device"]  # noqa: RUF012

    def __init__(
        self,
        values: torch.Tensor,
        weights: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
    ) -> None:
        if torch.jit.is_scripting():
            lengths, offsets = script_lengths_and_offsets(lengths, offsets)
        else:
            if checks_enabled() and (not isinstance(values, torch.Tensor) or values.dim() < 1):
                raise ValueError("JaggedTensor `values` must be a tensor with at least one dimension")
            lengths, offsets, _ = lengths_and_offsets(values, lengths, offsets, "JaggedTensor", weights)
        self._lengths: torch.Tensor = lengths
        self._offsets: torch.Tensor = offsets
        self._values = values
        self._weights = weights

    # -- constructors -------------------------------------------------------------------------------
    # (inside the class every constructor call passes every argument: TorchScript does not know the
    # defaults of a class it is compiling yet)
    @staticmethod
    def empty(
        is_weighted: bool = False,
        device: torch.device | None = None,
        values_dtype: torch.dtype | None = None,
        weights_dtype: torch.dtype | None = None,
        lengths_dtype: torch.dtype = torch.int32,
    ) -> "JaggedTensor":
        weights = torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None
        return JaggedTensor(
            torch.empty(0, dtype=values_dtype, device=device),
            weights,
            torch.empty(0, dtype=lengths_dtype, device=device),
            None,
        )

    @staticmethod
    def empty_like(jt: "JaggedTensor") -> "JaggedTensor":
        """No bags; the dtypes and device of ``jt``."""
        w = jt.weights_or_none()
        return JaggedTensor.empty(
            w is not None, jt.values().device, jt.values().dtype, None if w is None else w.dtype, jt.lengths().dtype
        )

    @staticmethod
    def from_dense_lengths(
        values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None = None
    ) -> "JaggedTensor":
        """Keep the first ``lengths[i]`` entries of each row of a padded ``[B, N, ...]`` tensor."""
        return _from_dense_lengths(values, lengths, weights)

    @staticmethod
    def from_dense(values: list[torch.Tensor], weights: list[torch.Tensor] | None = None) -> "JaggedTensor":
        """One tensor per bag -> JaggedTensor (int32 lengths, as in TorchRec)."""
        if len(values) == 0:
            return JaggedTensor(torch.empty(0), None, torch.empty(0, dtype=torch.int32), None)
        lengths = torch.tensor([v.size(0) for v in values], dtype=torch.int32, device=values[0].device)
        return JaggedTensor(torch.cat(values), None if weights is None else torch.cat(weights), lengths, None)

    # -- accessors ----------------------------------------------------------------------------------
    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def lengths_or_none(self) -> torch.Tensor | None:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        return self._offsets

    def offsets_or_none(self) -> torch.Tensor | None:
        return self._offsets

    def weights(self) -> torch.Tensor:
        w = self._weights  # a local: TorchScript refines locals, not attributes
        if w is None:
            raise ValueError("this JaggedTensor has no weights")
        return w

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    @property
    def device(self) -> torch.device:
        return self._values.device

    # -- dense views --------------------------------------------------------------------------------
    def to_dense(self) -> list[torch.Tensor]:
        """One tensor per bag."""
        return _bags(self._values, self._lengths)

    def to_dense_weights(self) -> list[torch.Tensor] | None:
        w = self._weights
        if w is None:
            return None
        return _bags(w, self._lengths)

    def _pad_to(self, desired_length: int | None) -> int:
        if desired_length is not None:
            return desired_length
        return int(self._lengths.max()) if self._lengths.numel() else 0

    def to_padded_dense(self, desired_length: int | None = None, padding_value: float = 0.0) -> torch.Tensor:
        """``[bags, N]`` (N = ``desired_length`` or the longest bag): longer bags are cut, shorter padded."""
        return _padded(self._values, self._lengths, self._offsets, self._pad_to(desired_length), padding_value)

    def to_padded_dense_weights(
        self, desired_length: int | None = None, padding_value: float = 0.0
    ) -> torch.Tensor | None:
        w = self._weights
        if w is None:
            return None
        return _padded(w, self._lengths, self._offsets, self._pad_to(desired_length), padding_value)

    # -- movement -----------------------------------------------------------------------------------
    def to(self, device: torch.device, non_blocking: bool = False) -> "JaggedTensor":
        w = self._weights
        return JaggedTensor(
            self._values.to(device, non_blocking=non_blocking),
            None if w is None else w.to(device, non_blocking=non_blocking),
            self._lengths.to(device, non_blocking=non_blocking),
            self._offsets.to(device, non_blocking=non_blocking),
        )

    @torch.jit.unused
    def record_stream(self, stream: torch.cuda.Stream) -> None:
        for t in (self._values, self._lengths, self._offsets, self._weights):
            if t is not None:
                t.record_stream(stream)

    @torch.jit.unused
    def __str__(self) -> str:
        return _format.jagged("JaggedTensor", self._values, self._weights, self._offsets)

    @torch.jit.unused
    def __repr__(self) -> str:
        w = "" if self._weights is None else f", weights={self._weights}"
        return f"JaggedTensor(values={self._values}, lengths={self._lengths}{w})"


def jt_is_equal(jt_1: JaggedTensor, jt_2: JaggedTensor) -> bool:
    """Same values, lengths and weights (TorchRec's ``jt_is_equal``)."""
    if not isinstance(jt_1, JaggedTensor) or not isinstance(jt_2, JaggedTensor):
        return False
    w1, w2 = jt_1.weights_or_none(), jt_2.weights_or_none()
    if (w1 is None) != (w2 is None):
        return False
    return (
        torch.equal(jt_1.values(), jt_2.values())
        and torch.equal(jt_1.lengths(), jt_2.lengths())
        and (w1 is None or torch.equal(w1, w2))  # type: ignore[arg-type]
    )


@torch.fx.wrap
def _from_dense_lengths(values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None) -> JaggedTensor:
    # one fx node: ``weights is None`` cannot be decided on a traced argument
    mask = torch.arange(values.size(1), device=values.device).unsqueeze(0) < lengths.unsqueeze(1)
    return JaggedTensor(values[mask], None if weights is None else weights[mask], lengths, None)


def jagged_from_checked(values: torch.Tensor, lengths: torch.Tensor) -> JaggedTensor:
    """A JaggedTensor of the library's own making, from ``lengths`` that an input check already saw: built
    without the data-dependent checks, each of which would make a CUDA host wait for its device."""
    jt = JaggedTensor.__new__(JaggedTensor)
    jt._lengths, jt._offsets = script_lengths_and_offsets(lengths, None)
    jt._values, jt._weights = values, None
    return jt
