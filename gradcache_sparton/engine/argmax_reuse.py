"""``reuse_argmax``: Step (3) rebuilds the Sparton head from Step (1)'s (max, argmax), skipping its forward.

Inside a GradCache step with ``reuse_argmax`` (the contract is :mod:`gradcache_sparton.primitives.forward_memo`),
Step (1)'s head forward hands its memo (max, argmax), and the memo keeps them at the entries whose
gradient can be non-zero (max > 0 or NaN), 12 bytes each, with fingerprints of everything the forward
read: H, E and bias (compacted one mini-batch late, so that no record waits on the device). The Step
(3) replay skips the forward kernel: the head rebuilds Y = log1p(max) from the record and runs its
backward op on the record's (max, argmax), bit for bit the backward of an uncached step with the same
H, E and bias. The memo reports whether the replay's H, E and bias were Step (1)'s, so that a change
between the two (an optimizer step, an in-place edit of the decoder) fails the replay check instead of
giving the gradient of another function.

Legend: B batch, S sequence, D hidden, V vocabulary.

Ownership: the engine makes one :class:`ArgmaxReuse` per Step (1); it makes each mini-batch's
:class:`ArgmaxMemo` and follows the record kept last while it is dense. Each memo holds its mini-batch's
records, in call order, until Step (3) takes them back. Nothing is kept at module level.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from gradcache_sparton.primitives.host_count import HostCount

__all__ = ["ArgmaxMemo", "ArgmaxReuse"]


class ArgmaxReuse:
    """One Step (1)'s argmax records: makes each mini-batch's memo, and holds the record kept last while it
    is dense (weakly: an abandoned step's record is freed with it), to compact it when the next is kept."""

    def __init__(self) -> None:
        self._dense: weakref.ref[_HeadRecord] | None = None

    def memo(self) -> ArgmaxMemo:
        """A new mini-batch's memo, to pass to :func:`~gradcache_sparton.primitives.forward_memo.recording` and then
        :func:`~gradcache_sparton.primitives.forward_memo.replaying`."""
        return ArgmaxMemo(self)

    def _kept(self, record: _HeadRecord) -> None:
        """``record`` was just kept: the record kept before it, if still dense, is compacted now."""
        earlier = None if self._dense is None else self._dense()
        if earlier is not None:
            earlier.compact()
        self._dense = weakref.ref(record)


class ArgmaxMemo:
    """One mini-batch's head records, in the order its forward made them (a
    :class:`~gradcache_sparton.primitives.forward_memo.ForwardMemo`).

    Each record is taken back once, in that order; taking drops the memo's reference to it, so a
    record's memory is freed as soon as its replayed backward has run.
    """

    def __init__(self, owner: ArgmaxReuse) -> None:
        self._owner = owner
        self._records: list[_HeadRecord | None] = []
        self._taken = 0
        self._differs: list[Tensor] = []  # one bool per record taken: its inputs were not Step (1)'s

    def __len__(self) -> int:
        """How many records Step (1) made."""
        return len(self._records)

    def record(
        self, hidden_states: Tensor, weight: Tensor, bias: Tensor | None, max_logits: Tensor, argmax: Tensor
    ) -> None:
        """Step (1): keep the head forward's [B, V] (max, argmax) on (H, E, bias); the record kept before,
        if still dense, is compacted."""
        record = _HeadRecord(hidden_states, weight, bias, max_logits, argmax)
        self._records.append(record)
        self._owner._kept(record)

    def take(self, hidden_states: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
        """Step (3): the next record's [B, V] (max, argmax), in Step (1)'s order; whether the replay's H, E
        and bias are bitwise Step (1)'s is compared on the device and kept for :meth:`differs`.

        Raises:
            RuntimeError: the replay asks for more records than Step (1) made, or for one of another
                shape, so it does not follow Step (1)'s path through the encoder.
        """
        if self._taken >= len(self._records):
            raise RuntimeError(
                f"the replayed forward asked for record {self._taken + 1} but Step (1) made "
                f"{len(self._records)}: the encoder did not take the same path through its modules twice"
            )
        record = self._records[self._taken]
        self._records[self._taken] = None
        self._taken += 1
        if (
            record.hidden_shape != tuple(hidden_states.shape)
            or record.hidden_dtype != hidden_states.dtype
            or record.vocab_size != weight.shape[0]
        ):
            raise RuntimeError(
                f"the replayed Sparton head got hidden states {list(hidden_states.shape)} "
                f"{hidden_states.dtype} and V = {weight.shape[0]}, but Step (1) recorded hidden states "
                f"{list(record.hidden_shape)} {record.hidden_dtype} and V = {record.vocab_size} at this "
                "call: the encoder did not take the same path twice"
            )
        # The rebuilt output and backward are the forward's only if it would read what Step (1)'s read: the
        # same H (which also covers every weight before the head) and the same E and bias.
        hidden_differs = (
            _row_sums(hidden_states).view(torch.int32) != record.fingerprint.view(torch.int32)
        ).any()
        weights_differ = (_weights_digest(weight, bias) != record.weights_digest).any()
        self._differs.append(hidden_differs | weights_differ)
        return record.restore()  # [B, V] each

    @property
    def fully_taken(self) -> bool:
        """Whether the replay took every record Step (1) made."""
        return self._taken == len(self._records)

    def differs(self) -> Tensor | None:
        """A bool scalar on the device: whether any record taken was given inputs other than Step (1)'s;
        None when none was taken. Nothing is read back here."""
        if not self._differs:
            return None
        return torch.stack([flag.to(self._differs[0].device) for flag in self._differs]).any()


class _HeadRecord:
    """Step (1)'s (max, argmax) at the live entries, where max > 0 or is NaN: elsewhere max is 0 (relu)
    and the backward sends nothing whatever the argmax. Legend: n live entries of the [B, V] grid.

    - ``positions`` [n] flat indices into [B, V] (int32 while B·V < 2**31, else int64),
    - ``max_logits`` [n] in the saved max's dtype (fp32; fp64 for fp64 inputs),
    - ``argmax`` [n] int32 sequence positions,
    - ``fingerprint`` [B] fp32 row sums of H, to check that the replay's H is bitwise Step (1)'s,
    - ``weights_digest`` [2] int64 digests of E and bias as the forward read them (after autocast's cast),
      to check that the replay's are bitwise Step (1)'s (:func:`_bits_digest`).

    Keeping the live entries needs their count n on the host, and reading it right away would stall
    the host until the device has finished this mini-batch, once per mini-batch. So a record is kept in
    two stages: it is made holding the dense [B, V] (max, argmax) and starts copying n to the host
    behind the work queued so far; the record is compacted to its n entries when the next record is
    kept (by then the host has queued the next mini-batch, so waiting for this copy leaves the device
    busy), or when it is taken back, whichever comes first. At most two of a Step (1)'s records are
    dense at once, and no step waits on the device for them.
    """

    def __init__(
        self, hidden_states: Tensor, weight: Tensor, bias: Tensor | None, max_logits: Tensor, argmax: Tensor
    ) -> None:
        self.hidden_shape = tuple(hidden_states.shape)
        self.hidden_dtype = hidden_states.dtype
        self.vocab_size = max_logits.shape[1]
        self.fingerprint = _row_sums(hidden_states)
        self.weights_digest = _weights_digest(weight, bias)
        flat_max = max_logits.detach().reshape(-1)  # [B, V] -> [B·V]; a record never holds a graph
        live = (flat_max > 0) | flat_max.isnan()  # [B·V]
        self._dense: tuple[Tensor, Tensor, Tensor] | None = (flat_max, argmax.reshape(-1), live)
        self._count = HostCount(live.sum())
        self.positions: Tensor | None = None
        self.max_logits: Tensor | None = None
        self.argmax: Tensor | None = None

    def compact(self) -> None:
        """Keep only the live entries (waits for their count, copied to the host when the record was kept)."""
        if self._dense is None:
            return
        flat_max, flat_arg, live = self._dense
        n = self._count.value()
        index_dtype = torch.int32 if flat_max.numel() < 2**31 else torch.int64
        positions = torch.nonzero_static(live, size=n).squeeze(1)  # [n] int64; n known: no sync
        self.positions = positions.to(index_dtype)
        self.max_logits = flat_max[positions]
        self.argmax = flat_arg[positions]
        self._dense = None

    def restore(self) -> tuple[Tensor, Tensor]:
        """The forward op's [B, V] (max, argmax): the kept entries, 0 elsewhere (what relu left there)."""
        self.compact()
        B, V = self.hidden_shape[0], self.vocab_size
        positions = self.positions.long()
        mx = self.max_logits.new_zeros(B * V).index_copy_(0, positions, self.max_logits)
        arg = self.argmax.new_zeros(B * V).index_copy_(0, positions, self.argmax)
        return mx.view(B, V), arg.view(B, V)


def _row_sums(hidden_states: Tensor) -> Tensor:
    """[B, S, D] -> [B] fp32 sums, computed alike in Step (1) and Step (3) (no graph, no autocast)."""
    with torch.no_grad(), torch.autocast(hidden_states.device.type, enabled=False):
        return hidden_states.detach().sum(dim=(1, 2), dtype=torch.float32)


def _bits_digest(tensor: Tensor) -> Tensor:
    """An int64 scalar digest of ``tensor``'s bits: the sum of its elements' bit patterns read as integers.

    Integer sums are exact and independent of summation order, so bitwise-equal tensors give equal
    digests on any device, and a change of any single element (by as little as one ulp, which a
    floating-point sum can absorb) always changes it. A permutation of the elements keeps it, as it
    keeps the reps' row sums that check the replay without ``reuse_argmax``. One read of the tensor, no
    copy (a same-size integer view), no device sync.
    """
    integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    with torch.no_grad():
        return tensor.detach().view(integer).sum(dtype=torch.int64)


def _weights_digest(weight: Tensor, bias: Tensor | None) -> Tensor:
    """[2] int64: the digests of E [V, D] and bias [V] (0 without one), as the forward op reads them."""
    bias_digest = weight.new_zeros((), dtype=torch.int64) if bias is None else _bits_digest(bias)
    return torch.stack([_bits_digest(weight), bias_digest])
