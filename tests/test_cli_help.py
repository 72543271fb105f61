"""The command line's help: every option a command parses is shown, choices listed, the commands and modules
named wherever a map lists them."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import gradcache_sparton
from gradcache_sparton.cli import main
from gradcache_sparton.cli.commands import COMMANDS
from gradcache_sparton.cli.train import train_parser
from gradcache_sparton.cli.train_help import train_fields

PACKAGE_DIR = Path(gradcache_sparton.__file__).parent


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    return capsys.readouterr().out


def _shown_options(text: str) -> set[str]:
    """The flags a help text lists, one per entry (``  --name ...`` at the start of a line)."""
    return {match.group(1) for match in re.finditer(r"^  (?:-h, )?(--[\w-]+)", text, flags=re.MULTILINE)}


def test_train_help_all_shows_exactly_the_options_train_parses(capsys: pytest.CaptureFixture[str]) -> None:
    """`train --help-all` (built apart from the parsing parser) lists every option `train` parses, and
    nothing else: reordering the help never drops or invents an option."""
    parsed = {action.dest for action in train_parser()._actions}  # a bool's --no_NAME sets NAME too
    shown = {flag[2:].replace("-", "_") for flag in _shown_options(_help(["train", "--help-all"], capsys))}
    assert shown == parsed | {"help_all"}, (sorted(parsed - shown), sorted(shown - parsed))


def test_train_help_lists_each_choice_options_choices(capsys: pytest.CaptureFixture[str]) -> None:
    """An option whose values are a fixed set (its field's `choices`) shows them: `--NAME {a,b,c}`."""
    text = _help(["train", "--help-all"], capsys)
    with_choices = {
        name: f.metadata["choices"] for name, f in train_fields().items() if "choices" in f.metadata
    }
    assert {"contrastive", "query_encoder", "config_name", "reg_warmup_shape"} <= set(with_choices)
    for name, choices in with_choices.items():
        assert f"--{name} {{{','.join(map(str, choices))}}}" in text, name


def test_a_bad_choice_is_one_line_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """A flag value outside its choices stops `train` with one line naming the flag and the choices."""
    assert main(["train", "--contrastive", "infonse"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("gradcache-sparton train: error: argument --contrastive: invalid choice"), err
    assert "'infonce'" in err


def test_export_and_top_level_help_name_the_onnx_export(capsys: pytest.CaptureFixture[str]) -> None:
    """`export` writes ONNX models too: its one-line help (top-level and its own) says so."""
    assert "ONNX" in _help(["--help"], capsys)
    assert "ONNX" in _help(["export", "--help"], capsys).split("options:")[0]


def _package_maps() -> list[Path]:
    """Every package whose docstring is a map of its modules (it names one with ``:mod:``)."""
    maps = []
    for init in sorted(PACKAGE_DIR.rglob("__init__.py")):
        docstring = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        if ":mod:" in docstring:
            maps.append(init)
    return maps


@pytest.mark.parametrize("init", _package_maps(), ids=lambda p: str(p.parent.relative_to(PACKAGE_DIR.parent)))
def test_package_map_names_every_module(init: Path) -> None:
    """A package docstring that maps its modules names every one of them (a new module joins the map)."""
    docstring = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
    modules = [p.stem for p in init.parent.glob("*.py") if p.stem != "__init__"]
    modules += [p.name for p in init.parent.iterdir() if (p / "__init__.py").is_file()]
    missing = [m for m in modules if not re.search(rf"\b{re.escape(m)}\b", docstring)]
    assert not missing, missing


def test_cli_docstring_names_every_command() -> None:
    """The cli package's docstring names every command the top-level help lists."""
    docstring = importlib.import_module("gradcache_sparton.cli").__doc__ or ""
    assert [name for name in COMMANDS if f"``{name}``" not in docstring] == []
