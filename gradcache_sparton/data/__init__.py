"""Training data: (query, positive[, negatives...]) rows, BEIR folders, self-supervised pairs, the collator.

Legend: B batch, S sequence.

One job per module:

- :mod:`.shipped`: paths of the shipped SciFact sample (training rows, dev BEIR folder).
- :mod:`.beir`: BEIR folders (corpus, queries, qrels) and the one BEIR corpus reader.
- :mod:`.pairs`: self-supervised (sentence, rest of the document) pairs from a bare corpus.
- :mod:`.columns`: the training-row column names and their order.
- :mod:`.validation`: checks a ``datasets.Dataset`` of training rows.
- :mod:`.loading`: loads training rows from files (or takes a Dataset) and validates them.
- :mod:`.collator`: tokenises rows into the engine's batch contract.
- :mod:`.token_cache`: the training texts tokenized once, before training, for the collator to pad.
- :mod:`.output`: writes training rows to a file (mined negatives), never over one without ``overwrite``.

Training rows
    A training dataset is any ``datasets.Dataset`` (or jsonl/json/csv/parquet files, optionally
    compressed, loaded by :func:`load_training_data`) with the text columns

    - ``query`` and ``positive`` (required), and
    - hard negatives, either as ``negative_1``, ..., ``negative_k`` or as one list column
      ``negatives``; every row must have the same number k (the loss sees one [B, V] rep matrix
      per column, so a ragged batch has no meaning).

    Any other column must be numeric (a number, or a fixed-length list of numbers per row, e.g.
    ``teacher_scores`` for MarginMSE); the collator passes it to the loss as a ``loss_kwargs``
    tensor with the batch dimension first. A non-numeric extra column is an error, not silently
    dropped: remove it with ``dataset.remove_columns``.

``datasets`` is imported inside the functions that need it (not at module import), so the collator,
the BEIR loader and evaluation work on a machine that has torch and transformers but not ``datasets``.
"""

from gradcache_sparton.data.beir import (
    BeirData,
    CorpusDocument,
    beir_training_pairs,
    iter_corpus,
    load_beir,
    read_corpus,
)
from gradcache_sparton.data.collator import TrainingBatch, TrainingCollator
from gradcache_sparton.data.columns import (
    NEGATIVE_PREFIX,
    NEGATIVES_COLUMN,
    POSITIVE_COLUMN,
    QUERY_COLUMN,
    TEACHER_COLUMN,
)
from gradcache_sparton.data.loading import load_training_data
from gradcache_sparton.data.output import check_output_path, write_training_file
from gradcache_sparton.data.pairs import self_supervised_pairs, split_sentences
from gradcache_sparton.data.shipped import (
    DEFAULT_BEIR_NAME,
    beir_folder,
    default_dev_beir_path,
    default_train_data_path,
)
from gradcache_sparton.data.validation import validate_training_dataset

__all__ = [
    "DEFAULT_BEIR_NAME",
    "NEGATIVES_COLUMN",
    "NEGATIVE_PREFIX",
    "POSITIVE_COLUMN",
    "QUERY_COLUMN",
    "TEACHER_COLUMN",
    "BeirData",
    "CorpusDocument",
    "TrainingBatch",
    "TrainingCollator",
    "beir_folder",
    "beir_training_pairs",
    "check_output_path",
    "default_dev_beir_path",
    "default_train_data_path",
    "iter_corpus",
    "load_beir",
    "load_training_data",
    "read_corpus",
    "self_supervised_pairs",
    "split_sentences",
    "validate_training_dataset",
    "write_training_file",
]
