"""Console entry point ``gradcache-sparton``: ``train``, ``evaluate``, ``mine`` and ``export``.

``train`` parses :class:`~gradcache_sparton.arguments.ModelArguments`,
:class:`~gradcache_sparton.arguments.DataArguments` and
:class:`~gradcache_sparton.arguments.CachedSpladeTrainingArguments` with ``HfArgumentParser``. Values
come from, in increasing priority: the dataclass defaults, a config file, then the flags. The config
file is ``--config FILE.yaml|json``; ``--config default``, or no ``--config`` and no flag naming a model
or training data, is the shipped ``resources/default_train.yaml`` (the embedded default run). A run that
names its own model or data therefore never inherits the demo's steps, learning rate or lengths; every
value a config file sets and no flag overrides is logged at the start.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["build_parser", "main"]

logger = logging.getLogger(__name__)

COMMANDS = {
    "train": "train a SPLADE model with GradCache (default: the embedded SciFact run)",
    "evaluate": "retrieval metrics (nDCG@10, MRR@10, Recall@100) of a checkpoint on a BEIR folder",
    "mine": "hard negatives (BM25 or a checkpoint's own ranking) written as a training file",
    "export": "encode a BEIR corpus with a checkpoint into a seismic or Anserini index file",
    "crossval": "k-fold cross-validation of a training recipe against zero-shot and BM25 (docs/experiments.md)",
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: ``--version``, ``--help`` and the command names (each parses its own flags)."""
    from gradcache_sparton.version import __version__

    parser = argparse.ArgumentParser(
        prog="gradcache-sparton",
        description=(
            "Train SPLADE-style learned sparse retrievers at very large effective batch sizes "
            "(GradCache engine + fused Triton SPLADE head)."
        ),
        epilog="Commands:\n"
        + "\n".join(f"  {n:<10}{h}" for n, h in COMMANDS.items())
        + "\n\nRun `gradcache-sparton COMMAND --help` for a command's flags.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("command", nargs="?", choices=sorted(COMMANDS), metavar="COMMAND")
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _train_parser() -> Any:
    """``HfArgumentParser`` over the three argument dataclasses, plus ``--config`` (help: :func:`_train_help`)."""
    from transformers import HfArgumentParser

    from gradcache_sparton.arguments import CachedSpladeTrainingArguments, DataArguments, ModelArguments

    parser = HfArgumentParser(
        (ModelArguments, DataArguments, CachedSpladeTrainingArguments), prog="gradcache-sparton train"
    )
    parser.add_argument("--config", default=None, help=_CONFIG_HELP)
    return parser


_CONFIG_HELP = (
    "YAML or JSON file of argument values, or 'default' (resources/default_train.yaml, the embedded run). "
    "Without --config the embedded run applies only if no flag names a model or training data."
)
HELP_ALL = "--help-all"
# The transformers.TrainingArguments options `train --help` shows (under "run"); the rest: --help-all.
_COMMON_TRAINER_OPTIONS = (
    "output_dir",
    "overwrite_output_dir",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "max_steps",
    "num_train_epochs",
    "learning_rate",
    "warmup_steps",
    "weight_decay",
    "lr_scheduler_type",
    "bf16",
    "fp16",
    "seed",
    "logging_steps",
    "save_strategy",
    "save_steps",
    "save_total_limit",
    "resume_from_checkpoint",
    "report_to",
    "dataloader_num_workers",
)
# Trainer options about memory and speed, shown beside the engine's. `gradient_checkpointing` is
# transformers' deprecated alias of `activation_checkpointing` where that exists (5.23+).
_MEMORY_TRAINER_OPTIONS = ("activation_checkpointing", "gradient_checkpointing", "torch_compile")


def _train_option_groups() -> dict[str, tuple[str, list[str]]]:
    """``train``'s own options by theme: title -> (description, argument names), in help order."""
    from dataclasses import fields

    from transformers import TrainingArguments

    from gradcache_sparton.arguments import CachedSpladeTrainingArguments, DataArguments, ModelArguments
    from gradcache_sparton.losses import SpladeLossConfig

    trainer_names = {f.name for f in fields(TrainingArguments)}
    loss_names = [f.name for f in fields(SpladeLossConfig)]
    data_names = [f.name for f in fields(DataArguments)]
    evaluation = [name for name in data_names if name.startswith(("eval_", "retrieval_eval"))]
    engine = [
        f.name
        for f in fields(CachedSpladeTrainingArguments)
        if f.name not in trainer_names and f.name not in loss_names and f.name not in _COMMON_TRAINER_OPTIONS
    ]
    memory = [name for name in _MEMORY_TRAINER_OPTIONS if name in trainer_names]
    if "activation_checkpointing" in memory:
        memory.remove("gradient_checkpointing")  # deprecated alias: --help-all only
    return {
        "model": ("which backbone, tokenizer, pooling and LoRA", [f.name for f in fields(ModelArguments)]),
        "data": (
            "training pairs (default: the shipped SciFact sample)",
            [n for n in data_names if n not in evaluation],
        ),
        "loss": ("the SPLADE loss: contrastive term, sparsity regularizers and their warm-up", loss_names),
        "engine and memory": (
            "per_device_train_batch_size is the effective batch; these bound memory and set speed, never the "
            "loss or gradients",
            engine + memory,
        ),
        "evaluation": (
            "retrieval metrics on a BEIR folder (default: the shipped SciFact dev sample)",
            evaluation,
        ),
        "run (the Trainer's most used options)": (
            "transformers.TrainingArguments",
            list(_COMMON_TRAINER_OPTIONS),
        ),
    }


def _train_fields() -> dict[str, Any]:
    """Every ``train`` argument's dataclass field (``dataclasses.Field``), by name."""
    from dataclasses import fields

    from gradcache_sparton.arguments import CachedSpladeTrainingArguments, DataArguments, ModelArguments

    return {
        f.name: f
        for cls in (ModelArguments, DataArguments, CachedSpladeTrainingArguments)
        for f in fields(cls)
        if f.init
    }


def _train_help(*, show_all: bool) -> str:
    """``train``'s help: general, then this project's options by theme, the Trainer's most used ones, then the
    Trainer's other options (with ``show_all``; else one line pointing at ``--help-all``).

    Built from the dataclass fields' help texts into a parser used for display only (the parsing parser is
    ``HfArgumentParser``'s), each option once under its underscore name."""
    from dataclasses import MISSING

    display = argparse.ArgumentParser(
        prog="gradcache-sparton train",
        usage="gradcache-sparton train [--config FILE|default] [--NAME VALUE ...]",
        description="Train a SPLADE model with GradCache. Flags override --config. Bool flags take a value "
        "(--bf16 True). The defaults shown are the arguments' own; with no --config and no flag naming a model "
        "or training data, the embedded run's values apply over them (resources/default_train.yaml).",
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(
            prog, max_help_position=32, width=110
        ),
        add_help=False,
    )
    general = display.add_argument_group("general")
    general.add_argument("-h", "--help", action="store_true", help="Show this help and exit.")
    general.add_argument(
        HELP_ALL, action="store_true", help="Show every option, the Trainer's own too, and exit."
    )
    general.add_argument("--config", metavar="CONFIG", help=_CONFIG_HELP)
    remaining = _train_fields()

    def add(group: Any, name: str) -> None:
        field = remaining.pop(name)
        boolean = isinstance(field.default, bool)
        metavar = field.metadata.get("metavar") or ("BOOL" if boolean else name.upper())
        default = "" if field.default is MISSING or field.default is None else f" [default: {field.default}]"
        group.add_argument(f"--{name}", metavar=metavar, help=field.metadata.get("help", "") + default)

    for title, (description, names) in _train_option_groups().items():
        group = display.add_argument_group(title, description)
        for name in names:
            if name in remaining:
                add(group, name)
    if show_all:
        trainer = display.add_argument_group("the Trainer's other options (transformers.TrainingArguments)")
        for name in sorted(remaining):
            add(trainer, name)
    else:
        display.epilog = (
            f"The Trainer's {len(remaining)} other options (transformers.TrainingArguments): "
            f"gradcache-sparton train {HELP_ALL}"
        )
    return display.format_help()


def _unknown_flag_error(unknown: Sequence[str]) -> ValueError:
    """One error for arguments ``train`` does not know, suggesting the closest option names (difflib)."""
    import difflib

    options = [f"--{name}" for name in (*_train_fields(), "config")]
    flags = [token for token in unknown if token.startswith("-")] or list(unknown)
    parts = []
    for token in flags:
        flag = "--" + token.split("=", 1)[0].lstrip("-").replace("-", "_")  # --dashed-name forms too
        close = difflib.get_close_matches(flag, options, n=3, cutoff=0.75) if token.startswith("--") else []
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        parts.append(f"{token}{hint}")
    return ValueError(
        f"unrecognized argument(s): {', '.join(parts)}; see gradcache-sparton train --help (--help-all for all)"
    )


# Flags that name the model or the training data (besides every ModelArguments field): with any of them
# and no --config, the embedded default run's values do not apply.
_DATA_FLAGS = ("train_data", "train_beir", "self_supervised_corpus")
DEFAULT_CONFIG = "default"


def _argument_names() -> dict[str, set[str]]:
    """The ``train`` argument names of each dataclass (public ``dataclasses.fields``), keyed by its role."""
    from dataclasses import fields

    from gradcache_sparton.arguments import CachedSpladeTrainingArguments, DataArguments, ModelArguments

    roles = {"model": ModelArguments, "data": DataArguments, "training": CachedSpladeTrainingArguments}
    return {role: {f.name for f in fields(cls) if f.init} for role, cls in roles.items()}


def _named_flags(argv: Sequence[str], known: set[str]) -> set[str]:
    """Argument names given as flags in ``argv`` (``--name``, ``--name=value``, ``--no_name``)."""
    named = set()
    for token in argv:
        if not token.startswith("--"):
            continue
        name = token[2:].split("=", 1)[0]
        if name not in known and name.startswith("no_") and name[3:] in known:
            name = name[3:]  # HfArgumentParser's --no_<flag> for a bool field that defaults to True
        named.add(name)
    return named


def _config_path(config: str | None, named: set[str], names: dict[str, set[str]]) -> Path | None:
    """The config file this run reads: ``--config``, else the embedded run unless a model or data is named."""
    from gradcache_sparton.resources import default_train_config_path

    if config is not None:
        return default_train_config_path() if config == DEFAULT_CONFIG else Path(config)
    naming = sorted(named & (names["model"] | set(_DATA_FLAGS)))
    if naming:
        logger.info(
            "No --config and %s given: the embedded default run (resources/default_train.yaml) does not apply; "
            "unset arguments take the dataclass defaults (--config default starts from the embedded run).",
            ", ".join(f"--{name}" for name in naming),
        )
        return None
    return default_train_config_path()


def _load_config(path: Path) -> dict[str, Any]:
    """The mapping of argument names to values in a YAML or JSON file; ``ValueError`` naming file and line."""
    if not path.is_file():
        raise ValueError(f"--config {str(path)!r} does not exist (give a .yaml/.json file or 'default')")
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        import yaml

        try:
            values = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ValueError(f"--config {str(path)!r}{where}: not valid YAML ({problem})") from None
    elif suffix == ".json":
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"--config {str(path)!r} line {exc.lineno}: not valid JSON ({exc.msg})"
            ) from None
    else:
        raise ValueError(f"--config must be a .yaml, .yml or .json file or 'default', got {str(path)!r}")
    if not isinstance(values, dict):
        raise ValueError(f"--config {str(path)!r} must hold a mapping of argument names to values")
    return values


def _train(argv: Sequence[str]) -> int:
    from gradcache_sparton.pipeline import run_training

    if HELP_ALL in argv or "-h" in argv or "--help" in argv:
        print(_train_help(show_all=HELP_ALL in argv), end="")
        raise SystemExit(0)  # as argparse's own --help does
    parser = _train_parser()
    pre, unknown = parser.parse_known_args(argv)
    if unknown:
        raise _unknown_flag_error(unknown)
    names = _argument_names()
    known = set().union(*names.values())
    named = _named_flags(argv, known | {"config"})
    config_path = _config_path(pre.config, named, names)
    config = {} if config_path is None else _load_config(config_path)
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"--config {_shown_path(config_path)!r} has unknown argument(s) {unknown}")
    if "config_name" in named and "model_name_or_path" not in named:
        config.pop("model_name_or_path", None)  # a shape named by flag replaces the config's checkpoint
    parser.set_defaults(**config)
    model_args, data_args, training_args, rest = parser.parse_args_into_dataclasses(args=list(argv))
    del rest  # only --config, already read
    if config_path is not None:
        applied = {k: v for k, v in config.items() if k not in named}
        logger.info(
            "config %s sets (no flag overrides them): %s",
            _shown_path(config_path),
            ", ".join(f"{k}={v!r}" for k, v in applied.items()) or "nothing",
        )
    metrics = run_training(model_args, data_args, training_args)
    if training_args.process_index == 0:  # under DDP, one summary rather than one per process
        print(json.dumps({"output_dir": training_args.output_dir, **metrics}, indent=2))
        if "eval_before_ndcg_at_10" in metrics and "eval_ndcg_at_10" in metrics:
            before, after = metrics["eval_before_ndcg_at_10"], metrics["eval_ndcg_at_10"]
            line = f"dev nDCG@10: before training {before:.4f}, after {after:.4f} ({after - before:+.4f}"
            if "eval_gain_ndcg_at_10_ci95_low" in metrics:  # the paired statistics over the dev queries
                line += (
                    f"; 95% interval {metrics['eval_gain_ndcg_at_10_ci95_low']:+.4f} to "
                    f"{metrics['eval_gain_ndcg_at_10_ci95_high']:+.4f}, p = {metrics['eval_gain_ndcg_at_10_p_value']:.3f}, "
                    f"{metrics['eval_gain_ndcg_at_10_queries']:.0f} queries"
                )
            print(line + ")")
        # Last, on stderr (stdout stays the JSON summary a script reads): where the model went, what next.
        sys.stdout.flush()
        print(
            f"The trained model is in {training_args.output_dir}/. Next, evaluate it:\n"
            f"  gradcache-sparton evaluate --model_name_or_path {shlex.quote(str(training_args.output_dir))}",
            file=sys.stderr,
        )
    return 0


def _shown_path(path: Path) -> str:
    """``path`` as logs show it: a shipped file relative to the package, never this machine's absolute path."""
    from gradcache_sparton.resources import RESOURCES_DIR

    try:
        return str(Path("gradcache_sparton/resources") / path.resolve().relative_to(RESOURCES_DIR))
    except ValueError:
        return str(path)


def _evaluate(argv: Sequence[str]) -> int:
    from gradcache_sparton.evaluation import DEFAULT_MEASURES, RETRIEVALS, PruningBudget, format_table
    from gradcache_sparton.pipeline import run_evaluation

    parser = argparse.ArgumentParser(
        prog="gradcache-sparton evaluate",
        description=COMMANDS["evaluate"] + " (default: shipped SciFact dev).",
    )
    parser.add_argument(
        "--model_name_or_path",
        required=True,
        help="Checkpoint folder (`train` writes outputs/splade-<date>-<time> and prints it), shipped name "
        "(splade-tiny-msmarco) or hub id.",
    )
    parser.add_argument(
        "--beir_path",
        nargs="+",
        default=None,
        help="One or more BEIR folders (a per-dataset table and the mean); default: the shipped SciFact dev sample.",
    )
    parser.add_argument("--split", default="dev", help="qrels split (qrels/<split>.tsv).")
    parser.add_argument(
        "--query_max_length",
        type=int,
        default=None,
        help="Default: the checkpoint's training length, else 32.",
    )
    parser.add_argument(
        "--document_max_length",
        type=int,
        default=None,
        help="Default: the checkpoint's training length, else 256.",
    )
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available).")
    parser.add_argument(
        "--measures",
        nargs="+",
        default=None,
        help=f"ir_measures names, e.g. nDCG@10 RR@10 R@100 AP P@5 (default: {' '.join(DEFAULT_MEASURES)}, "
        "the recall cutoff following --top_k).",
    )
    parser.add_argument("--top_k", type=int, default=100, help="Documents retrieved per query.")
    parser.add_argument(
        "--retrieval",
        choices=RETRIEVALS,
        default="exhaustive",
        help="Exhaustive search, or a seismic inverted index (exact by default; needs pyseismic-lsr).",
    )
    parser.add_argument(
        "--budgets",
        nargs="+",
        default=["full"],
        help="Pruning budgets Q:D[:T] (query top-k, document top-k: an int or 'all'; weight threshold), "
        "e.g. full 64:256 32:128 all:all:0.5: metrics and index size (postings) at each.",
    )
    parser.add_argument(
        "--output_file",
        type=Path,
        default=None,
        help="Also write the metrics as JSON here, and each TREC run beside it (<stem>.<dataset>.<budget>.trec).",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing --output_file and its TREC runs."
    )
    args = parser.parse_args(argv)
    budgets = [PruningBudget.parse(text) for text in args.budgets]
    if args.output_file is not None:
        # Before any work: a result is never lost to a bad path, nor a file to a result.
        _prepare_output_file(args.output_file, overwrite=args.overwrite)
    result = run_evaluation(
        args.model_name_or_path,
        beir_path=args.beir_path,
        split=args.split,
        query_max_length=args.query_max_length,
        document_max_length=args.document_max_length,
        batch_size=args.batch_size,
        device=args.device,
        measures=args.measures,
        top_k=args.top_k,
        budgets=budgets,
        retrieval=args.retrieval,
        run_prefix=None if args.output_file is None else args.output_file.with_suffix(""),
        overwrite=args.overwrite,
    )
    if all(isinstance(row, dict) for row in result.values()):  # a table: one row per dataset / budget
        print(format_table(result), file=sys.stderr)
    text = json.dumps(result, indent=2)
    print(text, flush=True)  # first: the metrics reach the terminal even if writing the file fails
    if args.output_file is not None:
        args.output_file.write_text(text + "\n", encoding="utf-8")
    return 0


def _prepare_output_file(path: Path, *, overwrite: bool) -> None:
    """Create the folder of ``--output_file`` and check it can be written and, without ``overwrite``, does
    not exist (as ``mine`` and ``export`` check theirs); ``ValueError`` if not."""
    if path.is_dir():
        raise ValueError(f"--output_file {str(path)!r} is a directory; give a file path")
    if path.exists() and not overwrite:
        raise ValueError(f"--output_file {str(path)!r} exists: pass --overwrite to replace it")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--output_file {str(path)!r}: cannot create its folder ({exc})") from None
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"--output_file {str(path)!r} is not writable")


def _mine(argv: Sequence[str]) -> int:
    from gradcache_sparton.mining import BM25_STEMMER, CORPORA, METHODS, SAMPLINGS, run_mining

    parser = argparse.ArgumentParser(
        prog="gradcache-sparton mine",
        description=COMMANDS["mine"] + " (docs/mining.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    source = parser.add_argument_group("input (default, neither given: the shipped SciFact training pairs)")
    source.add_argument(
        "--train_data", default=None, help="jsonl of pairs: query, positive [, query_id, positive_id]."
    )
    source.add_argument(
        "--beir_path",
        default=None,
        help="BEIR folder ('default': the shipped SciFact dev sample): its qrels give the pairs unless "
        "--train_data is set.",
    )
    parser.add_argument(
        "--split",
        default=None,
        help="qrels split of --beir_path (qrels/<split>.tsv); default: train ('dev' for --beir_path default).",
    )
    parser.add_argument(
        "--corpus",
        choices=CORPORA,
        default=None,
        help="mine from the BEIR corpus (default with --beir_path) or the pairs' distinct positives.",
    )
    parser.add_argument(
        "--output_file",
        type=Path,
        default=Path("negatives.jsonl.gz"),
        help="the training file (.jsonl[.gz]).",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output_file.")
    parser.add_argument(
        "--method", choices=METHODS, default="bm25", help="bm25, or splade: a checkpoint's own ranking."
    )
    parser.add_argument(
        "--model_name_or_path",
        default=None,
        help="--method splade: checkpoint folder, shipped name or hub id.",
    )
    parser.add_argument("--num_negatives", type=int, default=2, help="k: negative_1..k per pair.")
    parser.add_argument(
        "--rank_start",
        type=int,
        default=10,
        help="first rank (1-based) a negative may have: higher skips more unjudged positives, gives easier negatives.",
    )
    parser.add_argument("--rank_end", type=int, default=100, help="last rank a negative may have.")
    parser.add_argument(
        "--sampling",
        choices=SAMPLINGS,
        default="random",
        help="random: k drawn (seeded) from the window; top: the k best ranked.",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of --sampling random.")
    parser.add_argument(
        "--bm25_stemmer", default=BM25_STEMMER, help="PyStemmer algorithm for BM25 tokens, or none."
    )
    parser.add_argument(
        "--query_max_length",
        type=int,
        default=None,
        help="--method splade: query tokens (None: the checkpoint's training length, else 32).",
    )
    parser.add_argument(
        "--document_max_length",
        type=int,
        default=None,
        help="--method splade: document tokens (None: the checkpoint's training length, else 256).",
    )
    parser.add_argument("--batch_size", type=int, default=64, help="--method splade: encoding batch.")
    parser.add_argument(
        "--device", default=None, help="--method splade: cpu, cuda, ... (default: cuda if any)."
    )
    args = parser.parse_args(argv)
    summary = run_mining(
        output_file=args.output_file,
        train_data=args.train_data,
        beir_path=args.beir_path,
        split=args.split,
        corpus=args.corpus,
        method=args.method,
        model_name_or_path=args.model_name_or_path,
        num_negatives=args.num_negatives,
        rank_start=args.rank_start,
        rank_end=args.rank_end,
        sampling=args.sampling,
        seed=args.seed,
        query_max_length=args.query_max_length,
        document_max_length=args.document_max_length,
        batch_size=args.batch_size,
        device=args.device,
        bm25_stemmer=None if args.bm25_stemmer.lower() == "none" else args.bm25_stemmer,
        overwrite=args.overwrite,
    )
    print(json.dumps(summary, indent=2))
    return 0


def _export(argv: Sequence[str]) -> int:
    from gradcache_sparton.evaluation import EXPORT_FORMATS
    from gradcache_sparton.pipeline import run_export

    parser = argparse.ArgumentParser(
        prog="gradcache-sparton export",
        description=COMMANDS["export"] + " (docs/evaluation.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model_name_or_path",
        required=True,
        help="checkpoint folder (from `train`), shipped name or hub id.",
    )
    parser.add_argument(
        "--beir_path",
        default="default",
        help="BEIR folder whose corpus.jsonl[.gz] is encoded ('default': the shipped SciFact dev sample).",
    )
    parser.add_argument(
        "--output_file", type=Path, required=True, help="the JSON-lines file to write (.jsonl or .json)."
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output_file.")
    parser.add_argument(
        "--format",
        choices=EXPORT_FORMATS,
        default="seismic",
        help="seismic: float weights (SeismicIndex.build); anserini: JsonVectorCollection, int impacts.",
    )
    parser.add_argument(
        "--scale", type=float, default=100.0, help="anserini: impact = round(weight x scale); 0s left out."
    )
    parser.add_argument(
        "--document_max_length",
        type=int,
        default=None,
        help="document tokens (None: the checkpoint's training length, else 256).",
    )
    parser.add_argument("--batch_size", type=int, default=64, help="documents encoded at once.")
    parser.add_argument(
        "--chunk_size",
        type=int,
        default=4096,
        help="documents encoded and written per chunk (bounds memory).",
    )
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if any).")
    args = parser.parse_args(argv)
    summary = run_export(
        args.model_name_or_path,
        beir_path=args.beir_path,
        output_file=args.output_file,
        export_format=args.format,
        document_max_length=args.document_max_length,
        batch_size=args.batch_size,
        chunk_size=args.chunk_size,
        scale=args.scale,
        device=args.device,
        overwrite=args.overwrite,
    )
    print(json.dumps(summary, indent=2))
    return 0


def _quiet_third_parties() -> None:
    """One progress bar per long phase: off go transformers' per-file bars ("Loading weights", "Writing model
    shards") and datasets' ("Generating train split"); hub downloads keep theirs; the Trainer's and our
    encoding bars stay."""
    import datasets
    import huggingface_hub.utils
    import transformers

    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.enable_progress_bars()  # transformers turned the download bars off too
    datasets.disable_progress_bars()


def _crossval(argv: Sequence[str]) -> int:
    from gradcache_sparton.crossval import main as crossval_main

    return crossval_main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    _quiet_third_parties()
    from gradcache_sparton.run_state import CheckpointWriteError, TrainingStopped

    run = {"train": _train, "evaluate": _evaluate, "mine": _mine, "export": _export, "crossval": _crossval}[
        args.command
    ]
    try:
        return run(args.args)
    except ValueError as exc:  # bad arguments or data: one clear line, no traceback
        print(f"gradcache-sparton {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except TrainingStopped as exc:  # a run stopped before its last step: not a success
        print(f"gradcache-sparton {args.command}: {exc}", file=sys.stderr)
        return 3
    except CheckpointWriteError as exc:  # a full disk: the file named, no traceback
        print(f"gradcache-sparton {args.command}: error: {exc.strerror}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
