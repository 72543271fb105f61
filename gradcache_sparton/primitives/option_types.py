"""A configuration file's values checked against the types of the dataclass fields they set.

A flag's text is converted by its parser (``HfArgumentParser``: ``--keep_graphs 1`` is True), and so is a
string in a YAML or JSON file (argparse converts a string default as it converts a flag's text). A YAML
``keep_graphs: 1`` or ``mini_batch_size: 2.5`` is neither: it reaches the dataclass as an int or a float. This
module refuses such a value when the file is read, with one ``ValueError`` naming the file and the key,
rather than the field's own ``TypeError`` (the Python API's, for a caller's wrong type) later.

Only clear mismatches are refused: a value of a type none of the field's annotated types takes (an int for a
bool, a float or bool for an int, a bool or a list for a float, null where None is not allowed). Strings pass
(the parser converts or refuses them), and so do values of fields typed otherwise (str, paths, enums, Any):
their own checks see them.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["check_value_types"]

# How each plain annotated type is named in the error, and what it takes.
_NAMES = {bool: "a bool (true/false)", int: "an int", float: "a number", type(None): "null"}


def _takes(hint: Any, value: Any) -> bool | None:
    """Whether a field annotated ``hint`` takes ``value`` (True/False), or None where this module does not
    judge (a string, or a type it leaves to the field's own checks)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        verdicts = [_takes(member, value) for member in typing.get_args(hint)]
        if any(v is None for v in verdicts):
            return None
        return any(verdicts)
    if isinstance(value, str):
        return None
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is list or hint is list:
        return isinstance(value, list)
    if origin in (dict, Mapping) or hint is dict:
        return isinstance(value, dict)
    return None


def _expected(hint: Any) -> str:
    members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    names = []
    for member in members:
        origin = typing.get_origin(member) or member
        name = _NAMES.get(member) or {list: "a list", dict: "a mapping"}.get(
            origin, getattr(member, "__name__", str(member))
        )
        names.append(name)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def check_value_types(values: Mapping[str, Any], classes: Iterable[type], *, source: str) -> None:
    """``ValueError`` naming ``source`` (e.g. ``--config 'run.yaml'``) and the key, for the first value of
    ``values`` that the field of that name in ``classes`` cannot take (module docstring); keys that name no
    field are left to the caller."""
    hints: dict[str, Any] = {}
    for cls in classes:
        for name, hint in typing.get_type_hints(cls).items():
            hints.setdefault(name, hint)
    for key, value in values.items():
        if key in hints and _takes(hints[key], value) is False:
            shown = "null" if value is None else f"{value!r} ({type(value).__name__})"
            raise ValueError(f"{source}: {key} must be {_expected(hints[key])}, got {shown}")
