"""A documented configuration field: its default and its help text declared together, once.

Every configuration dataclass of the package (the engine's, the loss's, the training and cross-validation
arguments, each command's flags) declares its fields with :func:`option`; ``HfArgumentParser`` reads the help
text and any further ``add_argument`` keyword from the field's metadata.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

__all__ = ["option"]


def option(default: Any, help: str, **argparse_kwargs: Any) -> Any:
    """A dataclass field with its default, its help and any further ``add_argument`` keyword (``choices``,
    ``required``); a list default is copied for each instance."""
    metadata = {"help": help, **argparse_kwargs}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)
