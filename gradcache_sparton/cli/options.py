"""How every command but ``train`` reads its flags: dataclasses parsed by ``HfArgumentParser`` (as ``train``),
with the options more than one command reads declared once here."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from gradcache_sparton.cli.commands import COMMANDS
from gradcache_sparton.primitives.option_field import option

__all__ = [
    "CheckpointOptions",
    "EncodingOptions",
    "QueryLengthOption",
    "parse_command",
    "run_job_command",
]


@dataclass
class EncodingOptions:
    """How a command encodes texts (``evaluate``, ``export``, ``mine``, ``teacher``); the lengths are those of
    our checkpoints (:func:`~gradcache_sparton.model_loading.checkpoint_max_lengths`)."""

    document_max_length: int | None = option(
        None, "Document tokens (None: the checkpoint's training length, at least 256)."
    )
    batch_size: int = option(64, "Texts encoded at once (a cross-encoder teacher's: pairs).")
    device: str | None = option(None, "cpu, cuda, cuda:1, ... (None: cuda if available).")


@dataclass
class _CheckpointName:
    model_name_or_path: str | None = option(
        None,
        "Checkpoint folder (`train` writes outputs/splade-<date>-<time> and prints it), shipped name (splade-tiny-msmarco) or hub id.",
    )


@dataclass
class CheckpointOptions(EncodingOptions, _CheckpointName):
    """The checkpoint a command encodes texts with, and how (``evaluate``, ``export``, ``mine``): its name, then
    the :class:`EncodingOptions` (a dataclass lists its last base's fields first)."""


@dataclass
class QueryLengthOption:
    """Query tokens, for the commands that encode queries (``evaluate``, ``mine``, ``teacher``)."""

    query_max_length: int | None = option(
        None, "Query tokens (None: the checkpoint's training length, else 32)."
    )


def parse_command(
    command: str,
    argv: Sequence[str],
    dataclass_types: Sequence[type],
    *,
    description: str,
    required: Sequence[str] = (),
    required_unless: Sequence[str] = (),
    usage: str | None = None,
) -> tuple[Any, ...]:
    """``argv`` parsed into one instance of each of ``dataclass_types`` (``gradcache-sparton COMMAND``'s flags).

    ``description`` follows the command's one-line help; each name in ``required`` is a flag this command
    cannot run without (argparse's own error names it), unless a flag of ``required_unless`` (another mode
    of the command) is given; ``usage`` replaces argparse's generated one (a command with several modes).
    """
    from transformers import HfArgumentParser

    parser = HfArgumentParser(
        dataclass_types,
        prog=f"gradcache-sparton {command}",
        description=f"{COMMANDS[command]}{description}",
        usage=usage,
    )
    options = tuple(parser.parse_args_into_dataclasses(list(argv)))

    def given(name: str) -> bool:
        return any(getattr(o, name, None) is not None for o in options)

    missing = [f"--{name}" for name in required if not given(name)]
    if missing and not any(given(name) for name in required_unless):
        modes = f" (or {' or '.join(f'--{name}' for name in required_unless)})" if required_unless else ""
        parser.error(f"the following arguments are required: {', '.join(missing)}{modes}")
    return options


def run_job_command(
    command: str,
    argv: Sequence[str],
    dataclass_types: Sequence[type],
    job: Callable[..., Mapping[str, Any]],
    **parse_options: Any,
) -> int:
    """``gradcache-sparton COMMAND`` for a job function: every flag by name, whichever of ``dataclass_types``
    declares it (:func:`parse_command` with ``parse_options``), as ``job``'s keywords; the job's summary printed
    as JSON; exit status 0."""
    parsed = parse_command(command, argv, dataclass_types, **parse_options)
    summary = job(**{name: value for options in parsed for name, value in asdict(options).items()})
    print(json.dumps(summary, indent=2))
    return 0
