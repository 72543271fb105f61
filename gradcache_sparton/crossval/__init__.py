"""k-fold cross-validation of a training recipe over a BEIR folder's judged queries (``gradcache-sparton
crossval``): retrieval quality measured only on queries the recipe never trained on, against the full corpus.

Protocol (docs/experiments.md):

1. The judged queries of ``beir_path`` (split ``split``) are shuffled with ``fold_seed`` and dealt into
   ``folds`` folds (query i of the shuffle goes to fold i mod k).
2. For each fold and each training seed, the recipe (``train`` flags: model, steps, learning rate, ...)
   trains on pairs built only from the *other* folds: one (query, relevant document) pair per judgement,
   plus optionally ``self_supervised_pairs`` (sentence, rest of the abstract) pairs from corpus documents
   that no training query judges, and optionally ``bm25_negatives`` BM25-mined negatives per pair (ranks
   10..100 of the full corpus, the query's judged documents skipped), and with ``teacher="bm25+model"``
   each row's ``teacher_scores`` for distillation (:mod:`.teacher`: BM25 and the starting model, a function
   of the row alone). No held-out query text or judgement is read to build them. With ``rounds`` R > 1 each
   fold trains R times: round r > 1 adds ``model_negatives`` negatives a row mined by the same fold's (and
   seed's) round r-1 model (which never saw the held-out queries), and takes that model as the teacher's
   model half; it starts from that model (``round_start="previous"``) or the recipe's start (``"start"``).
3. The trained model ranks the **whole corpus** for the held-out fold's queries (exhaustive search).
4. References on the same queries: the recipe's starting model untrained (``zero-shot``) and BM25 (bm25s,
   the mining's BM25), each evaluated once.
5. Per system (the recipe is the last round's models; earlier rounds are ``recipe-round<r>``): nDCG@10,
   MRR@10, Recall@100 and non-zeros, the mean over folds (and seeds). Per comparison (recipe - zero-shot,
   recipe - BM25, zero-shot - BM25, recipe - recipe-round<r>): the per-query nDCG@10 differences over all
   held-out queries (each query held out exactly once; the recipe's score averaged over the seeds first), their
   mean,
   a 95% paired bootstrap interval and a paired randomization p-value
   (:mod:`~gradcache_sparton.evaluation.significance`); the same per seed.

Output in ``output_dir``: ``folds.json`` (the query ids of each fold), ``fold<k>/train.jsonl.gz`` (each
fold's training rows; later rounds' ``fold<k>/train-seed<s>-round<r>.jsonl.gz``), ``seed<s>/fold<k>/`` (each
trained model; later rounds' ``seed<s>/round<r>/fold<k>/``), ``crossval.json`` (settings, each fold's
held-out query ids, per-fold and per-query numbers, comparisons, the recipe's ``--config`` content; rewritten
after every fold, all its rounds, so a stopped run keeps what finished) and ``crossval.md`` (the tables). A run
into a folder holding a finished run's ``crossval.json`` of the same experiment (:mod:`.experiment`) adds its
seeds to that result; any other run into it, or one whose seed already has models there, is refused before
any file is written.

Seeds run as separate jobs, or the folds of a seed (``run_folds``: only those folds trained and evaluated, dealt
as in a run of all), are combined afterwards (``crossval --merge``, :mod:`.merge`) into the result one run with
all the seeds and folds would have written; two experiments on the same folds (two recipes) are compared
claim by claim with ``crossval --compare`` (:mod:`.compare`).

Modules: :mod:`.settings` (the settings and their checks), :mod:`.protocol` (folds, the recipe, the
evaluation, the run), :mod:`.experiment` (what makes two results one experiment), :mod:`.earlier` (a run into a folder holding an
earlier run's result), :mod:`.rows` (each fold's and round's training rows), :mod:`.teacher` (the distillation
teacher), :mod:`.report` (means over folds, paired comparisons, the markdown tables), :mod:`.merge` (runs of
one experiment combined) and :mod:`.compare` (two experiments compared); the flags of ``gradcache-sparton
crossval`` are :mod:`gradcache_sparton.cli.crossval`'s.
"""

from gradcache_sparton.crossval.compare import compare_crossval
from gradcache_sparton.crossval.merge import merge_crossval
from gradcache_sparton.crossval.protocol import make_folds, parse_recipe, run_crossval
from gradcache_sparton.crossval.report import format_report
from gradcache_sparton.crossval.settings import CrossvalSettings

__all__ = [
    "CrossvalSettings",
    "compare_crossval",
    "format_report",
    "make_folds",
    "merge_crossval",
    "parse_recipe",
    "run_crossval",
]
