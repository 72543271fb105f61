"""Hard-negative mining: k negatives per (query, positive) pair from BM25 or a SPLADE model's own ranking.

One job per module:

- :mod:`.pairs`: the pairs mining starts from (a BEIR folder's judgements or a jsonl file), with ids.
- :mod:`.rankings`: rank a corpus for every query, BM25 (bm25s) or a sparse encoder's retrieval.
- :mod:`.negatives`: pick k negatives per pair inside a rank window, known positives skipped.
- :mod:`.output`: write a training file atomically.
- :mod:`.job`: the ``gradcache-sparton mine`` job (read, mine, write).
- :mod:`.teachers`: distillation teachers (a checkpoint, a sentence-transformers model, BM25) and their scores.
- :mod:`.teacher_scores`: per-query normalisation (minmax, zscore, none) and the weighted ensemble.
- :mod:`.teacher_job`: the ``gradcache-sparton teacher`` job (a training file's rows with ``teacher_scores``).
- :mod:`.batch_teacher`: an in-batch teacher (reps of every training text made once; each batch's
  [B, (1+k)·B] teacher scores, for ``kl_div`` with ``kl_in_batch``).

``mine_hard_negatives(pairs, corpus=...)`` returns rows with ``negative_1..k`` that
``load_training_data`` and ``gradcache-sparton train --train_data`` read. bm25s (and PyStemmer for
stemming) come with the ``mining`` extra: ``pip install 'gradcache_sparton[mining]'``; they are
imported only when BM25 ranking runs. See docs/mining.md.
"""

from gradcache_sparton.data.output import check_output_path, write_training_file
from gradcache_sparton.mining.batch_teacher import (
    BatchTeacher,
    batch_teacher_for_run,
    build_batch_teacher,
    parse_teacher_spec,
)
from gradcache_sparton.mining.job import CORPORA, run_mining
from gradcache_sparton.mining.negatives import METHODS, SAMPLINGS, check_mining_settings, mine_hard_negatives
from gradcache_sparton.mining.pairs import (
    POSITIVE_ID_COLUMN,
    QUERY_ID_COLUMN,
    beir_mining_pairs,
    check_mining_pairs,
    load_mining_pairs,
)
from gradcache_sparton.mining.rankings import (
    BM25_STEMMER,
    bm25_rankings,
    bm25_reps,
    bm25_scores,
    check_bm25_installed,
    splade_rankings,
)
from gradcache_sparton.mining.teacher_job import (
    TEACHER_COLUMN,
    candidate_lists,
    check_weights,
    run_teacher_scores,
)
from gradcache_sparton.mining.teacher_scores import (
    DEFAULT_DEPTH,
    DEFAULT_SCALES,
    NORMALISATIONS,
    ensemble_scores,
    minmax_normalise,
    normalise_scores,
    zscore_normalise,
)
from gradcache_sparton.mining.teachers import (
    TEACHER_KINDS,
    BM25Teacher,
    CrossEncoderTeacher,
    SentenceTransformerTeacher,
    SpladeTeacher,
    Teacher,
    TeacherInput,
    load_teacher,
    teacher_kind,
)

__all__ = [
    "BM25_STEMMER",
    "CORPORA",
    "DEFAULT_DEPTH",
    "DEFAULT_SCALES",
    "METHODS",
    "NORMALISATIONS",
    "POSITIVE_ID_COLUMN",
    "QUERY_ID_COLUMN",
    "SAMPLINGS",
    "TEACHER_COLUMN",
    "TEACHER_KINDS",
    "BM25Teacher",
    "BatchTeacher",
    "CrossEncoderTeacher",
    "SentenceTransformerTeacher",
    "SpladeTeacher",
    "Teacher",
    "TeacherInput",
    "batch_teacher_for_run",
    "beir_mining_pairs",
    "bm25_rankings",
    "bm25_reps",
    "bm25_scores",
    "build_batch_teacher",
    "candidate_lists",
    "check_bm25_installed",
    "check_mining_pairs",
    "check_mining_settings",
    "check_output_path",
    "check_weights",
    "ensemble_scores",
    "load_mining_pairs",
    "load_teacher",
    "mine_hard_negatives",
    "minmax_normalise",
    "normalise_scores",
    "parse_teacher_spec",
    "run_mining",
    "run_teacher_scores",
    "splade_rankings",
    "teacher_kind",
    "write_training_file",
    "zscore_normalise",
]
