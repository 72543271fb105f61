"""The training collator: rows -> ``{"columns": {name: tokenizer features}, "loss_kwargs": {...}}``.

Legend: B batch, S sequence.

Collator output (:class:`TrainingCollator`, typed as :class:`TrainingBatch`)
    ``{"columns": {"query": {...}, "positive": {...}, "negative_1": {...}, ...},
    "loss_kwargs": {"teacher_scores": Tensor [B, ...], ...}}``
    where each column maps to the tokenizer's features (``input_ids``, ``attention_mask`` and,
    for BERT, ``token_type_ids``), each [B, S_column]: ``batch["columns"]`` is exactly the engine's
    batch contract, ``batch["loss_kwargs"]`` goes to ``loss_fn(reps, **loss_kwargs)``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from gradcache_sparton.data.columns import (
    NEGATIVE_PREFIX,
    NEGATIVES_COLUMN,
    POSITIVE_COLUMN,
    QUERY_COLUMN,
    TEACHER_COLUMN,
    negative_number,
    text_columns_of,
)
from gradcache_sparton.data.token_cache import TokenCache

__all__ = ["TrainingBatch", "TrainingCollator"]

logger = logging.getLogger(__name__)


class TrainingBatch(TypedDict):
    """What :class:`TrainingCollator` returns.

    - ``columns``: column name -> tokenizer features (``input_ids``, ``attention_mask``, ...), each
      [B, S_column], in column order query, positive, negative_1, ..., negative_k (the engine contract).
    - ``loss_kwargs``: extra numeric column name -> tensor with the batch dimension first (e.g.
      ``teacher_scores`` [B, 1 + k]); empty when the data has no extra column.
    - ``repeated_positives``: rows of this batch whose positive repeats another row's (in-batch false
      negatives); the trainer sums them, which also works when dataloader workers collate.
    """

    columns: dict[str, dict[str, Tensor]]
    loss_kwargs: dict[str, Tensor]
    repeated_positives: int


@dataclass
class TrainingCollator:
    """Tokenise a list of training rows into a :class:`TrainingBatch`.

    Each text column is tokenised on its own with ``padding=True`` (to the longest row of the batch),
    ``truncation=True`` and ``pad_to_multiple_of`` (8: tensor-core friendly shapes): the ``query``
    column to at most ``query_max_length`` tokens, every document column (positive and negatives) to
    at most ``document_max_length`` tokens. Truncation is the configured behaviour: a longer text
    keeps its first ``max_length`` tokens (special tokens included). Both max lengths must be multiples
    of ``pad_to_multiple_of`` (a transformers requirement when truncating and padding together).

    ``pad_to_max_length``: pad every batch to the max lengths instead of its longest row. Every batch then
    has one shape, so a ``max_memory`` plan measured on the first batch covers every later one (a batch
    longer than the plan's is planned again, a probe of seconds). It costs no encoding: the engine trims
    each mini-batch's trailing padding before running it.

    ``token_cache``: the training texts tokenized once (:class:`~.token_cache.TokenCache`); a batch whose
    texts are all in it is only padded, to the same features (the tokenizer runs for the others).

    ``batch_teacher``: ``batch_teacher(queries, documents) -> [B, (1+k)·B]``, the teacher's scores of every
    query of the batch against every document of it (``documents``: the document columns in order, B texts
    each; :class:`~gradcache_sparton.mining.BatchTeacher`), attached as ``loss_kwargs["teacher_scores"]``; the
    rows then carry no ``teacher_scores`` of their own.

    A ``negatives`` list column becomes ``negative_1..k``. Extra columns must be numeric and become
    ``loss_kwargs`` tensors (``torch.tensor`` of the batch's values: ints stay int64, floats become
    float32). The collator does not depend on the batch size; training drops the last incomplete
    batch in the dataloader (``dataloader_drop_last=True``), not here.
    """

    tokenizer: PreTrainedTokenizerBase
    query_max_length: int = 32
    document_max_length: int = 256
    pad_to_multiple_of: int | None = 8
    pad_to_max_length: bool = False
    token_cache: TokenCache | None = None
    batch_teacher: Callable[[list[str], list[list[str]]], Tensor] | None = None
    #: Rows so far whose positive repeated another row's in the same batch (in-batch false negatives).
    repeated_positives: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.tokenizer, PreTrainedTokenizerBase):
            raise TypeError(
                f"tokenizer must be a PreTrainedTokenizerBase, got {type(self.tokenizer).__name__}"
            )
        for name in ("query_max_length", "document_max_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.pad_to_multiple_of is not None and (
            isinstance(self.pad_to_multiple_of, bool)
            or not isinstance(self.pad_to_multiple_of, int)
            or self.pad_to_multiple_of < 1
        ):
            raise ValueError(
                f"pad_to_multiple_of must be a positive int or None, got {self.pad_to_multiple_of!r}"
            )
        if self.pad_to_multiple_of is not None:
            # transformers refuses to truncate to a length it could not pad to a multiple of.
            for name in ("query_max_length", "document_max_length"):
                if getattr(self, name) % self.pad_to_multiple_of:
                    raise ValueError(
                        f"{name}={getattr(self, name)} must be a multiple of pad_to_multiple_of="
                        f"{self.pad_to_multiple_of} (tokenizers cannot truncate to it and pad to a multiple)"
                    )

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> TrainingBatch:
        if len(rows) == 0:
            raise ValueError("rows is empty: a batch needs at least one row")
        texts = self._text_columns(rows)
        repeated = self._count_repeated_positives(texts[POSITIVE_COLUMN])
        columns: dict[str, dict[str, Tensor]] = {}
        for name, values in texts.items():
            max_length = self.query_max_length if name == QUERY_COLUMN else self.document_max_length
            features = None
            if self.token_cache is not None:
                features = self.token_cache.features(
                    values,
                    is_query=name == QUERY_COLUMN,
                    length=max_length if self.pad_to_max_length else None,
                    multiple=self.pad_to_multiple_of,
                )
            if features is None:
                features = dict(
                    self.tokenizer(
                        values,
                        padding="max_length" if self.pad_to_max_length else True,
                        truncation=True,
                        max_length=max_length,
                        pad_to_multiple_of=self.pad_to_multiple_of,
                        return_tensors="pt",
                    )
                )
            columns[name] = features  # [B, S_column] each
        loss_kwargs = self._loss_kwargs(rows)
        if self.batch_teacher is not None:
            if TEACHER_COLUMN in loss_kwargs:
                raise ValueError(
                    f"the rows have a {TEACHER_COLUMN!r} column and the collator has a batch_teacher: both are "
                    "teacher scores; drop one (neither is preferred silently)"
                )
            documents = [values for name, values in texts.items() if name != QUERY_COLUMN]
            loss_kwargs[TEACHER_COLUMN] = self.batch_teacher(texts[QUERY_COLUMN], documents)  # [B, (1+k)·B]
        return TrainingBatch(columns=columns, loss_kwargs=loss_kwargs, repeated_positives=repeated)

    def _count_repeated_positives(self, positives: Sequence[str]) -> int:
        """The rows whose positive repeats an earlier row's in this batch; warn at the first such batch.

        Under in-batch negatives the repeated text is scored as a negative of the other row's query although
        it is that query's positive (an in-batch false negative), which pushes a relevant document down. Not
        an error: a shuffled batch of real data may rightly hold two queries with one relevant document, and
        the loss of the other rows is unaffected. ``repeated_positives`` keeps this collator's running count
        (in a dataloader worker, that worker's: the batch's own count is what reaches the trainer).
        """
        repeated = len(positives) - len(set(positives))
        if repeated and not self.repeated_positives:
            logger.warning(
                "%d row(s) of a batch of %d repeat another row's positive: under in-batch negatives each copy "
                "is a false negative of the other's query. Deduplicate (query, positive) pairs in the data if "
                "this is not intended; each batch reports its count (repeated_positives), which the trainer "
                "logs as the run's total.",
                repeated,
                len(positives),
            )
        self.repeated_positives += repeated
        return repeated

    def _text_columns(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
        names = text_columns_of(rows[0].keys())
        texts: dict[str, list[str]] = {name: [] for name in names if name != NEGATIVES_COLUMN}
        num_listed = len(rows[0][NEGATIVES_COLUMN]) if NEGATIVES_COLUMN in names else 0
        for i in range(num_listed):
            texts[f"{NEGATIVE_PREFIX}{i + 1}"] = []
        for index, row in enumerate(rows):
            for name in names:
                if name not in row:
                    raise ValueError(f"row {index} of the batch has no column {name!r} (row 0 has it)")
                if name == NEGATIVES_COLUMN:
                    listed = row[name]
                    if (
                        not isinstance(listed, Sequence)
                        or isinstance(listed, str)
                        or len(listed) != num_listed
                    ):
                        raise ValueError(
                            f"row {index} of the batch: column {NEGATIVES_COLUMN!r} must be a list of "
                            f"{num_listed} texts like row 0's, got {listed!r:.80}"
                        )
                    values = {f"{NEGATIVE_PREFIX}{i + 1}": text for i, text in enumerate(listed)}
                else:
                    values = {name: row[name]}
                for column, text in values.items():
                    if not isinstance(text, str):
                        raise ValueError(
                            f"row {index} of the batch: column {column!r} must be a str, got "
                            f"{type(text).__name__} (rows must all have the same number of negatives)"
                        )
                    texts[column].append(text)
            extra_negatives = [n for n in row if negative_number(n) is not None and n not in names]
            if extra_negatives:
                raise ValueError(f"row {index} of the batch has column(s) {extra_negatives} that row 0 lacks")
        return texts

    @staticmethod
    def _loss_kwargs(rows: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        text_names = set(text_columns_of(rows[0].keys()))
        loss_kwargs: dict[str, Tensor] = {}
        for name in rows[0]:
            if name in text_names:
                continue
            values = [row.get(name) for row in rows]
            try:
                tensor = torch.tensor(values)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise ValueError(
                    f"extra column {name!r} must hold numbers (or equal-length lists of numbers) in every "
                    f"row to become a loss_kwargs tensor; torch.tensor failed: {exc}"
                ) from None
            if tensor.is_floating_point():
                tensor = tensor.float()
            loss_kwargs[name] = tensor  # [B, ...]
        return loss_kwargs
