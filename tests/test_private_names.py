"""Private names stay inside their module: the package's modules share code through named, public
interfaces (in their ``__all__``), and the few private names that still cross say why where imported."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gradcache_sparton"

# Each crossing left, with its reason in a comment at the import (crossval/protocol.py,
# crossval/merge.py). A new one is a seam to name: make the name public in its module's __all__.
MAX_CROSSINGS = 8


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _crossings() -> set[tuple[str, str, str]]:
    """(importing module, defining module, name) for every ``from gradcache_sparton.x import _name`` and
    every ``x._name`` attribute read through an imported package module, across two modules."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    found = set()
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradcache_sparton"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if full in modules:
                        aliases[alias.asname or alias.name] = full
                    elif _private(alias.name) and node.module != module:
                        found.add((module, node.module, alias.name))
            elif isinstance(node, ast.Import):
                aliases.update({a.asname or a.name: a.name for a in node.names if a.name in modules})
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name):
                target = aliases.get(node.value.id)
                if target is not None and target != module:
                    found.add((module, target, node.attr))
    return found


def test_private_names_do_not_cross_modules() -> None:
    """At most MAX_CROSSINGS private names are used outside the module that defines them (each listed)."""
    crossings = sorted(_crossings())
    listed = "\n".join(f"{m} uses {source}.{name}" for m, source, name in crossings)
    assert len(crossings) <= MAX_CROSSINGS, f"{len(crossings)} private names cross modules:\n{listed}"


def test_benchmarks_import_no_private_package_name() -> None:
    """No benchmark imports a private name of the package: what a benchmark times is public API."""
    found = []
    for path in sorted((PACKAGE.parent / "benchmarks").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradcache_sparton"):
                found += [f"{path.name}: {node.module}.{a.name}" for a in node.names if _private(a.name)]
    assert not found, "benchmarks import private names:\n" + "\n".join(found)
