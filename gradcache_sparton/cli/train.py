"""``gradcache-sparton train``: the flags and a config file read into the three argument dataclasses, then
the training job (:func:`~gradcache_sparton.pipeline.run_training`)."""

from __future__ import annotations

import json
import logging
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradcache_sparton.cli.train_help import CONFIG_HELP, HELP_ALL, train_fields, train_help

__all__ = ["DEFAULT_CONFIG", "train_command", "train_parser"]

logger = logging.getLogger(__name__)


def train_parser() -> Any:
    """``HfArgumentParser`` over the three argument dataclasses, plus ``--config`` (help: :func:`train_help`)."""
    from transformers import HfArgumentParser

    from gradcache_sparton.arguments import CachedSpladeTrainingArguments, DataArguments, ModelArguments

    parser = HfArgumentParser(
        (ModelArguments, DataArguments, CachedSpladeTrainingArguments), prog="gradcache-sparton train"
    )
    parser.add_argument("--config", default=None, help=CONFIG_HELP)

    def refuse(message: str) -> None:  # a flag's bad value: one line (the CLI's ValueError), not the usage
        raise ValueError(f"{message}; see gradcache-sparton train --help")

    parser.error = refuse
    return parser


def _unknown_flag_error(unknown: Sequence[str]) -> ValueError:
    """One error for arguments ``train`` does not know, suggesting the closest option names (difflib)."""
    import difflib

    options = [f"--{name}" for name in (*train_fields(), "config")]
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


def train_command(argv: Sequence[str]) -> int:
    from gradcache_sparton.arguments import load_config_file
    from gradcache_sparton.pipeline import run_training

    if HELP_ALL in argv or "-h" in argv or "--help" in argv:
        print(train_help(show_all=HELP_ALL in argv), end="")
        raise SystemExit(0)  # as argparse's own --help does
    parser = train_parser()
    pre, unknown = parser.parse_known_args(argv)
    if unknown:
        raise _unknown_flag_error(unknown)
    names = _argument_names()
    known = set().union(*names.values())
    named = _named_flags(argv, known | {"config"})
    config_path = _config_path(pre.config, named, names)
    config = {} if config_path is None else load_config_file(config_path)
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
