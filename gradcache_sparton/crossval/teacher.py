"""A distillation teacher the protocol builds offline: BM25 and the recipe's starting model, ensembled.

Legend: R training rows, C = 1 + k candidates per row (the positive, then its k negatives), N corpus
documents, K normalisation depth, V vocabulary.

For every training row the teacher scores its candidates twice, with BM25 (:func:`~gradcache_sparton.mining.
bm25_scores`, the mining's bm25s index over the full corpus) and with the untrained starting model (dot
products of its sparse reps, encoded at the evaluation lengths), puts each system's scores on one scale per
query (:func:`normalise_scores`) and mixes them: ``bm25_weight · z_bm25 + (1 - bm25_weight) · z_model``.
The result is the row's ``teacher_scores`` [C], what ``--contrastive kl_div`` (or ``margin_mse``) reads.

A row's teacher scores are a function of the row's own texts, the corpus and the starting model: nothing
of any other row, query or judgement is read, so the folds' guarantee (no held-out claim shapes its
training rows) holds for them as for the mined negatives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from tqdm.auto import tqdm

from gradcache_sparton.data import QUERY_COLUMN
from gradcache_sparton.evaluation import EncodingSettings, SparseReps, retrieve
from gradcache_sparton.primitives.column_routing import DOCUMENT_COLUMN

__all__ = [
    "DEFAULT_TEACHER_WEIGHT",
    "LOSSES_READING_TEACHER",
    "TEACHERS",
    "ensemble_teacher_scores",
    "model_scores",
    "normalise_scores",
]

TEACHERS = ("none", "bm25+model")
# BM25's share of the ensemble. Equal shares of the two normalised scores (CombSUM of z-scores): on the
# folds BM25 leads the starting model by 0.047 nDCG@10 at 256 tokens (docs/experiments.md), too little to
# justify a lopsided prior, and choosing the weight on the folds' own claims would tune on the test claims.
DEFAULT_TEACHER_WEIGHT = 0.5
# The contrastive losses that read a teacher_scores column (losses/splade.py); any other ignores it.
LOSSES_READING_TEACHER = ("kl_div", "margin_mse")
# Candidate pairs scored per dense block: two [block, V] float32 arrays (250 MB at V = 30,522).
_PAIR_BLOCK = 1024


def normalise_scores(candidate_scores: Tensor, top_scores: Tensor) -> Tensor:
    """Each query's candidate scores as z-scores against its own top-K scores over the corpus: [R, C].

    ``(s - mean) / std`` with the mean and (population) standard deviation of row r of ``top_scores``
    [R, K]. Why these statistics rather than the C candidates' own: with one negative (C = 2) a z-score or
    min-max over the candidates is always ±1 or 0/1, whatever the margin; the top K (K = 100, the window
    the negatives come from) give every query a fixed reference, so a wide BM25 margin stays wide and the
    two systems' scales become comparable. A query whose top K all score alike (std 0: no query token in
    the corpus, or an all-zero rep) gives no ranking information: its z-scores are 0.
    """
    if (
        candidate_scores.dim() != 2
        or top_scores.dim() != 2
        or candidate_scores.shape[0] != top_scores.shape[0]
    ):
        raise ValueError(
            f"candidate_scores [R, C] and top_scores [R, K] must share R, got {tuple(candidate_scores.shape)} "
            f"and {tuple(top_scores.shape)}"
        )
    top = top_scores.double()
    mean = top.mean(dim=1, keepdim=True)  # [R, 1]
    std = top.std(dim=1, correction=0, keepdim=True)  # [R, 1]
    z = (candidate_scores.double() - mean) / torch.where(std > 0, std, 1.0)  # [R, C]
    return torch.where(std > 0, z, 0.0)


def model_scores(
    encoder: Callable[..., Tensor],
    queries: Sequence[str],
    candidates: Sequence[Sequence[str]],
    documents: Sequence[str],
    *,
    encoding: EncodingSettings,
    depth: int,
) -> tuple[Tensor, Tensor]:
    """The encoder's dot-product scores of each query's candidates, and its top ``depth`` over the corpus.

    Returns ``(candidate_scores [R, C], top_scores [R, K])`` float32 on CPU, as :func:`~gradcache_sparton.
    mining.bm25_scores` does for BM25. Texts are encoded as ``encoding`` says (queries at its
    ``query_max_length``, documents at its ``document_max_length`` tokens); the corpus once, and each
    distinct candidate text outside it once.
    """
    if len(candidates) != len(queries) or not queries:
        raise ValueError(
            f"candidates must hold one list per query: {len(candidates)} lists, {len(queries)} queries"
        )
    widths = {len(texts) for texts in candidates}
    if len(widths) != 1 or 0 in widths:
        raise ValueError(f"every query needs the same number (>= 1) of candidates, got {sorted(widths)}")
    q_reps = encoding.encode(encoder, queries, column=QUERY_COLUMN, desc="Teacher: queries")
    d_reps = encoding.encode(encoder, documents, column=DOCUMENT_COLUMN, desc="Teacher: corpus")
    row_of = {text: row for row, text in reversed(list(enumerate(documents)))}  # first occurrence
    extra = [text for text in dict.fromkeys(t for texts in candidates for t in texts) if text not in row_of]
    if extra:
        row_of.update({text: len(documents) + i for i, text in enumerate(extra)})
        e_reps = encoding.encode(encoder, extra, column=DOCUMENT_COLUMN, desc="Teacher: candidates")
        all_reps = SparseReps.concat([d_reps, e_reps])
    else:
        all_reps = d_reps
    device = encoding.device
    top_scores, _ = retrieve(q_reps, d_reps, top_k=depth, device=device)  # [R, K]
    index = torch.tensor([[row_of[text] for text in texts] for texts in candidates])  # [R, C]
    pair_queries = torch.arange(len(queries)).repeat_interleave(index.shape[1])  # [R·C]
    pair_docs = index.reshape(-1)  # [R·C]
    scores = torch.empty(pair_docs.numel(), dtype=torch.float32)
    for start in tqdm(
        range(0, pair_docs.numel(), _PAIR_BLOCK),
        desc="Teacher: model scores",
        disable=not encoding.show_progress,
    ):
        block = slice(start, start + _PAIR_BLOCK)
        q = q_reps.select(pair_queries[block]).to_dense(device=device)  # [b, V]
        d = all_reps.select(pair_docs[block]).to_dense(device=device)  # [b, V]
        scores[block] = (q * d).sum(dim=1).float().cpu()  # [b, V] -> [b]
    return scores.reshape(index.shape), top_scores


def ensemble_teacher_scores(
    queries: Sequence[str],
    candidates: Sequence[Sequence[str]],
    documents: Sequence[str],
    *,
    encoder: Callable[..., Tensor],
    encoding: EncodingSettings,
    bm25_weight: float = DEFAULT_TEACHER_WEIGHT,
    depth: int = 100,
) -> Tensor:
    """The ``bm25+model`` teacher's scores [R, C] (module docstring): row r's candidates ``candidates[r]``
    (positive first) for query ``queries[r]``, ``bm25_weight · z_bm25 + (1 - bm25_weight) · z_model`` with
    both normalised by :func:`normalise_scores` over their top min(``depth``, N) corpus scores; the model's reps
    encoded as ``encoding`` says (:func:`model_scores`)."""
    from gradcache_sparton.mining import bm25_scores

    if not 0.0 <= bm25_weight <= 1.0:
        raise ValueError(f"bm25_weight must be in [0, 1], got {bm25_weight!r}")
    depth = min(depth, len(documents))
    bm25 = normalise_scores(
        *bm25_scores(queries, candidates, documents, depth=depth, show_progress=encoding.show_progress)
    )  # [R, C]
    model = normalise_scores(
        *model_scores(encoder, queries, candidates, documents, encoding=encoding, depth=depth)
    )  # [R, C]
    return (bm25_weight * bm25 + (1.0 - bm25_weight) * model).float()
