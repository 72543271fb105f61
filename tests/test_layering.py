"""The package's import graph: no cycle between its modules, and no module importing from a layer above it.

Every ``import gradcache_sparton...`` / ``from gradcache_sparton... import ...`` counts, at module level or
inside a function (a lazy import is still a dependency). Imports are read from the source with ``ast``;
nothing is imported. The layers, lowest first, are the picture of the house that docs and reviews rely on:
a new import that climbs a layer, or a new cycle, fails here and must be resolved by moving code, not by
moving the line below.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gradcache_sparton"

# Each top-level module or sub-package of gradcache_sparton in its layer, lowest first. A component may
# import from its own layer's others only where this says so (none do today), and from any lower layer.
LAYERS: list[set[str]] = [
    {"version", "resources", "primitives", "run_state"},  # no package imports
    {"kernels", "losses", "data", "engine"},  # the kernels, the losses, the data and the GradCache engine
    {"modeling", "evaluation", "arguments"},  # the encoder, retrieval evaluation, the argument dataclasses
    {"integrations", "model_loading", "run_checks"},  # sentence-transformers; building a model; run checks
    {"trainer", "mining"},  # the Trainer; hard-negative mining
    {"pipeline"},  # the training / evaluation / export jobs
    {"crossval"},  # k-fold cross-validation of a training recipe (runs the training job per fold)
    {"cli", "__init__"},  # the command line and the public API
]


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package's ``__init__`` as the package)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from a.b import c`` counts as ``a.b.c`` if that is a
    module, else as ``a.b``)."""

    def resolve(name: str) -> str | None:
        parts = name.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        return ".".join(parts) or None

    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and (node.module or "").startswith("gradcache_sparton")
            ):
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                target = resolve(name) if name.startswith("gradcache_sparton") else None
                if target is not None and target != module:
                    graph[module].add(target)
    return graph


def _component(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_no_import_cycle_between_modules() -> None:
    """No module of the package reaches itself through its imports (each cycle is named)."""
    graph = _imports(_modules())
    cycles, state = [], {}  # state: 1 on the current path, 2 finished

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(_modules()):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_module_imports_from_a_layer_above() -> None:
    """Every component is in one layer, and its imports reach only lower layers (or itself)."""
    layer_of = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    modules = _modules()
    unplaced = sorted({_component(m) for m in modules} - set(layer_of))
    assert not unplaced, f"components with no layer in LAYERS: {unplaced}"
    climbing = [
        f"{module} ({_component(module)}, layer {layer_of[_component(module)]}) imports {target} "
        f"({_component(target)}, layer {layer_of[_component(target)]})"
        for module, targets in sorted(_imports(modules).items())
        for target in sorted(targets)
        if _component(target) != _component(module)
        and layer_of[_component(target)] >= layer_of[_component(module)]
    ]
    assert not climbing, "imports that do not go down a layer:\n" + "\n".join(climbing)
