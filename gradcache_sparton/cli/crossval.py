"""``gradcache-sparton crossval``: k-fold cross-validation of a training recipe
(:func:`~gradcache_sparton.crossval.run_crossval`); ``--merge``: runs of one experiment combined
(:func:`~gradcache_sparton.crossval.merge_crossval`); ``--compare``: two experiments on the same folds, claim by
claim (:func:`~gradcache_sparton.crossval.compare_crossval`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields

from gradcache_sparton.cli.options import parse_command
from gradcache_sparton.crossval.settings import CrossvalSettings
from gradcache_sparton.primitives.option_field import option

__all__ = ["CrossvalOptions", "crossval_command"]

USAGE = (
    "gradcache-sparton crossval --beir_path DIR --output_dir DIR [options] [-- TRAIN FLAGS (as `train` takes them)]\n"
    "       gradcache-sparton crossval --merge FILE [FILE ...] --output_dir DIR [--beir_path DIR] [--overwrite]\n"
    "       gradcache-sparton crossval --compare FILE_A FILE_B [--names NAME_A NAME_B] --output_dir DIR "
    "[--beir_path DIR] [--overwrite]"
)
# All each mode reads; the rest (settings, recipe) is the files'.
MODE_FLAGS = {
    "merge": ("merge", "output_dir", "beir_path", "overwrite"),
    "compare": ("compare", "names", "output_dir", "beir_path", "overwrite"),
}


@dataclass
class CrossvalOptions(CrossvalSettings):
    """``crossval``'s flags: the run's settings (:class:`~gradcache_sparton.crossval.CrossvalSettings`, their
    help its fields'), ``--no_bm25`` for its ``bm25_reference``, and the ``--merge`` and ``--compare`` modes."""

    beir_path: str | None = option(
        None,
        "BEIR folder: corpus.jsonl, queries.jsonl, qrels/<split>.tsv (with --merge or --compare: optional, "
        "rebuilds the folds of result files that do not record their query ids).",
    )
    output_dir: str = option(
        None,
        "folder for folds, models, crossval.json and crossval.md (--compare: compare.json and compare.md).",
        required=True,
    )
    bm25_reference: bool = field(default=True, init=False)  # not a flag: --no_bm25 sets it
    no_bm25: bool = option(False, "skip the BM25 reference (needs no bm25s then).")
    merge: list[str] | None = option(
        None,
        "instead of running: combine the crossval.json of runs of one experiment (e.g. one seed each, or "
        "some folds each with --run_folds, run as separate jobs) into the result one run with all their seeds "
        "and folds would have written, in --output_dir; "
        "settings come from the files, which must agree (docs/crossval.md).",
        metavar="FILE",
    )
    compare: list[str] | None = option(
        None,
        "instead of running: compare two experiments' crossval.json (e.g. two recipes) on the same folds' "
        "claims: each one's recipe and zero-shot, BM25, and their paired per-claim nDCG@10 differences, written "
        "as compare.json and compare.md in --output_dir (docs/crossval.md).",
        metavar="FILE",
    )
    names: list[str] | None = option(
        None, "with --compare: the two files' names in the tables (None: A and B).", metavar="NAME"
    )
    overwrite: bool = option(
        False,
        "with --merge (--compare): replace an existing --output_dir/crossval.json (compare.json).",
    )

    def __post_init__(self) -> None:
        self.bm25_reference = not self.no_bm25

    def settings(self) -> CrossvalSettings:
        """The run's settings: these options less the flags of the other modes."""
        return CrossvalSettings(**{f.name: getattr(self, f.name) for f in fields(CrossvalSettings)})


def _given(options: CrossvalOptions, reads: Sequence[str]) -> list[str]:
    """The flags, besides ``reads``, whose values differ from their defaults."""
    return [
        f"--{f.name}"
        for f in fields(options)
        if f.init
        and f.name not in reads
        and getattr(options, f.name) != (f.default_factory() if f.default is MISSING else f.default)
    ]


def crossval_command(argv: Sequence[str]) -> int:
    """``gradcache-sparton crossval [options] -- [train flags]``: run and print the markdown report (or merge,
    or compare: the modules' docstrings)."""
    from gradcache_sparton.crossval import compare_crossval, format_report, merge_crossval
    from gradcache_sparton.crossval.compare import format_comparison
    from gradcache_sparton.crossval.protocol import parse_recipe, run_crossval

    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    (options,) = parse_command(
        "crossval",
        argv[:split],
        (CrossvalOptions,),
        description=": each fold's queries ranked against the full corpus by a model trained on the other folds "
        "only; zero-shot and BM25 as references; paired bootstrap intervals and randomization p-values over all "
        "held-out queries.",
        required=("beir_path",),
        required_unless=tuple(MODE_FLAGS),
        usage=USAGE,
    )
    recipe_flags = argv[split + 1 :]
    modes = [mode for mode in MODE_FLAGS if getattr(options, mode) is not None]
    if len(modes) > 1:
        raise ValueError("--merge and --compare are two modes: give one")
    for mode in modes:
        given = _given(options, MODE_FLAGS[mode])
        if given or split < len(argv):
            raise ValueError(
                f"--{mode} takes the settings and recipe from the {mode}d files: leave out {given or 'the train flags'}"
            )
    if options.merge is not None:
        merged = merge_crossval(
            options.merge,
            output_dir=options.output_dir,
            beir_path=options.beir_path,
            overwrite=options.overwrite,
        )
        print(format_report(merged))
        return 0
    if options.compare is not None:
        comparison = compare_crossval(
            options.compare,
            output_dir=options.output_dir,
            names=options.names or ("A", "B"),
            beir_path=options.beir_path,
            overwrite=options.overwrite,
        )
        print(format_comparison(comparison))
        return 0
    if options.overwrite:
        raise ValueError(
            "--overwrite applies to --merge and --compare only (a run rewrites its own output_dir's results)"
        )
    if options.names is not None:
        raise ValueError("--names applies to --compare only")
    settings = options.settings()
    settings.check()  # before the recipe's flags and any data are read
    model_args, training_args = parse_recipe(recipe_flags)
    results = run_crossval(settings, model_args, training_args, recipe_flags=recipe_flags)
    print(format_report(results))
    return 0
