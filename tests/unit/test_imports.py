"""The package's import graph has no cycle (every import counted, also those inside functions), and the modules
that check a recipe before any process starts do not import torch."""

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


def test_finds_a_cycle_when_there_is_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_recipe_and_path_checks_do_not_import_torch():
    code = ("import sys, llmtune.cli, llmtune.config, llmtune.inputs, llmtune.data.files; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr
