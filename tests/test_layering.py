"""The package's import structure: models < config < generate < data < train/eval < bench/demo < cli, no cycles.

Every ``import`` of a ``dflash_train`` module counts, wherever it stands: lazy ones inside
functions (a lazy import only hides a cycle until the function runs) and type-only ones under
``if TYPE_CHECKING:`` (they never run, but the modules still depend on each other: a reader, a
type checker and any later runtime use see the circle). Relative imports count as what they name.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_train"
# Layer of each top-level part; a module may import its own layer or lower ones only.
LAYERS = {
    "dflash_train": 0,
    "models": 0,
    "config": 1,
    "config_parsing": 1,  # the recipe mapping -> dataclasses, beside config
    "hashing": 0,
    "tiny": 2,  # tiny tokenizer and targets in code, built on models.presets
    "generate": 2,  # the target's batched generation, used by data (synth, regen) and eval
    "data": 3,
    "train": 4,
    "eval": 4,
    "bench": 5,
    "demo": 5,
    "cli": 6,
}


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the dflash_train modules it imports (``from pkg import module`` names the module)."""
    names = module_names()
    graph = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported = imported_names(ast.parse(path.read_text(), str(path)), package)
        # A package's own __init__ is not an edge: importing pkg.mod always runs it.
        graph[name] = {m for m in imported if m in names and m != name and not name.startswith(m + ".")}
        graph[name] -= {"dflash_train"}
    return graph


def imported_names(tree: ast.AST, package: str) -> set[str]:
    """Every dotted name ``tree`` imports, anywhere in it (``from a import b`` gives a and a.b; a
    relative import is resolved against ``package``, the importing module's package)."""
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            imported.add(module)
            imported |= {f"{module}.{alias.name}" for alias in node.names}
    return imported


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1] if len(parts) > 1 else parts[0]]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_type_only_function_level_and_relative_imports_count():
    """The graph sees every kind of import (else a circle hides behind one)."""
    source = """
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from dflash_train.config import RunConfig
def build():
    import dflash_train.train.step
    from dflash_train.models import presets
    from . import readers
    from ..eval.verdict import verdict
"""
    assert imported_names(ast.parse(source), "dflash_train.data") >= {
        "dflash_train.config",
        "dflash_train.train.step",
        "dflash_train.models.presets",
        "dflash_train.data.readers",
        "dflash_train.eval.verdict",
    }


def test_every_top_level_part_has_a_layer():
    parts = {name.split(".")[1] for name in module_names() if "." in name}
    assert parts <= set(LAYERS), parts - set(LAYERS)


def test_no_module_imports_a_higher_layer_or_the_cli():
    graph = import_graph()
    upward = sorted(
        f"{module} -> {dep}" for module, deps in graph.items() for dep in deps if layer(dep) > layer(module)
    )
    assert not upward, "imports against the layering:\n" + "\n".join(upward)
    assert not [m for m, deps in graph.items() if "dflash_train.cli" in deps]


def test_no_import_cycles():
    assert find_cycle(import_graph()) is None


def test_only_the_step_library_runs_the_target_forward():
    """Colocated and split run the target through ``train.step.target_features`` (same mask policy)."""
    callers = []
    for path in (PACKAGE / "train").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "features":
                callers.append(path.name)
    assert set(callers) == {"step.py"}, callers
