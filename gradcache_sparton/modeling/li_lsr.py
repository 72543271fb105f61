"""``LiLsrTable``: a query table computed through the embedding matrix (Li-LSR, arXiv 2505.01452).

Legend: V vocabulary, D hidden.

Each token's weight is a function of its input embedding, with D + 1 trained numbers for the whole
vocabulary:

    weight[v] = log(1 + relu(E[v] · w + b))        E [V, D] the embeddings, w [D], b a scalar

so training on some queries' tokens moves the weight of every token (through w and b), including tokens
no training query contains, where a free per-token table (:class:`QueryTable` with ``frozen=False``) moves
only the tokens it saw. ``E`` is a frozen copy of the document encoder's input word embeddings taken when
the table is made (:func:`li_lsr_table_from`): the table does not change when the encoder trains, and the
file holds all it needs. Special tokens weigh 0. A query's rep is then :class:`QueryTable`'s: the weight of
each distinct attended non-special token.

The start (:func:`li_lsr_table_from`) approximates a given table (the IDF): ``w`` and ``b`` minimise the
mean squared difference between the two tables' weights over the tokens the given table measured (those
below its largest weight: a token no document contains gets the largest IDF), by least squares of
``E · w + b`` against ``exp(weight) - 1`` and then L-BFGS on the weights themselves, in float64 on the CPU.

On disk: ``query_table.safetensors`` with the metadata ``kind`` ``"li_lsr"`` (besides ``special_token_ids``
and ``frozen``) and the fp32 tensors ``embedding`` [V, D], ``projection`` [D] (w) and ``bias`` [1] (b).
The table it induces (:attr:`LiLsrTable.weight`) is what ``idf.json`` and sentence-transformers'
``SparseStaticEmbedding`` get on export.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from gradcache_sparton.modeling.query_table import QueryTable

__all__ = ["LiLsrTable", "li_lsr_table_from"]

# L-BFGS iterations of the start's fit: the loss stops moving (relative change < 1e-9) well before 100 on
# SPLADE-tiny's 30,522 x 128 embeddings; each iteration is one [V, D] @ [D] product.
_FIT_ITERATIONS = 100


class LiLsrTable(QueryTable):
    """``table(input_ids, attention_mask) -> [B, V]`` with ``weight = log1p(relu(E · w + b))`` (module doc).

    Args:
        embedding: [V, D] the token embeddings E (copied, fp32, never trained).
        projection: [D] w.
        bias: b, a number or a one-element tensor.
        special_token_ids: ids that never count (weight 0).
        frozen: True: w and b are not trained.
    """

    kind = "li_lsr"

    def __init__(
        self,
        embedding: Tensor,
        projection: Tensor,
        bias: float | Tensor,
        *,
        special_token_ids: Sequence[int] = (),
        frozen: bool = False,
    ) -> None:
        nn.Module.__init__(self)  # no QueryTable.__init__: the weight is computed, not a parameter
        if not isinstance(embedding, Tensor) or embedding.dim() != 2 or embedding.numel() == 0:
            raise ValueError(f"embedding must be a non-empty [V, D] tensor, got {_shape(embedding)}")
        vocab_size, hidden = embedding.shape
        if not isinstance(projection, Tensor) or tuple(projection.shape) != (hidden,):
            raise ValueError(f"projection must be a [D] = [{hidden}] tensor, got {_shape(projection)}")
        bias = torch.as_tensor(bias, dtype=torch.float32).reshape(-1)
        if bias.numel() != 1:
            raise ValueError(f"bias must be one number, got {bias.numel()} values")
        if not isinstance(frozen, bool):
            raise TypeError(f"frozen must be a bool, got {type(frozen).__name__}")
        for name, value in (("embedding", embedding), ("projection", projection), ("bias", bias)):
            if not value.is_floating_point() or not bool(torch.isfinite(value).all()):
                raise ValueError(f"{name} must hold finite floating-point values")
        ids = sorted(set(special_token_ids))
        bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"special_token_ids must be ints in [0, {vocab_size}), got {bad}")
        self.register_buffer("embedding", embedding.detach().to(torch.float32).clone())
        self.projection = nn.Parameter(
            projection.detach().to(torch.float32).clone(), requires_grad=not frozen
        )
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=not frozen)
        self.register_buffer("_special_token_ids", torch.tensor(ids, dtype=torch.long), persistent=False)

    @property
    def weight(self) -> Tensor:
        """[V] the weight of each token, ``log1p(relu(E · w + b))``, special tokens 0 (differentiable in w, b)."""
        weight = torch.log1p(torch.relu(self.embedding @ self.projection + self.bias))  # [V, D] @ [D] -> [V]
        if self._special_token_ids.numel():
            weight = weight.index_fill(0, self._special_token_ids, 0.0)
        return weight

    @property
    def vocab_size(self) -> int:
        return self.embedding.shape[0]

    @property
    def frozen(self) -> bool:
        return not self.projection.requires_grad

    @property
    def query_encoder(self) -> str:
        return "li_lsr"

    @classmethod
    def from_tensors(
        cls, tensors: Mapping[str, Tensor], *, special_token_ids: Sequence[int], frozen: bool
    ) -> LiLsrTable:
        expected = {"embedding", "projection", "bias"}
        if set(tensors) != expected:
            raise ValueError(
                f"a li_lsr query table holds the tensors {sorted(expected)}, got {sorted(tensors)}"
            )
        return cls(
            tensors["embedding"],
            tensors["projection"],
            tensors["bias"],
            special_token_ids=special_token_ids,
            frozen=frozen,
        )

    def extra_repr(self) -> str:
        return f"hidden={self.embedding.shape[1]}, {super().extra_repr()}"


def li_lsr_table_from(
    table: QueryTable, embedding: Tensor, *, frozen: bool = False
) -> tuple[LiLsrTable, dict[str, float]]:
    """A :class:`LiLsrTable` over ``embedding`` [V, D] whose weights approximate ``table``'s (module doc: the
    fit), with its special tokens; and the fit's record: ``fit_tokens`` (how many weights it matched),
    ``fit_rmse`` and ``fit_correlation`` (Pearson) between the two tables over those tokens.

    ``ValueError`` unless the embedding has one row per table weight.
    """
    target = table.weight.detach().to("cpu", torch.float64)  # [V]
    embedding = embedding.detach().to("cpu", torch.float32)
    if embedding.dim() != 2 or embedding.shape[0] != target.numel():
        raise ValueError(
            f"the embedding matrix must be [V, D] with V = {target.numel()} (the table's), got {tuple(embedding.shape)}"
        )
    keep = torch.ones_like(target, dtype=torch.bool)
    keep[list(table.special_token_ids)] = False
    if bool((target[keep] < target[keep].max()).any()):
        keep &= target < target[keep].max()  # the largest weight is the IDF of a token no document has
    x = torch.cat([embedding.double()[keep], torch.ones(int(keep.sum()), 1, dtype=torch.float64)], dim=1)
    y = target[keep]
    solution = torch.linalg.lstsq(x, torch.expm1(y).unsqueeze(1)).solution.squeeze(1)  # [D + 1]
    solution.requires_grad_(True)
    optimizer = torch.optim.LBFGS([solution], max_iter=_FIT_ITERATIONS, line_search_fn="strong_wolfe")

    def loss() -> Tensor:
        optimizer.zero_grad()
        value = (torch.log1p(torch.relu(x @ solution)) - y).square().mean()  # [N, D + 1] @ [D + 1] -> [N]
        value.backward()
        return value

    optimizer.step(loss)
    solution = solution.detach()
    result = LiLsrTable(
        embedding,
        solution[:-1].float(),
        solution[-1:].float(),
        special_token_ids=table.special_token_ids,
        frozen=frozen,
    )
    fitted = result.weight.detach().double()[keep]
    record = {
        "fit_tokens": float(keep.sum()),
        "fit_rmse": float((fitted - y).square().mean().sqrt()),
        "fit_correlation": float(torch.corrcoef(torch.stack([fitted, y]))[0, 1]),
    }
    return result, record


def _shape(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__
