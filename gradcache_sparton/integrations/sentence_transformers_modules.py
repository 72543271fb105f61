"""sentence-transformers modules that our checkpoints name in their ``modules.json``.

Imported by sentence-transformers when it loads such a checkpoint (``trust_remote_code=True`` is
needed for any module outside its own namespace), and by our bridge. Importing this module imports
sentence-transformers. Its dotted path is written into saved checkpoints, so it stays where it is,
beside the bridge package (:mod:`gradcache_sparton.integrations.sentence_transformers`).

Legend: B batch, S sequence, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Literal

import torch
from sentence_transformers.sparse_encoder.modules import SpladePooling
from torch import Tensor

__all__ = ["SpecialTokenMaskedSpladePooling"]


class SpecialTokenMaskedSpladePooling(SpladePooling):
    """``SpladePooling`` that also drops the positions of ``special_token_ids`` from the pooling.

    The pooling of a :class:`~gradcache_sparton.modeling.SpladeEncoder` trained with
    ``special_token_ids`` (e.g. ``tokenizer.all_special_ids``): the positions whose input id is one of
    them are removed from the max on top of the attention mask, exactly as the encoder does, while
    the backbone still attends to them.
    """

    config_keys: ClassVar[list[str]] = [*SpladePooling.config_keys, "special_token_ids"]

    def __init__(
        self,
        pooling_strategy: Literal["max", "sum"] = "max",
        activation_function: Literal["relu", "log1p_relu"] = "relu",
        embedding_dimension: int | None = None,
        chunk_size: int | None = None,
        special_token_ids: Sequence[int] = (),
    ) -> None:
        super().__init__(pooling_strategy, activation_function, embedding_dimension, chunk_size)
        self.special_token_ids = sorted({int(i) for i in special_token_ids})

    def forward(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
        """``features["sentence_embedding"]`` [B, V] pooled over attended, non-special positions."""
        if "cu_seq_lens_q" in features:
            raise ValueError(
                "SpecialTokenMaskedSpladePooling needs padded [B, S] inputs, got flattened (unpadded) ones: "
                "set model[0].unpad_inputs = False"
            )
        input_ids, attention_mask = features["input_ids"], features["attention_mask"]  # [B, S]
        ids = torch.tensor(self.special_token_ids, dtype=input_ids.dtype, device=input_ids.device)
        mask = attention_mask.bool() & ~torch.isin(input_ids, ids)  # [B, S]
        pooled = super().forward({**features, "attention_mask": mask.to(attention_mask.dtype)})
        features["sentence_embedding"] = pooled["sentence_embedding"]  # [B, V]
        return features
