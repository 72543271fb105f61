"""Exhaustive top-k retrieval by sparse dot product, chunked so that nothing of size Q x N is built.

Legend: Q queries, N documents, V vocabulary, C a document chunk, K top-k.

Ties: documents with equal scores are ranked by their index in the corpus (file order), earlier
first. The running top-k is merged with a *stable* sort over candidates laid out in index order, so
the result does not depend on the chunk size or the device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradcache_sparton.primitives.sparse_reps import SparseReps

__all__ = ["retrieve"]

# Defaults for the retrieval blocks. A [1,024, V] fp32 query block and a [2,048, V] fp32 document chunk
# are 125 MB and 250 MB at V = 30,522: small next to a training run's memory, large enough that the
# matmul runs at full speed on a GPU.
_QUERY_BLOCK = 1024
_DOC_CHUNK = 2048


def retrieve(
    q_reps: SparseReps | Tensor,
    d_reps: SparseReps | Tensor,
    *,
    top_k: int = 100,
    device: torch.device | str | None = None,
    query_block: int = _QUERY_BLOCK,
    doc_chunk: int = _DOC_CHUNK,
) -> tuple[Tensor, Tensor]:
    """Top-k documents of every query by dot product: ``(scores [Q, K], doc_indices [Q, K])`` on CPU.

    K = min(top_k, N). Each row is sorted by score descending; equal scores keep the lower doc index
    first (a stable sort over candidates in index order), whatever the chunk sizes. Reps may be
    :class:`SparseReps` or dense [Q, V] / [N, V] tensors. Scores are computed in float32 on
    ``device`` (default: the query reps' device).

    Memory on ``device``: a dense [query_block, V] query block, a dense [doc_chunk, V] doc chunk,
    their [query_block, doc_chunk] scores and the [Q, K + doc_chunk] candidates of the merge: never
    anything of size Q × N × V or Q × N.
    """
    q_reps = SparseReps.from_dense(q_reps) if isinstance(q_reps, Tensor) else q_reps
    d_reps = SparseReps.from_dense(d_reps) if isinstance(d_reps, Tensor) else d_reps
    for name, reps in (("q_reps", q_reps), ("d_reps", d_reps)):
        if not isinstance(reps, SparseReps):
            raise TypeError(f"{name} must be SparseReps or a dense [*, V] tensor, got {type(reps).__name__}")
        if reps.num_rows == 0:
            raise ValueError(f"{name} has no rows")
    if q_reps.vocab_size != d_reps.vocab_size:
        raise ValueError(f"q_reps has V={q_reps.vocab_size} but d_reps has V={d_reps.vocab_size}")
    for name, value in (("top_k", top_k), ("query_block", query_block), ("doc_chunk", doc_chunk)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    device = q_reps.weights.device if device is None else torch.device(device)
    num_queries, num_docs = q_reps.num_rows, d_reps.num_rows
    k = min(top_k, num_docs)
    best_scores = torch.empty(num_queries, 0, device=device)  # [Q, <=K], sorted: score desc, index asc
    best_index = torch.empty(num_queries, 0, dtype=torch.int64, device=device)
    # Densify the queries once when they fit in one block, else one block per doc chunk.
    single_block = q_reps.to_dense(device=device) if num_queries <= query_block else None  # [Q, V]
    for d_start in range(0, num_docs, doc_chunk):
        d_end = min(d_start + doc_chunk, num_docs)
        docs = d_reps.to_dense(d_start, d_end, device=device)  # [C, V]
        new_scores, new_index = [], []
        for q_start in range(0, num_queries, query_block):
            q_end = min(q_start + query_block, num_queries)
            queries = (
                single_block if single_block is not None else q_reps.to_dense(q_start, q_end, device=device)
            )
            scores = queries @ docs.T  # [Qb, V] @ [V, C] -> [Qb, C]
            # Candidates in index order: the kept top-k (all indices < d_start, equal scores already
            # index-ascending) then this chunk (ascending). A stable descending sort keeps that order
            # among equal scores, so ties rank the lower doc index first.
            cand_scores = torch.cat([best_scores[q_start:q_end], scores], dim=1)  # [Qb, K + C]
            chunk_index = torch.arange(d_start, d_end, device=device).expand(q_end - q_start, -1)
            cand_index = torch.cat([best_index[q_start:q_end], chunk_index], dim=1)
            sorted_scores, position = torch.sort(cand_scores, dim=1, descending=True, stable=True)
            new_scores.append(sorted_scores[:, :k])
            new_index.append(cand_index.gather(1, position[:, :k]))
        best_scores, best_index = torch.cat(new_scores), torch.cat(new_index)
    return best_scores.cpu(), best_index.cpu()
