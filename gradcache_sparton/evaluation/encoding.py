"""Encoding texts with a sparse encoder ``encoder(**features) -> [B, V]`` into :class:`SparseReps`.

Legend: B batch, S sequence, V vocabulary.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from gradcache_sparton.data.columns import QUERY_COLUMN
from gradcache_sparton.primitives.column_routing import call_encoder
from gradcache_sparton.primitives.sparse_reps import SparseReps

__all__ = [
    "PAD_TO_MULTIPLE_OF",
    "Encoder",
    "EncodingSettings",
    "check_max_lengths",
    "encode_texts",
    "encoder_device",
    "takes_encoding",
]

Encoder = Callable[..., Tensor]

# Pad like the training collator: shapes that are multiples of 8 suit tensor cores.
PAD_TO_MULTIPLE_OF = 8


def encoder_device(encoder: Encoder) -> torch.device:
    """The device of the encoder's first parameter (CPU for a parameterless callable)."""
    if isinstance(encoder, nn.Module):
        for parameter in encoder.parameters():
            return parameter.device
    return torch.device("cpu")


def check_max_lengths(**lengths: int) -> None:
    """``ValueError`` naming the first length (keyword: its name) that is not a positive multiple of
    :data:`PAD_TO_MULTIPLE_OF` (tokenizers cannot truncate to it and pad to a multiple of it)."""
    for name, value in lengths.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value % PAD_TO_MULTIPLE_OF:
            raise ValueError(f"{name} must be a positive multiple of {PAD_TO_MULTIPLE_OF}, got {value!r}")


@dataclass
class EncodingSettings:
    """How a checkpoint's queries and documents are encoded (:meth:`encode`, :func:`encode_texts`'s settings):
    the one configuration of evaluation, export, mining and the crossval teacher.

    Queries are truncated to ``query_max_length`` tokens and documents to ``document_max_length`` (positive
    multiples of :data:`PAD_TO_MULTIPLE_OF`), ``batch_size`` texts at a time on ``device`` (None: the
    encoder's), under ``torch.autocast`` when ``autocast_dtype`` is given, with a tqdm bar if
    ``show_progress``.
    """

    tokenizer: PreTrainedTokenizerBase
    query_max_length: int = 32
    document_max_length: int = 256
    batch_size: int = 64
    device: torch.device | str | None = None
    autocast_dtype: torch.dtype | None = None
    show_progress: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.tokenizer, PreTrainedTokenizerBase):
            raise TypeError(
                f"tokenizer must be a PreTrainedTokenizerBase, got {type(self.tokenizer).__name__}"
            )
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size!r}")
        check_max_lengths(
            query_max_length=self.query_max_length, document_max_length=self.document_max_length
        )

    def check_encoder(self, encoder: Encoder) -> None:
        """``ValueError`` naming the length if texts of ``query_max_length`` or ``document_max_length`` tokens
        would run past ``encoder``'s position table or leave no text token after its prefix (its own
        ``check_max_length``, as training checks it; an encoder without one, e.g. a plain callable, is not
        checked). :meth:`encode` runs it before any text is encoded."""
        check = getattr(encoder, "check_max_length", None)
        if callable(check):
            check("query_max_length", self.query_max_length, tokenizer=self.tokenizer)
            check("document_max_length", self.document_max_length, tokenizer=self.tokenizer)

    def device_for(self, encoder: Encoder) -> torch.device:
        """Where texts are encoded and their reps ranked: ``device``, else the encoder's
        (:func:`encoder_device`)."""
        return encoder_device(encoder) if self.device is None else torch.device(self.device)

    def encode(self, encoder: Encoder, texts: Sequence[str], *, column: str, desc: str) -> SparseReps:
        """``texts`` of one column (:data:`~gradcache_sparton.data.QUERY_COLUMN`: at ``query_max_length``;
        a document column: at ``document_max_length``) encoded by :func:`encode_texts` with these settings,
        after :meth:`check_encoder`."""
        self.check_encoder(encoder)
        return encode_texts(
            encoder,
            texts,
            tokenizer=self.tokenizer,
            max_length=self.query_max_length if column == QUERY_COLUMN else self.document_max_length,
            batch_size=self.batch_size,
            device=self.device,
            autocast_dtype=self.autocast_dtype,
            show_progress=self.show_progress,
            desc=desc,
            column=column,
        )


def encode_texts(
    encoder: Encoder,
    texts: Sequence[str],
    *,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    batch_size: int = 64,
    device: torch.device | str | None = None,
    autocast_dtype: torch.dtype | None = None,
    show_progress: bool = True,
    desc: str = "Encoding",
    column: str | None = None,
) -> SparseReps:
    """Encode ``texts`` with ``encoder(**features) -> [B, V]`` and keep the reps sparsely, on CPU.

    Texts are tokenised like the training collator (``truncation=True`` to ``max_length``,
    ``padding=True``, ``pad_to_multiple_of=8``) in batches of ``batch_size``, longest first (less
    padding), under ``torch.no_grad()`` and, if ``autocast_dtype`` is given, ``torch.autocast``.
    ``device`` defaults to the device of the encoder's first parameter (CPU for a parameterless
    callable). An ``nn.Module`` encoder is put in eval mode for the call and restored afterwards.
    The result is in the order of ``texts``; peak memory is one dense [batch_size, V] batch on the
    device plus the non-zeros on CPU. ``column``: what the texts are (``"query"``, or ``"document"`` for a
    corpus), for an encoder that encodes each column its own way (an inference-free model, see
    :mod:`~gradcache_sparton.primitives.column_routing`); other encoders ignore it.
    """
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise TypeError(f"texts must be a sequence of str, got {type(texts).__name__}")
    if len(texts) == 0:
        raise ValueError("texts is empty: nothing to encode")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    check_max_lengths(max_length=max_length)
    device = encoder_device(encoder) if device is None else torch.device(device)
    # Longest first: batches of similar lengths pad less, and the first batch shows the peak memory.
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]), reverse=True)
    autocast = (
        torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()
    )
    was_training = encoder.training if isinstance(encoder, nn.Module) else False
    if isinstance(encoder, nn.Module):
        encoder.eval()
    parts: list[SparseReps] = []
    try:
        with torch.no_grad(), autocast:
            for start in tqdm(range(0, len(texts), batch_size), desc=desc, disable=not show_progress):
                batch = [texts[i] for i in order[start : start + batch_size]]
                features = tokenizer(
                    batch,
                    padding=True,
                    truncation=True,
                    max_length=max_length,
                    pad_to_multiple_of=PAD_TO_MULTIPLE_OF,
                    return_tensors="pt",
                )
                inputs = {name: tensor.to(device) for name, tensor in features.items()}
                reps = (
                    call_encoder(encoder, column, inputs) if column is not None else encoder(**inputs)
                )  # [B, V]
                if not isinstance(reps, Tensor) or reps.dim() != 2 or reps.shape[0] != len(batch):
                    shape = tuple(reps.shape) if isinstance(reps, Tensor) else type(reps).__name__
                    raise ValueError(f"encoder must return a [B, V] tensor with B={len(batch)}, got {shape}")
                parts.append(SparseReps.from_dense(reps).to(torch.device("cpu")))
    finally:
        if isinstance(encoder, nn.Module):
            encoder.train(was_training)
    # Back from length order to the caller's order: row order[j] of the result is row j of `stacked`.
    inverse = torch.empty(len(texts), dtype=torch.int64)
    inverse[torch.tensor(order)] = torch.arange(len(texts))
    return SparseReps.concat(parts).select(inverse)


# The keywords one EncodingSettings replaced in the functions that take it (export_corpus's max_length: its
# document_max_length), refused with the call to write: the project keeps no deprecated aliases.
_FORMER_KEYWORDS = {
    "tokenizer": "tokenizer",
    "query_max_length": "query_max_length",
    "document_max_length": "document_max_length",
    "max_length": "document_max_length",
    "batch_size": "batch_size",
    "device": "device",
    "autocast_dtype": "autocast_dtype",
    "show_progress": "show_progress",
}

_Function = TypeVar("_Function", bound=Callable[..., Any])


def takes_encoding(function: _Function) -> _Function:
    """Decorate a function (or ``__init__``) with an ``encoding: EncodingSettings`` keyword: a call with the
    keywords it replaced (``tokenizer=``, ``query_max_length=``, ...) or with anything but an
    :class:`EncodingSettings` as ``encoding`` (a tokenizer) raises one ``TypeError`` that shows the call to
    write instead, before the function runs."""
    former = [k for k in _FORMER_KEYWORDS if k not in inspect.signature(function).parameters]
    name = function.__qualname__.removesuffix(".__init__")

    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        given = {k: kwargs[k] for k in former if k in kwargs}
        encoding = kwargs.get("encoding")
        if given or not (encoding is None or isinstance(encoding, EncodingSettings)):
            settings = ", ".join(
                ["tokenizer"] + [f"{_FORMER_KEYWORDS[k]}={v!r}" for k, v in given.items() if k != "tokenizer"]
            )
            wrong = (
                f"keyword(s) {sorted(given)} are no longer taken"
                if given
                else f"encoding must be an EncodingSettings, got {type(encoding).__name__}"
            )
            raise TypeError(
                f"{name}: {wrong}; how texts are encoded is one EncodingSettings: write "
                f"{name}(..., encoding=EncodingSettings({settings}))"
            )
        return function(*args, **kwargs)

    return checked  # type: ignore[return-value]
