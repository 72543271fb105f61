"""``SpartonHead``: the fused SPLADE head as an ``nn.Module``, usually tied to a masked-LM decoder.

The computation is :func:`~gradcache_sparton.kernels.sparton_head` (``sparton_ops.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gradcache_sparton.kernels.reference import DEFAULT_HEAD_ACTIVATION, check_head_activation
from gradcache_sparton.kernels.sparton_ops import sparton_head

__all__ = ["SpartonHead"]


class SpartonHead(nn.Module):
    """SPLADE head: max over the sequence of log1p(relu(logits)), masked, fused so logits never exist.

    Usually built from (and sharing the parameters of) a masked-LM decoder with
    :meth:`from_decoder` or :meth:`tie_weights`, so a model saved with ``save_pretrained`` stays a
    standard masked-LM checkpoint with no extra tensors.

    ``activation_function``: the activation before the log1p, as sentence-transformers' ``SpladePooling``
    names it: ``"relu"`` (SPLADE, the default) or ``"log1p_relu"`` (log1p(log1p(relu(logits))), OpenSearch
    v3's "l0" activation); ``ValueError`` for anything else.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        *,
        bias: bool = True,
        activation_function: str = DEFAULT_HEAD_ACTIVATION,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_head_activation(activation_function)
        if hidden_size < 1 or vocab_size < 1:
            raise ValueError(
                f"hidden_size and vocab_size must be >= 1, got hidden_size={hidden_size}, "
                f"vocab_size={vocab_size}"
            )
        self.activation_function = activation_function
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(vocab_size, device=device, dtype=dtype)) if bias else None
        if self.weight.device.type != "meta":
            nn.init.normal_(self.weight, std=0.02)

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]

    @classmethod
    def from_decoder(
        cls, decoder: nn.Linear, *, activation_function: str = DEFAULT_HEAD_ACTIVATION
    ) -> SpartonHead:
        """A head that shares ``decoder.weight`` [V, D] and ``decoder.bias`` [V] (no copy)."""
        if not isinstance(decoder, nn.Linear):
            raise TypeError(f"decoder must be an nn.Linear, got {type(decoder).__name__}")
        head = cls(
            decoder.in_features,
            decoder.out_features,
            bias=decoder.bias is not None,
            activation_function=activation_function,
            device="meta",
        )
        head.tie_weights(decoder)
        return head

    def tie_weights(self, decoder: nn.Linear) -> None:
        """Share the parameters of a masked-LM decoder (``nn.Linear(D, V)``) instead of owning copies."""
        if not isinstance(decoder, nn.Linear):
            raise TypeError(f"decoder must be an nn.Linear, got {type(decoder).__name__}")
        for name in ("weight", "bias"):
            value = getattr(decoder, name)
            if value is None or isinstance(value, nn.Parameter):
                setattr(self, name, value)
            else:  # a DataParallel replica's decoder: torch's replicate() puts plain tensors in _parameters
                self._parameters[name] = value

    def forward(self, hidden_states: Tensor, attention_mask: Tensor) -> Tensor:
        """[B, S, D] hidden states and [B, S] 0/1 mask -> [B, V] sparse reps."""
        return sparton_head(
            hidden_states,
            self.weight,
            self.bias,
            attention_mask,
            activation_function=self.activation_function,
        )

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, bias={self.bias is not None}, "
            f"activation_function={self.activation_function!r}"
        )
