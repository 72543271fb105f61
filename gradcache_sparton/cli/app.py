"""The top-level parser (``--version``, ``--help``, the command names) and the dispatch to each command."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from gradcache_sparton.cli.commands import COMMANDS
from gradcache_sparton.cli.evaluate import evaluate_command
from gradcache_sparton.cli.export import export_command
from gradcache_sparton.cli.idf import idf_command
from gradcache_sparton.cli.mine import mine_command
from gradcache_sparton.cli.teacher import teacher_command
from gradcache_sparton.cli.threads import fit_threads_to_free_cpus
from gradcache_sparton.cli.train import train_command

__all__ = ["build_parser", "main"]


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


def _crossval_command(argv: Sequence[str]) -> int:
    # Imported when run: the crossval package loads the training stack.
    from gradcache_sparton.cli.crossval import crossval_command

    return crossval_command(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    _quiet_third_parties()
    if argv is None:  # the process is this command (called from Python, the threads stay the caller's)
        fit_threads_to_free_cpus()  # on a shared machine, torch's threads on the cores others leave free
    from gradcache_sparton.run_state import CheckpointWriteError, TrainingStopped

    run = {
        "train": train_command,
        "evaluate": evaluate_command,
        "mine": mine_command,
        "teacher": teacher_command,
        "export": export_command,
        "idf": idf_command,
        "crossval": _crossval_command,
    }[args.command]
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
