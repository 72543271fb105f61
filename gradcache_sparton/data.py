"""Training data: (query, positive[, negatives...]) rows, BEIR folders, self-supervised pairs, the collator.

Legend: B batch, S sequence.

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

Collator output (:class:`TrainingCollator`, typed as :class:`TrainingBatch`)
    ``{"columns": {"query": {...}, "positive": {...}, "negative_1": {...}, ...},
    "loss_kwargs": {"teacher_scores": Tensor [B, ...], ...}}``
    where each column maps to the tokenizer's features (``input_ids``, ``attention_mask`` and,
    for BERT, ``token_type_ids``), each [B, S_column]: ``batch["columns"]`` is exactly the engine's
    batch contract, ``batch["loss_kwargs"]`` goes to ``loss_fn(reps, **loss_kwargs)``.

BEIR folders (:func:`load_beir`)
    ``corpus.jsonl`` (``_id``, ``title``, ``text``), ``queries.jsonl`` (``_id``, ``text``) and
    ``qrels/<split>.tsv`` (query-id, corpus-id, score; one header line). Either jsonl file may be
    gzip-compressed (``corpus.jsonl.gz``). :func:`beir_training_pairs` turns them into training pairs.

``datasets`` is imported inside the functions that need it (not at module import), so the collator,
the BEIR loader and evaluation work on a machine that has torch and transformers but not ``datasets``.
"""

from __future__ import annotations

import csv
import gzip
import json
import random
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from gradcache_sparton.resources import RESOURCES_DIR

if TYPE_CHECKING:
    import datasets
    import pyarrow as pa

__all__ = [
    "NEGATIVES_COLUMN",
    "NEGATIVE_PREFIX",
    "POSITIVE_COLUMN",
    "QUERY_COLUMN",
    "BeirData",
    "TrainingBatch",
    "TrainingCollator",
    "beir_training_pairs",
    "default_dev_beir_path",
    "default_train_data_path",
    "load_beir",
    "load_training_data",
    "self_supervised_pairs",
    "split_sentences",
    "validate_training_dataset",
]

QUERY_COLUMN = "query"
POSITIVE_COLUMN = "positive"
# Hard negatives as separate columns negative_1 ... negative_k (1-based, no gaps) ...
NEGATIVE_PREFIX = "negative_"
# ... or as one list column with the same number of texts in every row.
NEGATIVES_COLUMN = "negatives"

_NEGATIVE_RE = re.compile(rf"^{NEGATIVE_PREFIX}([1-9][0-9]*)$")
# Rows per Arrow batch when validating a dataset: bounds memory on large datasets.
_VALIDATION_BATCH_ROWS = 10_000
_LOAD_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")


# ---------------------------------------------------------------------------------------------------
# Shipped default data
# ---------------------------------------------------------------------------------------------------


def default_train_data_path() -> Path:
    """The shipped SciFact training pairs (gzip'd jsonl, columns ``query``, ``positive``).

    Self-supervised pairs from the SciFact corpus plus the labelled training claims, the dev claims
    held out; see ``resources/NOTICE.md`` (licence: CC BY-NC 2.0) and ``docs/data.md``. Load it with
    ``load_training_data(default_train_data_path())``.
    """
    return RESOURCES_DIR / "scifact_sample" / "train.jsonl.gz"


def default_dev_beir_path() -> Path:
    """The shipped SciFact dev BEIR folder: held-out claims, their qrels (``qrels/dev.tsv``) and a
    corpus of their relevant abstracts plus distractors. Load it with ``load_beir(path, split="dev")``."""
    return RESOURCES_DIR / "scifact_sample" / "dev"


# ---------------------------------------------------------------------------------------------------
# BEIR folders
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BeirData:
    """A BEIR dataset in memory, for one qrels split.

    - ``corpus``: doc id -> text, in file order (a doc's index in this order is its index in
      retrieval results and the tie-break key: equal scores rank the earlier doc first). The text is
      ``title + " " + text`` when the title is non-empty (the BEIR convention), else ``text``.
    - ``queries``: query id -> text, only the queries that appear in the split's qrels, in qrels order.
    - ``qrels``: query id -> {doc id: relevance}; relevance > 0 means relevant, larger is better
      (graded nDCG), 0 or less means judged non-relevant.
    """

    corpus: dict[str, str]
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]


def _open_text(path: Path) -> Any:
    """Open a text file for reading, transparently gunzipping ``*.gz``."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open("r", encoding="utf-8")


def _find_jsonl(folder: Path, stem: str) -> Path:
    for name in (f"{stem}.jsonl", f"{stem}.jsonl.gz"):
        if (folder / name).is_file():
            return folder / name
    raise ValueError(f"BEIR folder {str(folder)!r} has no {stem}.jsonl (or {stem}.jsonl.gz)")


def _read_jsonl(path: Path, required: Sequence[str]) -> Iterator[dict[str, Any]]:
    with _open_text(path) as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_number}: not valid JSON ({exc.msg})") from None
            missing = [key for key in required if key not in record]
            if missing:
                raise ValueError(f"{path}:{line_number}: record has no field(s) {missing}")
            yield record


def load_beir(path: str | Path, *, split: str) -> BeirData:
    """Load a BEIR-format folder: ``corpus.jsonl``, ``queries.jsonl`` and ``qrels/<split>.tsv``.

    The qrels file is tab-separated (query-id, corpus-id, score) with one header line. Raises
    ``ValueError`` naming the file and line for a malformed line, a duplicate id, a qrels line naming
    a query or doc that is not in the folder, or an empty corpus or split.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"path must be a BEIR folder, got {str(folder)!r} (not a directory)")
    qrels_path = folder / "qrels" / f"{split}.tsv"
    if not qrels_path.is_file():
        found = sorted(p.stem for p in (folder / "qrels").glob("*.tsv"))
        raise ValueError(f"split={split!r}: no {qrels_path} (splits found: {found})")

    corpus_path = _find_jsonl(folder, "corpus")
    corpus: dict[str, str] = {}
    for record in _read_jsonl(corpus_path, ("_id", "text")):
        doc_id = str(record["_id"])
        if doc_id in corpus:
            raise ValueError(f"{corpus_path}: duplicate doc id {doc_id!r}")
        title = (record.get("title") or "").strip()
        corpus[doc_id] = f"{title} {record['text']}" if title else record["text"]
    if not corpus:
        raise ValueError(f"{corpus_path} holds no documents")

    queries_path = _find_jsonl(folder, "queries")
    all_queries: dict[str, str] = {}
    for record in _read_jsonl(queries_path, ("_id", "text")):
        all_queries[str(record["_id"])] = record["text"]

    qrels: dict[str, dict[str, int]] = {}
    with qrels_path.open("r", encoding="utf-8", newline="") as handle:
        rows = csv.reader(handle, delimiter="\t")
        # The BEIR header ("query-id corpus-id score") is the first line; skip it.
        next(rows, None)
        for line_number, row in enumerate(rows, start=2):
            if not row:
                continue
            if len(row) != 3:
                raise ValueError(f"{qrels_path}:{line_number}: expected 3 tab-separated fields, got {row}")
            query_id, doc_id, score = row
            try:
                relevance = int(score)
            except ValueError:
                raise ValueError(f"{qrels_path}:{line_number}: score {score!r} is not an integer") from None
            if query_id not in all_queries:
                raise ValueError(
                    f"{qrels_path}:{line_number}: query id {query_id!r} is not in {queries_path}"
                )
            if doc_id not in corpus:
                raise ValueError(f"{qrels_path}:{line_number}: doc id {doc_id!r} is not in {corpus_path}")
            qrels.setdefault(query_id, {})[doc_id] = relevance
    if not qrels:
        raise ValueError(f"{qrels_path} holds no judgements")
    queries = {query_id: all_queries[query_id] for query_id in qrels}
    return BeirData(corpus=corpus, queries=queries, qrels=qrels)


def beir_training_pairs(beir: BeirData) -> datasets.Dataset:
    """One (query, positive) row per judgement with relevance > 0, in qrels order.

    A query with several relevant docs gives several rows. Columns: ``query``, ``positive``.
    """
    import datasets

    rows = [
        {QUERY_COLUMN: beir.queries[query_id], POSITIVE_COLUMN: beir.corpus[doc_id]}
        for query_id, judged in beir.qrels.items()
        for doc_id, relevance in judged.items()
        if relevance > 0
    ]
    if not rows:
        raise ValueError("beir has no judgement with relevance > 0: no training pairs")
    return datasets.Dataset.from_list(rows)


# ---------------------------------------------------------------------------------------------------
# Self-supervised pairs from a bare corpus
# ---------------------------------------------------------------------------------------------------

# A sentence ends at '.', '!' or '?' (optionally followed by closing quotes/brackets) followed by
# whitespace and then an upper-case letter, a digit or an opening quote/bracket. Deliberately simple
# and deterministic: "e.g. the" does not split (lower case follows), "Fig. 2" does.
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Split ``text`` into sentences with one regular expression (no model, fully deterministic).

    A boundary is sentence-ending punctuation (``.``, ``!``, ``?``, optionally followed by closing
    quotes or brackets), then whitespace, then an upper-case letter, a digit or an opening
    quote/bracket. Surrounding whitespace is stripped and empty pieces are dropped.
    """
    pieces: list[str] = []
    start = 0
    for match in _SENTENCE_END.finditer(text):
        pieces.append(text[start : match.end()])
        start = match.end()
    pieces.append(text[start:])
    return [piece.strip() for piece in pieces if piece.strip()]


def self_supervised_pairs(
    texts: Sequence[str],
    *,
    titles: Sequence[str] | None = None,
    pairs_per_document: int = 1,
    min_words: int = 5,
    max_words: int = 48,
    seed: int = 0,
) -> datasets.Dataset:
    """(query, positive) pairs from a bare corpus: a sentence of a document as the query, the rest as
    the positive.

    Rule, per document in order: split the text with :func:`split_sentences`; a sentence is eligible
    as a query if it has between ``min_words`` and ``max_words`` whitespace-separated words
    (inclusive) and the document has at least one other sentence. Up to ``pairs_per_document``
    eligible sentences are drawn without replacement with ``random.Random(seed)`` (one generator
    for the whole call, so the output is a function of the inputs and the seed). The positive is the
    document without the chosen sentence (the other sentences joined by single spaces), prefixed by
    ``title + " "`` when a non-empty title is given. Documents with no eligible sentence give no pair.

    Returns a ``datasets.Dataset`` with columns ``query``, ``positive``.
    """
    import datasets

    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise TypeError(f"texts must be a sequence of str, got {type(texts).__name__}")
    if titles is not None and len(titles) != len(texts):
        raise ValueError(f"titles must have one entry per text ({len(texts)}), got {len(titles)}")
    if pairs_per_document < 1:
        raise ValueError(f"pairs_per_document must be >= 1, got {pairs_per_document}")
    if not 1 <= min_words <= max_words:
        raise ValueError(
            f"need 1 <= min_words <= max_words, got min_words={min_words}, max_words={max_words}"
        )

    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts[{index}] must be str, got {type(text).__name__}")
        sentences = split_sentences(text)
        if len(sentences) < 2:
            continue
        eligible = [i for i, s in enumerate(sentences) if min_words <= len(s.split()) <= max_words]
        if not eligible:
            continue
        title = titles[index].strip() if titles is not None and titles[index] else ""
        for chosen in rng.sample(eligible, min(pairs_per_document, len(eligible))):
            rest = " ".join(s for i, s in enumerate(sentences) if i != chosen)
            rows.append(
                {QUERY_COLUMN: sentences[chosen], POSITIVE_COLUMN: f"{title} {rest}" if title else rest}
            )
    if not rows:
        raise ValueError(
            f"no document of the {len(texts)} gave a pair: each needs >= 2 sentences, one with "
            f"{min_words}..{max_words} words"
        )
    return datasets.Dataset.from_list(rows)


# ---------------------------------------------------------------------------------------------------
# Training datasets: loading and validation
# ---------------------------------------------------------------------------------------------------


def _negative_number(name: str) -> int | None:
    match = _NEGATIVE_RE.match(name)
    return int(match.group(1)) if match else None


def _text_columns_of(names: Iterable[str]) -> list[str]:
    """The text columns in collator order (query, positive, negative_1..k) or ``[..., negatives]``.

    Raises ``ValueError`` for a missing required column, a gap in negative_i, or both negative forms.
    """
    names = list(names)
    missing = [c for c in (QUERY_COLUMN, POSITIVE_COLUMN) if c not in names]
    if missing:
        raise ValueError(
            f"training data must have columns {QUERY_COLUMN!r} and {POSITIVE_COLUMN!r}; "
            f"missing {missing} (columns: {names})"
        )
    numbers = sorted(n for n in (_negative_number(name) for name in names) if n is not None)
    if numbers and NEGATIVES_COLUMN in names:
        raise ValueError(
            f"training data has both a {NEGATIVES_COLUMN!r} list column and {NEGATIVE_PREFIX}<i> columns; "
            "use one form"
        )
    if numbers != list(range(1, len(numbers) + 1)):
        expected = [f"{NEGATIVE_PREFIX}{i}" for i in range(1, len(numbers) + 1)]
        found = [f"{NEGATIVE_PREFIX}{i}" for i in numbers]
        raise ValueError(
            f"negative columns must be numbered 1..k without gaps: expected {expected}, got {found}"
        )
    columns = [QUERY_COLUMN, POSITIVE_COLUMN] + [f"{NEGATIVE_PREFIX}{i}" for i in numbers]
    if NEGATIVES_COLUMN in names:
        columns.append(NEGATIVES_COLUMN)
    return columns


def _is_numeric(arrow_type: pa.DataType) -> bool:
    import pyarrow as pa

    return (
        pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type) or pa.types.is_boolean(arrow_type)
    )


def _is_list(arrow_type: pa.DataType) -> bool:
    import pyarrow as pa

    return (
        pa.types.is_list(arrow_type)
        or pa.types.is_large_list(arrow_type)
        or pa.types.is_fixed_size_list(arrow_type)
    )


def _is_string(arrow_type: pa.DataType) -> bool:
    import pyarrow as pa

    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)


def validate_training_dataset(dataset: datasets.Dataset) -> list[str]:
    """Check a training dataset and return its text columns in collator order.

    Checks, each raising ``ValueError`` that names the column (and row, where one is at fault):
    the dataset is non-empty; ``query`` and ``positive`` exist; negatives are ``negative_1..k``
    without gaps or one ``negatives`` list column, not both; text columns are strings with no null
    cell (a null ``negative_i`` cell is a row with fewer negatives); every ``negatives`` list has the
    same length; every other column is numeric, and a list-valued one has the same length in every row.

    Returns e.g. ``["query", "positive", "negative_1", "negative_2"]`` or
    ``["query", "positive", "negatives"]``.
    """
    import datasets
    import pyarrow.compute as pc

    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(f"dataset must be a datasets.Dataset, got {type(dataset).__name__}")
    if len(dataset) == 0:
        raise ValueError("dataset is empty: training needs at least one (query, positive) row")
    columns = _text_columns_of(dataset.column_names)
    schema = dataset.features.arrow_schema
    extras = [name for name in dataset.column_names if name not in columns]
    for name in columns:
        arrow_type = schema.field(name).type
        ok = (
            _is_list(arrow_type) and _is_string(arrow_type.value_type)
            if name == NEGATIVES_COLUMN
            else _is_string(arrow_type)
        )
        if not ok:
            expected = "a list of strings" if name == NEGATIVES_COLUMN else "strings"
            raise ValueError(f"column {name!r} must hold {expected}, got Arrow type {arrow_type}")
    for name in extras:
        arrow_type = schema.field(name).type
        if not (_is_numeric(arrow_type) or (_is_list(arrow_type) and _is_numeric(arrow_type.value_type))):
            raise ValueError(
                f"column {name!r} (Arrow type {arrow_type}) is neither a text column "
                f"({QUERY_COLUMN}, {POSITIVE_COLUMN}, {NEGATIVE_PREFIX}<i>, {NEGATIVES_COLUMN}) nor numeric "
                f"(passed to the loss as loss_kwargs); remove it with dataset.remove_columns([{name!r}])"
            )
    list_columns = [name for name in [*columns, *extras] if _is_list(schema.field(name).type)]
    first_lengths: dict[str, int] = {}
    offset = 0
    # Arrow batches honour any indices mapping (select/shuffle) and bound memory on large datasets.
    for table in dataset.with_format("arrow").iter(batch_size=_VALIDATION_BATCH_ROWS):
        for name in [*columns, *extras]:
            nulls = pc.is_null(table.column(name))
            if pc.any(nulls).as_py():
                row = offset + pc.index(nulls, True).as_py()
                raise ValueError(
                    f"column {name!r} is empty (null) in row {row}: every row needs a value in every "
                    "column (rows must all have the same number of negatives)"
                )
        for name in list_columns:
            lengths = pc.list_value_length(table.column(name))
            expected = first_lengths.setdefault(name, lengths[0].as_py())
            wrong = pc.not_equal(lengths, expected)
            if pc.any(wrong).as_py():
                row = offset + pc.index(wrong, True).as_py()
                raise ValueError(
                    f"column {name!r}: row {row} has {lengths[row - offset].as_py()} entries but row 0 has "
                    f"{expected}; every row needs the same number"
                )
        offset += table.num_rows
    if first_lengths.get(NEGATIVES_COLUMN) == 0:
        raise ValueError(f"column {NEGATIVES_COLUMN!r} holds empty lists: drop the column instead")
    return columns


def _builder_for(path: Path) -> str:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSIONS:
        suffixes = suffixes[:-1]
    if not suffixes or suffixes[-1] not in _LOAD_BUILDERS:
        raise ValueError(
            f"cannot tell the format of {str(path)!r}: expected one of {sorted(_LOAD_BUILDERS)} "
            f"(optionally compressed: {list(_COMPRESSIONS)})"
        )
    return _LOAD_BUILDERS[suffixes[-1]]


def load_training_data(
    source: str | Path | Sequence[str | Path] | datasets.Dataset,
    *,
    cache_dir: str | Path | None = None,
) -> datasets.Dataset:
    """Load training rows from files (jsonl/json/csv/parquet, optionally .gz/.bz2/.xz/.zst) or take a
    ``datasets.Dataset`` as it is, and validate it with :func:`validate_training_dataset`.

    Several files must share one format. ``cache_dir`` is passed to ``datasets.load_dataset``. Returns
    the dataset unchanged (validation never rewrites rows).
    """
    import datasets

    if isinstance(source, datasets.Dataset):
        dataset = source
    else:
        paths = [Path(source)] if isinstance(source, (str, Path)) else [Path(p) for p in source]
        if not paths:
            raise ValueError("source is an empty list of files")
        for path in paths:
            if not path.is_file():
                raise ValueError(f"training data file {str(path)!r} does not exist")
        builders = {_builder_for(path) for path in paths}
        if len(builders) != 1:
            raise ValueError(f"all training files must have one format, got {sorted(builders)}")
        dataset = datasets.load_dataset(
            builders.pop(),
            data_files=[str(path) for path in paths],
            split="train",
            cache_dir=None if cache_dir is None else str(cache_dir),
        )
    validate_training_dataset(dataset)
    return dataset


# ---------------------------------------------------------------------------------------------------
# Collator
# ---------------------------------------------------------------------------------------------------


class TrainingBatch(TypedDict):
    """What :class:`TrainingCollator` returns.

    - ``columns``: column name -> tokenizer features (``input_ids``, ``attention_mask``, ...), each
      [B, S_column], in column order query, positive, negative_1, ..., negative_k (the engine contract).
    - ``loss_kwargs``: extra numeric column name -> tensor with the batch dimension first (e.g.
      ``teacher_scores`` [B, 1 + k]); empty when the data has no extra column.
    """

    columns: dict[str, dict[str, Tensor]]
    loss_kwargs: dict[str, Tensor]


@dataclass
class TrainingCollator:
    """Tokenise a list of training rows into a :class:`TrainingBatch`.

    Each text column is tokenised on its own with ``padding=True`` (to the longest row of the batch),
    ``truncation=True`` and ``pad_to_multiple_of`` (8: tensor-core friendly shapes): the ``query``
    column to at most ``query_max_length`` tokens, every document column (positive and negatives) to
    at most ``document_max_length`` tokens. Truncation is the configured behaviour: a longer text
    keeps its first ``max_length`` tokens (special tokens included). Both max lengths must be multiples
    of ``pad_to_multiple_of`` (a transformers requirement when truncating and padding together).

    A ``negatives`` list column becomes ``negative_1..k``. Extra columns must be numeric and become
    ``loss_kwargs`` tensors (``torch.tensor`` of the batch's values: ints stay int64, floats become
    float32). The collator does not depend on the batch size; training drops the last incomplete
    batch in the dataloader (``dataloader_drop_last=True``), not here.
    """

    tokenizer: PreTrainedTokenizerBase
    query_max_length: int = 32
    document_max_length: int = 256
    pad_to_multiple_of: int | None = 8

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
        columns: dict[str, dict[str, Tensor]] = {}
        for name, values in texts.items():
            max_length = self.query_max_length if name == QUERY_COLUMN else self.document_max_length
            encoded = self.tokenizer(
                values,
                padding=True,
                truncation=True,
                max_length=max_length,
                pad_to_multiple_of=self.pad_to_multiple_of,
                return_tensors="pt",
            )
            columns[name] = dict(encoded)  # [B, S_column] each
        return TrainingBatch(columns=columns, loss_kwargs=self._loss_kwargs(rows))

    def _text_columns(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
        names = _text_columns_of(rows[0].keys())
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
            extra_negatives = [n for n in row if _negative_number(n) is not None and n not in names]
            if extra_negatives:
                raise ValueError(f"row {index} of the batch has column(s) {extra_negatives} that row 0 lacks")
        return texts

    @staticmethod
    def _loss_kwargs(rows: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        text_names = set(_text_columns_of(rows[0].keys()))
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
