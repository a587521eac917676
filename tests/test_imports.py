"""The package's shape: no import cycle among p2ptrain's modules (imports inside functions count too), and the
rooms that must stay light load neither torch nor hivemind."""
from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "p2ptrain"


def import_graph(package: Path) -> nx.DiGraph:
    """Module -> the modules of `package` it imports anywhere in its body; `from pkg import name` points at the
    submodule pkg.name when there is one, else at pkg itself (whose __init__ runs)."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), here)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            graph.add_edges_from((name, target) for target in targets if target in modules and target != name)
    return graph


def test_the_cycle_check_finds_a_cycle_through_an_import_inside_a_function(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("def late():\n    from . import a\n")
    assert [sorted(cycle) for cycle in nx.simple_cycles(import_graph(package))] == [["pkg.a", "pkg.b"]]


def test_no_module_imports_itself_through_others():
    graph = import_graph(PACKAGE)
    assert graph.number_of_edges() > 50, "the graph misses the package's imports"
    cycles = list(nx.simple_cycles(graph))
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join([*c, c[0]]) for c in cycles[:5])


def test_the_cycle_check_sees_imports_inside_functions():
    graph = import_graph(PACKAGE)
    assert graph.has_edge("p2ptrain.peer", "p2ptrain.node.peer")  # main() imports it late, for a fast --help
    assert graph.has_edge("p2ptrain.status", "p2ptrain.dht")


@pytest.mark.parametrize("module", ["p2ptrain.planner", "p2ptrain.protocol.messages", "p2ptrain.config",
                                    "p2ptrain.models", "p2ptrain.plan", "p2ptrain.peer", "p2ptrain.status",
                                    "p2ptrain.launch"])
def test_light_rooms_and_command_lines_load_neither_torch_nor_hivemind(module):
    code = f"import sys, {module}; print(sorted({{'torch', 'hivemind', 'bitsandbytes'}} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"importing {module} loads {result.stdout.strip()}"
