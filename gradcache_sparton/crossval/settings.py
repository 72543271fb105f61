"""The settings of a cross-validation (:mod:`gradcache_sparton.crossval`) besides the recipe, their checks,
and the check that the recipe's loss goes with the teacher."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gradcache_sparton.crossval.teacher import (
    DEFAULT_TEACHER_WEIGHT,
    LOSSES_READING_TEACHER,
    TEACHER_NORMALISATIONS,
    TEACHERS,
)
from gradcache_sparton.evaluation.encoding import EncodingSettings, check_max_lengths
from gradcache_sparton.evaluation.significance import DEFAULT_RESAMPLES
from gradcache_sparton.losses.splade import IN_BATCH_NORMALISATIONS
from gradcache_sparton.primitives.option_field import option

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gradcache_sparton.arguments import CachedSpladeTrainingArguments

__all__ = ["NEGATIVE_RANKS", "ROUND_STARTS", "CrossvalSettings", "check_recipe_loss"]

# The rank window (1-based, inclusive) both miners draw negatives from, BM25 in round 1 and the fold model in
# later rounds: ``mine``'s defaults. Ranks 1..9 are skipped to keep unjudged relevant abstracts (false
# negatives) out; 100 is the teacher's normalisation depth (:data:`.rows.TOP_K`), so every negative sits
# inside it.
NEGATIVE_RANKS = (10, 100)
# Where round r > 1 starts: the same fold's round r-1 model, or the recipe's starting model (docs/experiments.md).
ROUND_STARTS = ("previous", "start")


@dataclass
class CrossvalSettings:
    """What ``run_crossval`` does besides the recipe itself (see the module docstring); each field's help is
    its ``gradcache-sparton crossval`` flag's."""

    beir_path: str = field(metadata={"help": "BEIR folder: corpus.jsonl, queries.jsonl, qrels/<split>.tsv."})
    output_dir: str = field(metadata={"help": "folder for folds, models, crossval.json and crossval.md."})
    split: str = option("train", "qrels split whose judged queries are cross-validated.")
    folds: int = option(5, "number of folds (k): each trains on the other k-1 folds' queries.")
    fold_seed: int = option(0, "seed of the query shuffle (and of the pair choice).")
    seeds: list[int] = option([42], "training seeds: each fold trained once per seed.")
    run_folds: list[int] = option(
        [],
        "train and evaluate only these folds (indices 0..folds-1; default: all), dealt as in a run of all folds "
        "(same fold_seed, same held-out claims): split a run over jobs, then combine them with --merge.",
    )
    self_supervised_pairs: int = option(
        0, "add this many (sentence, rest of the abstract) pairs from documents no training query judges."
    )
    bm25_negatives: int = option(0, "BM25 negatives per training pair (0: none).")
    teacher: str = option(
        "none",
        "distillation teacher written as each training row's teacher_scores (needs --bm25_negatives >= 1 "
        "and a recipe with --contrastive kl_div or margin_mse): 'bm25+model' mixes BM25's and the starting "
        "model's scores of the row's positive and negatives, each normalised per query "
        "(--teacher_normalisation); 'fold' mixes BM25 with a model --teacher_recipe trains on each fold's "
        "training rows (per seed; the system 'teacher' in the report); with a --kl_in_batch recipe those two "
        "score every document of each batch instead (the student's --in_batch_teacher; --teacher_normalisation "
        "minmax or none).",
        choices=TEACHERS,
    )
    teacher_weight: float = option(
        DEFAULT_TEACHER_WEIGHT,
        "BM25's share of the teacher, in [0, 1] (the model gets the rest; 0: the model alone).",
    )
    teacher_recipe: str = option(
        "",
        "with --teacher fold: the teacher's train flags as one quoted string (--teacher_recipe=\"--model_name_or_path "
        "... --max_steps 50\"), as `train` takes them; trained on each fold's rows (its BM25 negatives, no "
        "teacher scores), its own loss not a distillation one.",
    )
    teacher_negatives: bool = option(
        False,
        "with --teacher fold: the teacher also trains on the rows' BM25 negatives (default: on the fold's pairs "
        "alone, as the best recipe trains; the negatives are there for the student's candidates).",
    )
    teacher_normalisation: str = option(
        TEACHER_NORMALISATIONS[0],
        "how each teacher system's scores are put on one scale per query before mixing: zscore against the "
        "query's top 100 corpus scores, minmax over the row's candidates (then x30, OpenSearch's), or none.",
        choices=TEACHER_NORMALISATIONS,
    )
    rounds: int = option(
        1,
        "train each fold this many times: round r > 1 trains on the fold's rows plus --model_negatives "
        "negatives a pair mined by the same fold's (and seed's) round r-1 model, which never saw the held-out "
        "claims; with --teacher, that model is the teacher's model half. The recipe row is the last round; "
        "earlier rounds are the systems recipe-round<r>, each compared with it. More rounds: harder negatives, "
        "R times the training.",
    )
    model_negatives: int = option(
        0,
        f"with --rounds >= 2: negatives a pair from the previous round's model's ranking of the full corpus "
        f"(ranks {NEGATIVE_RANKS[0]}..{NEGATIVE_RANKS[1]}, the pair's known positives skipped), after any BM25 "
        "ones. More: harder contrast, more documents a step.",
    )
    round_start: str = option(
        ROUND_STARTS[0],
        "where round r > 1 starts: 'previous' continues the round r-1 fold model (the model its negatives "
        "are hard for; R times the steps in all), 'start' retrains the recipe's starting model (the same steps, "
        "only the negatives differ).",
        choices=ROUND_STARTS,
    )
    bm25_reference: bool = option(True, "evaluate BM25 as a reference (needs bm25s).")
    query_max_length: int = option(32, "evaluation query tokens.")
    document_max_length: int = option(256, "evaluation document tokens.")
    eval_batch_size: int = option(64, "texts encoded at once in evaluation.")
    resamples: int = option(DEFAULT_RESAMPLES, "bootstrap and randomization draws.")
    write_runs: bool = option(False, "write every model's top 100 as TREC runs in runs/.")

    def encoding(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        device: str | None = None,
        bf16: bool = False,
        show_progress: bool = False,
    ) -> EncodingSettings:
        """How the protocol encodes texts (evaluation, model negatives, teacher): at the evaluation lengths and
        batch size, on ``device`` (None: the encoder's), under bf16 autocast when ``bf16`` (the recipe's
        ``--bf16``) and ``device`` is cuda."""
        return EncodingSettings(
            tokenizer,
            query_max_length=self.query_max_length,
            document_max_length=self.document_max_length,
            batch_size=self.eval_batch_size,
            device=device,
            autocast_dtype=torch.bfloat16 if bf16 and device == "cuda" else None,
            show_progress=show_progress,
        )

    def folds_to_run(self) -> list[int]:
        """The indices of the folds this run trains and evaluates, ascending: ``run_folds``, or all."""
        return sorted(self.run_folds) if self.run_folds else list(range(self.folds))

    def check(self) -> None:
        """``ValueError`` naming the first bad setting."""
        if self.folds < 2:
            raise ValueError(f"folds must be >= 2, got {self.folds}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be distinct and at least one, got {self.seeds}")
        if len(set(self.run_folds)) != len(self.run_folds) or any(
            not 0 <= k < self.folds for k in self.run_folds
        ):
            raise ValueError(
                f"--run_folds must be distinct fold indices in 0..{self.folds - 1} (--folds {self.folds}), "
                f"got {self.run_folds}"
            )
        for name in ("self_supervised_pairs", "bm25_negatives", "model_negatives"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("eval_batch_size", "resamples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        # The evaluation's encoding settings (EncodingSettings' own check), before any file is written.
        check_max_lengths(
            query_max_length=self.query_max_length, document_max_length=self.document_max_length
        )
        if self.teacher not in TEACHERS:
            raise ValueError(f"teacher must be one of {TEACHERS}, got {self.teacher!r}")
        if self.teacher != "none" and self.bm25_negatives < 1:
            raise ValueError(
                f"teacher={self.teacher!r} scores each training pair's positive against its negatives: it needs "
                f"bm25_negatives >= 1, got {self.bm25_negatives}"
            )
        if not 0.0 <= self.teacher_weight <= 1.0:
            raise ValueError(f"teacher_weight (BM25's share) must be in [0, 1], got {self.teacher_weight!r}")
        if self.teacher == "none" and self.teacher_weight != DEFAULT_TEACHER_WEIGHT:
            raise ValueError(
                f"teacher_weight applies to a teacher only, got teacher_weight={self.teacher_weight} with "
                "teacher='none'"
            )
        self._check_fold_teacher()
        self._check_rounds()

    def _check_fold_teacher(self) -> None:
        if self.teacher_normalisation not in TEACHER_NORMALISATIONS:
            raise ValueError(
                f"teacher_normalisation must be one of {TEACHER_NORMALISATIONS}, got {self.teacher_normalisation!r}"
            )
        if self.teacher == "none" and self.teacher_normalisation != TEACHER_NORMALISATIONS[0]:
            raise ValueError(
                f"teacher_normalisation applies to a teacher only, got {self.teacher_normalisation!r} with "
                "teacher='none'"
            )
        if self.teacher == "fold" and not self.teacher_recipe.strip():
            raise ValueError(
                "teacher='fold' trains a teacher in each fold: give its train flags, --teacher_recipe=\"--model_name_or_path "
                '... --max_steps N"'
            )
        if self.teacher != "fold" and self.teacher_negatives:
            raise ValueError(
                f"teacher_negatives applies to --teacher fold only, got teacher={self.teacher!r}"
            )
        if self.teacher != "fold" and self.teacher_recipe:
            raise ValueError(f"teacher_recipe applies to --teacher fold only, got teacher={self.teacher!r}")
        if self.teacher == "fold" and self.rounds > 1:
            raise ValueError(
                f"teacher='fold' with rounds={self.rounds}: a fold teacher and later rounds are two ways to a "
                "trained teacher; run one (rounds=1 with a fold teacher)"
            )

    def _check_rounds(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.model_negatives and self.rounds < 2:
            raise ValueError(
                f"model_negatives={self.model_negatives} are mined by a fold's previous round's model: they need "
                f"rounds >= 2, got rounds={self.rounds}"
            )
        if self.round_start not in ROUND_STARTS:
            raise ValueError(f"round_start must be one of {ROUND_STARTS}, got {self.round_start!r}")
        if self.rounds == 1 and self.round_start != ROUND_STARTS[0]:
            raise ValueError(
                f"round_start applies to rounds >= 2, got round_start={self.round_start!r} with rounds=1"
            )
        if self.rounds > 1 and not self.model_negatives and self.teacher == "none":
            raise ValueError(
                f"rounds={self.rounds} without model_negatives or a teacher trains every round on round 1's rows: "
                "give model_negatives >= 1 (or a teacher, which round r > 1 takes from the round r-1 model)"
            )
        if self.model_negatives:
            window = NEGATIVE_RANKS[1] - NEGATIVE_RANKS[0] + 1
            if self.model_negatives > window:
                raise ValueError(
                    f"model_negatives={self.model_negatives} are drawn from the fold model's ranks "
                    f"{NEGATIVE_RANKS[0]}..{NEGATIVE_RANKS[1]}: at most {window}"
                )


def check_recipe_loss(settings: CrossvalSettings, training_args: CachedSpladeTrainingArguments) -> None:
    """``ValueError`` unless the recipe's loss and the teacher go together: a teacher's scores are read
    only by ``--contrastive kl_div`` or ``margin_mse`` (any other loss would train as if there were no
    teacher, so the run would measure something else than asked), and those two need a teacher."""
    contrastive = training_args.contrastive
    if settings.teacher != "none" and contrastive not in LOSSES_READING_TEACHER:
        raise ValueError(
            f"teacher={settings.teacher!r} writes teacher_scores that only the losses {LOSSES_READING_TEACHER} "
            f"read, but the recipe trains with contrastive={contrastive!r}: add `--contrastive kl_div` to the "
            "train flags (after --), or drop --teacher"
        )
    if (
        settings.teacher == "fold"
        and training_args.kl_in_batch
        and settings.teacher_normalisation not in IN_BATCH_NORMALISATIONS
    ):
        raise ValueError(
            "teacher='fold' with a --kl_in_batch recipe scores every document of each batch for each query (the "
            "fold teacher and BM25 as the student's in_batch_teacher), normalised over the batch's documents: "
            f"teacher_normalisation must be one of {IN_BATCH_NORMALISATIONS}, got {settings.teacher_normalisation!r} "
            "(zscore needs each query's top K over the corpus): pass --teacher_normalisation minmax"
        )
    if settings.teacher != "none" and training_args.in_batch_teacher is not None:
        raise ValueError(
            f"teacher={settings.teacher!r} is the student's teacher, and the recipe names another "
            f"(--in_batch_teacher {training_args.in_batch_teacher!r}): drop one of them"
        )
    if (
        settings.teacher == "none"
        and contrastive in LOSSES_READING_TEACHER
        and not training_args.in_batch_teacher
    ):
        raise ValueError(
            f"the recipe trains with contrastive={contrastive!r}, which needs teacher scores: pass "
            f"--teacher {TEACHERS[1]} (with --bm25_negatives >= 1)"
        )
