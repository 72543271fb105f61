"""Encoders that encode each column their own way: the contract between such an encoder and its callers.

Most encoders are one function of the features, ``encoder(**features) -> [B, V]``, whatever the column. An
encoder whose class sets ``routes_by_column = True`` (an inference-free model: a weight table for the query
column, a transformer for every other) is called ``encoder(**features, column=name)`` instead, where
``name`` is the column the rows belong to (``"query"``, ``"positive"``, ``"negative_1"``, ...; in
retrieval, ``"query"`` for queries and ``"document"`` for the corpus). The GradCache engine, its memory
probe and the evaluation, mining and export encoders call every encoder through :func:`call_encoder`, so a
routed encoder sees its column in Step (1), in Step (3) and when encoding texts, and takes one forward
through its top-level module (what DDP and FSDP need to synchronise its gradients). A routed encoder also
has ``trains_column(column) -> bool``: False for a column whose route has no trainable parameter (a
frozen table), which the engine then does not replay.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["DOCUMENT_COLUMN", "ROUTED_COLUMN_KEYWORD", "call_encoder", "routes_by_column", "trains_column"]

#: The keyword a routed encoder receives its column by.
ROUTED_COLUMN_KEYWORD = "column"
#: The column a corpus is encoded as in retrieval, evaluation, mining and export (queries: ``"query"``).
DOCUMENT_COLUMN = "document"


def _routed_module(encoder: Callable[..., Tensor]) -> nn.Module | None:
    """The routed module behind ``encoder`` (through ``torch.compile`` and DDP), or None."""
    module = getattr(encoder, "_orig_mod", encoder)  # torch.compile keeps the module it was given
    if isinstance(module, DistributedDataParallel):
        module = module.module
    routed = isinstance(module, nn.Module) and getattr(type(module), "routes_by_column", False) is True
    return module if routed else None


def routes_by_column(encoder: Callable[..., Tensor]) -> bool:
    """True when ``encoder`` (or the module inside its ``torch.compile`` or DDP wrapper) sets
    ``routes_by_column = True``: it is called with the column as the keyword ``column``."""
    return _routed_module(encoder) is not None


def trains_column(encoder: Callable[..., Tensor], column: str) -> bool:
    """Whether encoding ``column`` reaches a trainable parameter: a routed encoder's ``trains_column(column)``
    (a frozen route's column needs no Step (3) replay), True for any other encoder."""
    module = _routed_module(encoder)
    return module is None or bool(module.trains_column(column))


def call_encoder(
    encoder: Callable[..., Tensor], column: str, features: Mapping[str, Tensor], *, routed: bool | None = None
) -> Tensor:
    """``encoder(**features)``, or ``encoder(**features, column=column)`` for an encoder that routes by column.

    ``routed``: whether it does, when the caller already knows (:func:`routes_by_column`, asked once per
    encoder rather than per call).
    """
    if routed if routed is not None else routes_by_column(encoder):
        return encoder(**features, **{ROUTED_COLUMN_KEYWORD: column})
    return encoder(**features)
