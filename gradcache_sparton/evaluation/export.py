"""Export encoded corpora for inverted-index engines: seismic's and Anserini's JSON-lines formats.

Legend: N documents, V vocabulary.

One line per document, the rep as a ``{term: weight}`` map keyed by the tokenizer's vocabulary
(``"protein"``, ``"##s"``; a term is its token string):

- ``seismic``: ``{"id": ..., "content": "", "vector": {term: float weight}}`` (``SeismicIndex.build``);
- ``anserini``: Anserini's ``JsonVectorCollection``, ``{"id": ..., "contents": "", "vector": {term:
  int}}``, with quantized impact weights ``round(weight * scale)`` (entries that round to 0 are left out;
  a ``scale`` that empties a document, or overflows a 32-bit impact, is refused).

:func:`export_corpus` streams: documents are read, encoded and written a chunk at a time, so memory is
one chunk's texts and reps whatever the corpus size; a tqdm bar counts documents. The file is written
under a temporary name and renamed when complete, so an interrupted export never leaves a partial file
under the final name.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import replace
from itertools import islice
from pathlib import Path
from typing import TextIO

from tqdm.auto import tqdm

from gradcache_sparton.evaluation.encoding import Encoder, EncodingSettings, takes_encoding
from gradcache_sparton.primitives.column_routing import DOCUMENT_COLUMN
from gradcache_sparton.primitives.sparse_reps import SparseReps

__all__ = ["EXPORT_FORMATS", "check_scale", "export_corpus", "write_vectors"]

EXPORT_FORMATS = ("seismic", "anserini")
# Anserini stores impacts as Java ints.
_MAX_IMPACT = 2**31 - 1


def write_vectors(
    handle: TextIO,
    ids: Sequence[str],
    reps: SparseReps,
    *,
    terms: Sequence[str],
    export_format: str,
    scale: float = 100.0,
) -> int:
    """Write one JSON line per rep (row i is document ``ids[i]``); returns the number of entries written.

    ``terms[v]`` names vocabulary id v. ``scale`` quantizes the ``anserini`` weights.
    """
    if export_format not in EXPORT_FORMATS:
        raise ValueError(f"export_format must be one of {EXPORT_FORMATS}, got {export_format!r}")
    if len(ids) != reps.num_rows:
        raise ValueError(f"ids has {len(ids)} entries but reps has {reps.num_rows} rows")
    if len(terms) != reps.vocab_size:
        raise ValueError(f"terms has {len(terms)} entries but the reps have V={reps.vocab_size}")
    check_scale(scale)
    offsets, token_ids, weights = reps.offsets.tolist(), reps.token_ids.tolist(), reps.weights.tolist()
    written = 0
    for row, doc_id in enumerate(ids):
        entries = zip(
            token_ids[offsets[row] : offsets[row + 1]], weights[offsets[row] : offsets[row + 1]], strict=True
        )
        if export_format == "seismic":
            vector = {terms[v]: w for v, w in entries}
            line = {"id": doc_id, "content": "", "vector": vector}
        else:
            entries = list(entries)
            vector = {terms[v]: q for v, w in entries if (q := round(w * scale)) > 0}
            _check_impacts(doc_id, [w for _, w in entries], vector, scale)
            line = {"id": doc_id, "contents": "", "vector": vector}
        written += len(vector)
        handle.write(json.dumps(line, ensure_ascii=False) + "\n")
    return written


def check_scale(scale: float) -> None:
    """``ValueError`` naming ``scale`` unless it is a finite number > 0 (Anserini's impact multiplier)."""
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not (math.isfinite(scale) and scale > 0)
    ):
        raise ValueError(f"scale must be a finite number > 0 (impact = round(weight x scale)), got {scale!r}")


def _check_impacts(doc_id: str, weights: Sequence[float], vector: dict[str, int], scale: float) -> None:
    """``ValueError`` when ``scale`` loses a document: every non-zero weight rounds to impact 0 (an empty
    vector, silently), or an impact leaves the 32-bit integers Anserini stores."""
    largest = max(weights, default=0.0)
    if largest > 0 and not vector:
        raise ValueError(
            f"scale={scale:g}: every one of document {doc_id!r}'s {len(weights)} non-zero weights rounds to "
            f"impact 0 (its largest weight is {largest:.3g}); give a scale of at least {0.5 / largest:.3g} "
            "(the default 100 keeps weights from 0.005)"
        )
    if round(largest * scale) > _MAX_IMPACT:
        raise ValueError(
            f"scale={scale:g}: document {doc_id!r}'s weight {largest:.3g} gives impact "
            f"{round(largest * scale)}, past the 32-bit integers Anserini stores ({_MAX_IMPACT})"
        )


@takes_encoding
def export_corpus(
    encoder: Encoder,
    documents: Iterable[tuple[str, str]],
    path: str | Path,
    *,
    encoding: EncodingSettings,
    export_format: str,
    chunk_size: int = 4096,
    scale: float = 100.0,
    total: int | None = None,
) -> int:
    """Encode ``documents`` ((doc id, text) pairs, e.g. from :func:`~gradcache_sparton.data.read_corpus`)
    and write them to ``path`` in ``export_format``; returns the number of documents written.

    Streams ``chunk_size`` documents at a time (encoded as ``encoding`` says, at its ``document_max_length``, in
    batches of its ``batch_size``); ``total`` sizes the progress bar (shown if ``encoding.show_progress``).
    The folder of ``path`` must exist.
    """
    if export_format not in EXPORT_FORMATS:
        raise ValueError(f"export_format must be one of {EXPORT_FORMATS}, got {export_format!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    path = Path(path)
    if not path.parent.is_dir():
        raise ValueError(f"path {str(path)!r}: its folder does not exist")
    tokenizer = encoding.tokenizer
    terms = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    quiet = replace(encoding, show_progress=False)  # the bar counts documents, not each chunk's batches
    partial = path.with_name(path.name + ".partial")
    count = 0
    documents = iter(documents)
    try:
        with (
            partial.open("w", encoding="utf-8") as handle,
            tqdm(
                total=total,
                desc=f"Exporting ({export_format})",
                unit="doc",
                disable=not encoding.show_progress,
            ) as bar,
        ):
            while chunk := list(islice(documents, chunk_size)):
                ids = [doc_id for doc_id, _ in chunk]
                texts = [text for _, text in chunk]
                reps = quiet.encode(encoder, texts, column=DOCUMENT_COLUMN, desc="Encoding")
                write_vectors(handle, ids, reps, terms=terms, export_format=export_format, scale=scale)
                count += len(chunk)
                bar.update(len(chunk))
        if count == 0:
            raise ValueError("documents is empty: nothing to export")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return count
