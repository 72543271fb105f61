"""Distillation teachers: what a teacher folder holds (:func:`teacher_kind`), loading it, and its raw scores.

Legend: R queries (training rows), C candidates per row, N corpus documents, K depth, V vocabulary, D the
dense embedding width.

Every teacher (:class:`Teacher`) answers one call, ``scores(queries, candidates, documents, depth=None)``,
its input checked there once: the [R, C] scores of row r's query against its own candidates
``candidates[r]`` and, when ``depth`` is given, the query's top ``depth`` scores over ``documents`` [R, K]
(descending), what ``zscore`` normalises against (:mod:`.teacher_scores`). A row's scores are a function of
its own texts, the teacher and (for BM25's statistics and the top K) the corpus: nothing of another row
enters them.

The kinds, told apart by the folder's files (:func:`teacher_kind`):

- ``splade``: a checkpoint of this project (a ``splade_config.json``; or a bare masked-LM folder such as the
  shipped SPLADE-tiny), siamese or inference-free (:func:`~gradcache_sparton.model_loading.build_encoder`),
  scores = dot products of its sparse reps. Ours come before the sentence-transformers files they also carry.
- ``sparse_encoder`` / ``sentence_transformer``: a sentence-transformers ``SparseEncoder`` / ``SentenceTransformer``
  folder (``config_sentence_transformers.json``'s ``model_type``, else ``modules.json``), loaded by
  sentence-transformers; queries through ``encode_query``, documents through ``encode_document``, scored by the
  model's own similarity function (dot product for sparse models, mostly cosine for dense ones).
- ``cross_encoder``: a sentence-transformers ``CrossEncoder`` folder, or a transformers
  ``*ForSequenceClassification`` folder with one label; scores = its raw logit of each (query, candidate) pair
  (no sigmoid). It reads each pair jointly, so it has no top K over a corpus: ``zscore`` is refused.
- ``bm25``: the word ``bm25``; :func:`~gradcache_sparton.mining.bm25_scores` under the corpus's index.

On a GPU the models run under bf16 autocast (``bf16``), on the CPU in fp32.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor
from tqdm.auto import tqdm

from gradcache_sparton.data import QUERY_COLUMN
from gradcache_sparton.evaluation import EncodingSettings, SparseReps, retrieve
from gradcache_sparton.mining.rankings import BM25_STEMMER, bm25_scores
from gradcache_sparton.primitives.column_routing import DOCUMENT_COLUMN

__all__ = [
    "TEACHER_KINDS",
    "BM25Teacher",
    "CrossEncoderTeacher",
    "SentenceTransformerTeacher",
    "SpladeTeacher",
    "Teacher",
    "TeacherInput",
    "load_teacher",
    "teacher_kind",
]

TEACHER_KINDS = ("splade", "sparse_encoder", "sentence_transformer", "cross_encoder", "bm25")
# config_sentence_transformers.json's model_type -> kind.
_ST_TYPES = {
    "SparseEncoder": "sparse_encoder",
    "SentenceTransformer": "sentence_transformer",
    "CrossEncoder": "cross_encoder",
}
# Candidate pairs scored per dense block: two [block, V] float32 arrays (250 MB at V = 30,522).
_PAIR_BLOCK = 1024
# Queries and documents per block of a top-K search over embeddings: one [block, block] score matrix.
_SEARCH_BLOCK = 1024


def teacher_kind(teacher: str) -> str:
    """The kind (:data:`TEACHER_KINDS`) of ``teacher``: ``bm25``, or a model folder (or a shipped model's name)
    told apart by its files (module docstring), without loading it. ``ValueError`` naming ``--teacher`` for a
    path that is no folder or a folder that is none of them."""
    if teacher == "bm25":
        return "bm25"
    from gradcache_sparton.model_loading import resolve_model_location

    folder = Path(resolve_model_location(teacher, argument="--teacher"))
    if not folder.is_dir():
        raise ValueError(f"--teacher {teacher!r} is not a local folder (nor 'bm25')")
    if (folder / "splade_config.json").is_file():  # ours (which also writes sentence-transformers files)
        return "splade"
    st_config = folder / "config_sentence_transformers.json"
    model_type = _read_json(st_config).get("model_type") if st_config.is_file() else None
    if model_type in _ST_TYPES:
        return _ST_TYPES[model_type]
    if (folder / "modules.json").is_file():
        modules = _read_json(folder / "modules.json")
        types = " ".join(str(m.get("type", "")) for m in modules) if isinstance(modules, list) else ""
        return "sparse_encoder" if "sparse_encoder" in types else "sentence_transformer"
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"--teacher {teacher!r} holds no config.json nor modules.json: not a model folder (a checkpoint of "
            "ours, a sentence-transformers SparseEncoder / SentenceTransformer / CrossEncoder), nor 'bm25'"
        )
    architectures = _read_json(folder / "config.json").get("architectures") or []
    if any(str(a).endswith("ForSequenceClassification") for a in architectures):
        return "cross_encoder"
    return "splade"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--teacher: {str(path)!r} is not readable JSON ({exc})") from None


def _autocast(device: torch.device, bf16: bool) -> Any:
    return (
        torch.autocast(device.type, dtype=torch.bfloat16) if bf16 and device.type == "cuda" else nullcontext()
    )


def _pair_scores(
    q: Tensor | SparseReps,
    d: Tensor | SparseReps,
    index: Tensor,
    similarity: Callable[[Tensor, Tensor], Tensor],
    *,
    device: torch.device,
    desc: str,
    show_progress: bool,
) -> Tensor:
    """Row r's query rep ``q[r]`` against each of its candidates ``d[index[r, j]]`` by ``similarity`` (two
    [b, ·] blocks -> [b]): [R, C] float32 on CPU. Reps are dense [n, ·] tensors or :class:`SparseReps`,
    densified one block of pairs at a time."""
    pair_queries = torch.arange(index.shape[0]).repeat_interleave(index.shape[1])  # [R·C]
    pair_docs = index.reshape(-1)  # [R·C]
    scores = torch.empty(pair_docs.numel(), dtype=torch.float32)
    for start in tqdm(range(0, pair_docs.numel(), _PAIR_BLOCK), desc=desc, disable=not show_progress):
        block = slice(start, start + _PAIR_BLOCK)
        a, b = (_rows(reps, rows, device) for reps, rows in ((q, pair_queries[block]), (d, pair_docs[block])))
        scores[block] = similarity(a, b).float().cpu()  # [b, ·] x [b, ·] -> [b]
    return scores.reshape(index.shape)


def _rows(reps: Tensor | SparseReps, rows: Tensor, device: torch.device) -> Tensor:
    """Rows ``rows`` of ``reps`` as a dense float32 [b, ·] tensor on ``device``."""
    if isinstance(reps, SparseReps):
        return reps.select(rows).to_dense(device=device).float()
    if reps.is_sparse:  # a SparseEncoder's COO reps [n, V]
        return reps.index_select(0, rows.to(reps.device)).to_dense().to(device).float()
    return reps[rows.to(reps.device)].to(device).float()


def _candidate_index(candidates: Sequence[Sequence[str]], row_of: dict[str, int]) -> Tensor:
    return torch.tensor([[row_of[text] for text in texts] for texts in candidates])  # [R, C]


def _distinct(candidates: Sequence[Sequence[str]], documents: Sequence[str] | None) -> list[str]:
    """The distinct candidate texts outside ``documents``, in first-seen order."""
    known = set(documents or ())
    return [t for t in dict.fromkeys(t for texts in candidates for t in texts) if t not in known]


def _stack(parts: Sequence[Tensor | SparseReps]) -> Tensor | SparseReps:
    """The rows of ``parts`` (one kind of reps) in order: one part as it is."""
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], SparseReps):
        return SparseReps.concat(parts)
    stacked = torch.cat(list(parts))
    return stacked.coalesce() if stacked.is_sparse else stacked


class TeacherInput(NamedTuple):
    """What a teacher scores, checked by :meth:`Teacher.scores` (module docstring)."""

    queries: Sequence[str]
    candidates: Sequence[Sequence[str]]
    """[R][C]: row r's candidates, the same number C >= 1 in every row."""
    documents: Sequence[str]
    depth: int | None
    """The top K over ``documents`` to return; None: no top K."""


class Teacher:
    """What every teacher answers (module docstring): :meth:`scores`, its input checked here once, scored by
    the kind's own ``_scores``."""

    kind: str

    def scores(
        self,
        queries: Sequence[str],
        candidates: Sequence[Sequence[str]],
        documents: Sequence[str],
        *,
        depth: int | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The [R, C] float32 scores of row r's query ``queries[r]`` against its candidates ``candidates[r]``
        and, when ``depth`` is given, the query's top ``depth`` scores over ``documents`` [R, K] (descending),
        both on the CPU. ``ValueError`` before any work for rows that cannot make an [R, C] matrix or a
        ``depth`` < 1."""
        if len(candidates) != len(queries):
            raise ValueError(
                f"{len(queries)} queries but {len(candidates)} rows of candidates: one row a query"
            )
        widths = {len(texts) for texts in candidates}
        if len(widths) > 1 or 0 in widths:
            raise ValueError(f"every row needs the same number (>= 1) of candidates, got {sorted(widths)}")
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
            raise ValueError(f"depth must be an int >= 1 or None, got {depth!r}")
        return self._scores(TeacherInput(queries, candidates, documents, depth))

    def _scores(self, rows: TeacherInput) -> tuple[Tensor, Tensor | None]:
        """:meth:`scores` of checked ``rows``: each kind's own."""
        raise NotImplementedError


class _RepTeacher(Teacher):
    """The scores of a teacher that encodes each text alone (:class:`SpladeTeacher`,
    :class:`SentenceTransformerTeacher`): every text encoded once (with ``depth``, the corpus, then the
    candidates outside it), a candidate's score the teacher's ``_similarity`` of the two reps, the top K its
    ``_top`` over the corpus reps."""

    def _scores(self, rows: TeacherInput) -> tuple[Tensor, Tensor | None]:
        queries, candidates, documents, depth = rows
        q = self.encode(queries, query=True)
        corpus = list(documents) if depth is not None else []
        extra = _distinct(candidates, corpus)
        parts = [self.encode(texts, query=False) for texts in (corpus, extra) if texts]
        row_of = {text: row for row, text in reversed(list(enumerate([*corpus, *extra])))}  # first occurrence
        scores = _pair_scores(
            q,
            _stack(parts),
            _candidate_index(candidates, row_of),
            self._similarity,
            device=self.device,
            desc="Teacher: scores",
            show_progress=self.show_progress,
        )
        return scores, None if depth is None else self._top(q, parts[0], depth)


class SpladeTeacher(_RepTeacher):
    """A sparse encoder of ours (``encoder(**features) -> [B, V]``): dot products of its reps, encoded as
    ``encoding`` says (queries at its ``query_max_length``, documents at its ``document_max_length``)."""

    kind = "splade"

    def __init__(self, encoder: Callable[..., Tensor], encoding: EncodingSettings) -> None:
        self.encoder, self.encoding = encoder, encoding

    @property
    def device(self) -> torch.device:
        """Where the reps are scored: the encoding's device, else the encoder's."""
        return self.encoding.device_for(self.encoder)

    @property
    def show_progress(self) -> bool:
        return self.encoding.show_progress

    def encode(self, texts: Sequence[str], *, query: bool) -> SparseReps:
        """The reps of ``texts`` as queries or as documents (on the CPU)."""
        column, desc = (
            (QUERY_COLUMN, "Teacher: queries") if query else (DOCUMENT_COLUMN, "Teacher: documents")
        )
        return self.encoding.encode(self.encoder, list(texts), column=column, desc=desc)

    def _similarity(self, a: Tensor, b: Tensor) -> Tensor:
        return (a * b).sum(dim=1)  # [b, V] · [b, V] -> [b]

    def _top(self, q: SparseReps, d: SparseReps, depth: int) -> Tensor:
        return retrieve(q, d, top_k=depth, device=self.device)[0]  # [R, K]


class SentenceTransformerTeacher(_RepTeacher):
    """A sentence-transformers ``SentenceTransformer`` (dense) or ``SparseEncoder``: ``encode_query`` /
    ``encode_document`` and the model's own pairwise similarity."""

    def __init__(
        self, model: Any, *, kind: str, batch_size: int, device: torch.device, bf16: bool, show_progress: bool
    ) -> None:
        self.model, self.kind, self.batch_size = model, kind, batch_size
        self.device, self.bf16, self.show_progress = device, bf16, show_progress

    def encode(self, texts: Sequence[str], *, query: bool) -> Tensor:
        """The embeddings of ``texts`` as queries or as documents: dense [n, D], or a SparseEncoder's sparse
        [n, V] (COO, coalesced), float32."""
        encode = self.model.encode_query if query else self.model.encode_document
        reps = _run_batched(self, encode, list(texts))
        return reps.coalesce().float() if reps.is_sparse else reps.float()  # [n, D] or sparse [n, V]

    def _similarity(self, a: Tensor, b: Tensor) -> Tensor:
        return self.model.similarity_pairwise(a, b)  # [b, ·] x [b, ·] -> [b]

    def _top(self, q: Tensor, d: Tensor, depth: int) -> Tensor:
        """Each query's ``depth`` best similarities over the corpus reps ``d``: [R, K], blocks of queries and
        documents at a time."""
        best = []
        for qs in range(0, q.shape[0], _SEARCH_BLOCK):
            rows = torch.arange(qs, min(qs + _SEARCH_BLOCK, q.shape[0]))
            a = _rows(q, rows, self.device)  # [b, ·]
            kept = torch.empty(len(rows), 0, device=self.device)
            for ds in range(0, d.shape[0], _SEARCH_BLOCK):
                b = _rows(d, torch.arange(ds, min(ds + _SEARCH_BLOCK, d.shape[0])), self.device)
                kept = torch.cat([kept, self.model.similarity(a, b).float()], dim=1)  # [b, K + block]
                kept = kept.topk(min(depth, kept.shape[1]), dim=1).values
            best.append(kept.cpu())
        return torch.cat(best)  # [R, K]


def _run_batched(
    teacher: SentenceTransformerTeacher | CrossEncoderTeacher, method: Any, inputs: list, **kwargs: Any
) -> Tensor:
    """A sentence-transformers model's ``method`` (encode, predict) over ``inputs`` as one tensor: the
    teacher's batches and progress bar, under bf16 autocast on a GPU when the teacher's ``bf16``; ``kwargs``: the method's own."""
    with _autocast(teacher.device, teacher.bf16):
        return method(
            inputs,
            batch_size=teacher.batch_size,
            convert_to_tensor=True,
            show_progress_bar=teacher.show_progress,
            **kwargs,
        )


class CrossEncoderTeacher(Teacher):
    """A sentence-transformers ``CrossEncoder`` with one output: its raw logit of each (query, candidate)."""

    kind = "cross_encoder"

    def __init__(
        self, model: Any, *, batch_size: int, device: torch.device, bf16: bool, show_progress: bool
    ) -> None:
        self.model, self.batch_size, self.device, self.bf16 = model, batch_size, device, bf16
        self.show_progress = show_progress

    def _scores(self, rows: TeacherInput) -> tuple[Tensor, Tensor | None]:
        if rows.depth is not None:
            raise ValueError(
                "a cross-encoder teacher scores (query, text) pairs jointly: it has no top K over a corpus, so "
                "--normalisation zscore does not apply to it (use minmax or none)"
            )
        pairs = [
            (query, text)
            for query, texts in zip(rows.queries, rows.candidates, strict=True)
            for text in texts
        ]
        logits = _run_batched(self, self.model.predict, pairs, activation_fn=torch.nn.Identity())
        return logits.float().cpu().reshape(len(rows.queries), -1), None


class BM25Teacher(Teacher):
    """BM25 under the corpus's index (:func:`~gradcache_sparton.mining.bm25_scores`)."""

    kind = "bm25"

    def __init__(self, *, stemmer: str | None = BM25_STEMMER, show_progress: bool = True) -> None:
        self.stemmer, self.show_progress = stemmer, show_progress

    def _scores(self, rows: TeacherInput) -> tuple[Tensor, Tensor | None]:
        candidate_scores, top = bm25_scores(
            rows.queries,
            rows.candidates,
            rows.documents,
            depth=rows.depth or 1,
            stemmer=self.stemmer,
            show_progress=self.show_progress,
        )
        return candidate_scores, top if rows.depth is not None else None


def load_teacher(
    teacher: str,
    *,
    kind: str,
    batch_size: int = 64,
    device: str | torch.device | None = None,
    bf16: bool = True,
    query_max_length: int | None = None,
    document_max_length: int | None = None,
    show_progress: bool = True,
) -> Teacher:
    """The teacher ``teacher`` of kind ``kind`` (:func:`teacher_kind`) ready to score on ``device`` (default:
    cuda when available), in bf16 autocast there when ``bf16``; ours at the lengths given, else those it was
    trained with (:func:`~gradcache_sparton.model_loading.checkpoint_max_lengths`). ``ValueError`` naming
    ``--teacher`` if it does not load."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    common = {"batch_size": batch_size, "device": device, "bf16": bf16, "show_progress": show_progress}
    if kind == "bm25":
        return BM25Teacher(show_progress=show_progress)
    if kind == "splade":
        from gradcache_sparton.arguments import ModelArguments
        from gradcache_sparton.model_loading import build_encoder, build_tokenizer, checkpoint_max_lengths

        lengths = checkpoint_max_lengths(
            teacher, query_max_length=query_max_length, document_max_length=document_max_length
        )
        model_args = ModelArguments(model_name_or_path=teacher)
        tokenizer = build_tokenizer(model_args)
        encoding = EncodingSettings(
            tokenizer,
            query_max_length=lengths[0],
            document_max_length=lengths[1],
            batch_size=batch_size,
            device=device,
            autocast_dtype=torch.bfloat16 if bf16 and device.type == "cuda" else None,
            show_progress=show_progress,
        )
        return SpladeTeacher(build_encoder(model_args, tokenizer).to(device).eval(), encoding)
    model = _load_sentence_transformers(teacher, kind, device)
    if kind == "cross_encoder":
        labels = getattr(model, "num_labels", 1)
        if labels != 1:
            raise ValueError(
                f"--teacher {teacher!r}: a cross-encoder with {labels} labels; a teacher needs one score"
            )
        return CrossEncoderTeacher(model, **common)
    return SentenceTransformerTeacher(model, kind=kind, **common)


def _load_sentence_transformers(teacher: str, kind: str, device: torch.device) -> Any:
    from sentence_transformers import CrossEncoder, SentenceTransformer, SparseEncoder

    from gradcache_sparton.model_loading import resolve_model_location

    classes = {
        "sparse_encoder": SparseEncoder,
        "sentence_transformer": SentenceTransformer,
        "cross_encoder": CrossEncoder,
    }
    if kind not in classes:
        raise ValueError(f"teacher kind must be one of {TEACHER_KINDS}, got {kind!r}")
    location = resolve_model_location(teacher, argument="--teacher")
    try:
        model = classes[kind](location, device=str(device))
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"--teacher {teacher!r} ({kind}) could not be loaded: {first}") from None
    return model.eval()
