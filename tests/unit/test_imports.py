"""The package is read in layers, from the recipe up to the process: a module imports from its own layer or those
below it, never from one above (every import counted, also those inside functions); the import graph has no cycle;
and the modules that check a recipe before any process starts do not import torch."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "llmtune"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the llmtune modules it imports (`from a.b import c` names a.b.c when c is a module)."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets.update(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules
                               else node.module for alias in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


# The layers, lowest first, each named by the modules and packages it holds. A layer builds on those below it alone:
# features build on the model, the trainer drives the model, data, checkpoints and monitor it is handed, run/ wires
# them all. A module of no layer fails the test, so a new one is placed on purpose.
LAYERS = [
    ("recipe", ["llmtune.errors", "llmtune.atomic", "llmtune.command", "llmtune.cpus", "llmtune.user_code", "llmtune.config", "llmtune.hub", "llmtune.llamafactory",
                "llmtune.tasks.registry"]),
    ("model", ["llmtune.model"]),
    ("features", ["llmtune.features"]),
    ("data", ["llmtune.data"]),
    ("checkpoint", ["llmtune.checkpoint"]),
    ("monitor", ["llmtune.monitor"]),
    ("generation", ["llmtune.generation"]),
    ("tasks", ["llmtune.tasks"]),
    ("training", ["llmtune.training"]),
    ("run", ["llmtune.run", "llmtune.demo", "llmtune.__main__", "llmtune"]),
]


def layer_of(module: str) -> int:
    """The index in LAYERS of the layer that holds `module` (its longest matching name; "llmtune" alone is the
    package's __init__)."""
    matches = [(len(name), index) for index, (_, names) in enumerate(LAYERS) for name in names
               if module == name or (name != "llmtune" and module.startswith(name + "."))]
    assert matches, f"{module} is in no layer: add it to LAYERS in {Path(__file__).name}"
    return max(matches)[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module from a higher layer, as 'importer (layer) imports target (layer)'."""
    return [f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
            for module in sorted(graph) for target in sorted(graph[module]) if layer_of(target) > layer_of(module)]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}

    def visit(node, trail):
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return trail[trail.index(target):] + [target]
            if target not in state and (cycle := visit(target, trail + [target])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_no_import_cycles():
    graph = import_graph()
    assert "llmtune.features.ulysses" in graph["llmtune.features.registry"], "the graph sees imports"
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_no_module_imports_from_a_higher_layer():
    graph = import_graph()
    assert "llmtune.model.build" in graph["llmtune.features.adapters"], "the graph sees imports across layers"
    upward = upward_imports(graph)
    assert not upward, "\n".join(upward)


def test_finds_an_upward_import_when_there_is_one():
    planted = {"llmtune.model.build": {"llmtune.model.loss", "llmtune.run.cli"}, "llmtune.run.cli": {"llmtune.config"},
               "llmtune.model.loss": set(), "llmtune.config": set()}
    assert upward_imports(planted) == ["llmtune.model.build (model) imports llmtune.run.cli (run)"]
    assert layer_of("llmtune") == layer_of("llmtune.run.worker") > layer_of("llmtune.config")


def test_finds_a_cycle_when_there_is_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_recipe_and_path_checks_do_not_import_torch():
    code = ("import sys, llmtune.run.cli, llmtune.config, llmtune.run.inputs, llmtune.data.files; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr


def test_test_modules_have_names_of_their_own():
    """tests/ has no __init__.py per folder: pytest imports test modules by their basename, and two with one name in
    two folders stop the whole suite at collection."""
    names = [path.name for path in (PACKAGE.parent / "tests").rglob("test_*.py")]
    assert sorted({name for name in names if names.count(name) > 1}) == []
