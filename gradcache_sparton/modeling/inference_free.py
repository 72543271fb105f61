"""``InferenceFreeEncoder``: a SPLADE document encoder and a query weight table in one module.

Legend: B batch, S sequence, V vocabulary.

Documents are encoded by the SPLADE encoder (the fused head, as :class:`SpladeEncoder`), queries by a
:class:`~gradcache_sparton.modeling.query_table.QueryTable` (each distinct token's weight, no
transformer). The model routes by column (:mod:`~gradcache_sparton.primitives.column_routing`):
``model(**features, column="query")`` is the table, any other column (``"positive"``, ``"negative_1"``,
``"document"``) the encoder. One module holds both, so DDP, FSDP, the optimizer and checkpoints see one
model; a frozen table has no trainable parameter and the GradCache engine skips replaying its column. A
learned table's gradient is synchronised under DDP like the encoder's when the query column comes before
a document column (as the training data's columns do): see :meth:`InferenceFreeEncoder.forward`.

On disk it is the document encoder's checkpoint (a standard masked-LM folder with its
``splade_config.json``, whose ``query_encoder`` records the table's name, :mod:`.query_encoder`) plus
``query_table.safetensors`` (:mod:`.query_table`): such a folder loads as this model
(:meth:`InferenceFreeEncoder.from_pretrained`), its document encoder as the siamese :class:`SpladeEncoder`,
and ``AutoModelForMaskedLM`` reads the document encoder alone.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gradcache_sparton.data.columns import QUERY_COLUMN
from gradcache_sparton.modeling.encoder import SpladeEncoder
from gradcache_sparton.modeling.query_encoder import load_query_encoder
from gradcache_sparton.modeling.query_table import QueryTable, save_query_table

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["InferenceFreeEncoder"]

# The query table's tensors in this model's state dict (the rest is the SpladeEncoder's).
_TABLE_PREFIX = "query_table."


class InferenceFreeEncoder(SpladeEncoder):
    """``model(**features, column=name) -> [B, V]``: queries by a weight table, documents by SPLADE (module doc).

    Args:
        model: the document side's masked-LM backbone, as for :class:`SpladeEncoder`.
        query_table: the query encoder; its V must be the decoder's.
        **options: the :class:`SpladeEncoder` options of the document side (pooling, special tokens, ...).
    """

    #: Called with ``column=`` by the engine and the encoders of texts (:mod:`~gradcache_sparton.primitives.column_routing`).
    routes_by_column = True

    def __init__(self, model: PreTrainedModel, *, query_table: QueryTable, **options: Any) -> None:
        super().__init__(model, **options)
        if not isinstance(query_table, QueryTable):
            raise TypeError(f"query_table must be a QueryTable, got {type(query_table).__name__}")
        if query_table.vocab_size != self.vocab_size:
            raise ValueError(
                f"the query table has {query_table.vocab_size} weights but the document encoder's decoder "
                f"vocab_size is {self.vocab_size}: rep dimensions would not line up"
            )
        self.query_table = query_table.to(self.head.weight.device)

    @classmethod
    def from_document_encoder(cls, encoder: SpladeEncoder, query_table: QueryTable) -> InferenceFreeEncoder:
        """The inference-free model over ``encoder``'s backbone (shared, not copied), with its options and
        training record, and ``query_table`` for queries."""
        if type(encoder) is not SpladeEncoder:
            raise TypeError(f"encoder must be a SpladeEncoder, got {type(encoder).__name__}")
        model = cls(
            encoder.model,
            query_table=query_table,
            pooling=encoder.pooling,
            special_token_ids=encoder.special_token_ids,
            **encoder._pooling_options(),
        )
        model.query_max_length = encoder.query_max_length
        model.document_max_length = encoder.document_max_length
        model.lora = encoder.lora
        return model

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike, *, frozen: bool | None = None, **kwargs: Any
    ) -> InferenceFreeEncoder:
        """Load a local inference-free folder: the document encoder (``SpladeEncoder.from_pretrained`` with
        ``kwargs``) and its ``query_table.safetensors`` (``frozen`` None: as saved).

        ``ValueError`` naming the folder if its query encoder is ``"splade"`` (a siamese checkpoint: load it
        with :class:`SpladeEncoder`, or build a table with ``gradcache-sparton idf``), and naming the files if
        the recorded query encoder contradicts them (:func:`~.query_encoder.load_query_encoder`).
        """
        path = os.fspath(pretrained_model_name_or_path)
        query_encoder, table = load_query_encoder(path)
        if table is None:
            raise ValueError(
                f"{path!r} is not an inference-free model (its query encoder is {query_encoder!r}: a siamese "
                "SPLADE checkpoint loads as SpladeEncoder; `gradcache-sparton idf` adds an IDF query table)"
            )
        if frozen is not None:
            table.requires_grad_(not frozen)
        return cls.from_document_encoder(SpladeEncoder.from_pretrained(path, **kwargs), table)

    @property
    def query_encoder(self) -> str:
        """What encodes this model's queries: its table's name (``"idf"``, ``"learned_idf"``, ``"li_lsr"``)."""
        return self.query_table.query_encoder

    def document_encoder(self) -> SpladeEncoder:
        """The document side alone, as a :class:`SpladeEncoder` sharing this model's backbone."""
        encoder = SpladeEncoder(
            self.model,
            pooling=self.pooling,
            special_token_ids=self.special_token_ids,
            **self._pooling_options(),
        )
        encoder.query_max_length, encoder.document_max_length = (
            self.query_max_length,
            self.document_max_length,
        )
        encoder.lora = self.lora
        return encoder

    def trains_column(self, column: str) -> bool:
        """Whether encoding ``column`` reaches a trainable parameter (the query column's: a learned table)."""
        return column != QUERY_COLUMN or not self.query_table.frozen

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        token_type_ids: Tensor | None = None,
        *,
        column: str | None = None,
        **kwargs: Any,
    ) -> Tensor:
        """[B, S] features of the rows of ``column`` -> [B, V] reps: the table for ``"query"``, else SPLADE."""
        if column is None:
            raise ValueError(
                "InferenceFreeEncoder encodes queries and documents differently: call it with column='query' "
                "for queries or the document column's name (e.g. column='document')"
            )
        if column == QUERY_COLUMN:
            return self.query_table(input_ids, attention_mask)  # [B, V], no transformer
        reps = super().forward(input_ids, attention_mask, token_type_ids, **kwargs)  # [B, V]
        trained = [p for p in self.query_table.parameters() if p.requires_grad]
        if trained and torch.is_grad_enabled():
            # Adds exactly 0, but the backward reaches the learned table: GradCache's last replayed mini-batch,
            # the one whose backward synchronises data-parallel gradients, is a document one, and DDP reduces
            # only parameters that backward reaches (the table's gradient from the query mini-batches included).
            reps = reps + sum(p.reshape(-1)[:1].sum() for p in trained) * 0  # [B, V] + [] -> [B, V]
        return reps

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        state_dict: Mapping[str, Tensor] | None = None,
        **kwargs: Any,
    ) -> None:
        """The document encoder's checkpoint (:meth:`SpladeEncoder.save_pretrained`) plus ``query_table.safetensors``.

        A given ``state_dict`` is this model's (e.g. gathered from a distributed run): its table's tensors are
        written to the table's file, the rest as the document encoder's.
        """
        table = self.query_table
        if state_dict is not None:
            state_dict = dict(state_dict)
            tensors = {
                name[len(_TABLE_PREFIX) :]: state_dict.pop(name)
                for name in list(state_dict)
                if name.startswith(_TABLE_PREFIX)
            }
            if tensors:
                table = table.with_tensors(tensors)
        super().save_pretrained(save_directory, tokenizer=tokenizer, state_dict=state_dict, **kwargs)
        if kwargs.get("is_main_process", True):
            save_query_table(table, save_directory)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, query_encoder={self.query_encoder!r}"
