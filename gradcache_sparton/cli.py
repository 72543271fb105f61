"""Console entry point ``gradcache-sparton``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; each subcommand adds its own sub-parser."""
    from gradcache_sparton import __version__

    parser = argparse.ArgumentParser(
        prog="gradcache-sparton",
        description=(
            "Train SPLADE-style learned sparse retrievers at very large effective batch sizes "
            "(GradCache engine + fused Triton SPLADE head)."
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
