"""The package's shape: imports flow one way, and the planning core runs without TensorFlow.

Rooms, from the top: the command line; the user API (fit, plan_model, compare,
max_batch_size, the callback, measure, plots, named applications); extraction and the
compiled step, side by side; the TensorFlow runtime helpers they share; the TensorFlow-free
core. A module may import its own room or a room below it, never above; inside the core,
``plan`` does not import ``ilp``, and neither imports the catalogue (``tfremat.strategies``)
or what is built on it. Imports inside functions count as much as those at the top.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import networkx as nx
import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tfremat"

# Rooms by rank, lowest first; a module's room is the first whose prefix it matches.
CORE_ORDER = (
    ("tfremat.errors", "tfremat.units", "tfremat.numerics"),
    ("tfremat.graph",),
    ("tfremat.budget",),
    ("tfremat.plan",),
    ("tfremat.ilp",),
    ("tfremat.strategies",),
    ("tfremat.maxbatch", "tfremat.cache"),
    ("tfremat.planner",),
)
ROOMS = (
    ("core", tuple(prefix for level in CORE_ORDER for prefix in level)),
    ("runtime", ("tfremat.runtime",)),
    ("extract", ("tfremat.extract",)),
    ("static_graph", ("tfremat.static_graph",)),
    ("user", ("tfremat.model_planning", "tfremat.api", "tfremat.keras", "tfremat.measure", "tfremat.plots",
              "tfremat.applications", "tfremat.custom_loops", "tfremat.multi_worker", "tfremat.allocator_check",
              "tfremat.maxbatch_keras")),
    ("cli", ("tfremat.cli", "tfremat.__main__")),
)
RANK = {"core": 0, "runtime": 1, "extract": 2, "static_graph": 2, "user": 3, "cli": 4}


def _matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def room_of(module: str) -> str:
    for room, prefixes in ROOMS:
        if any(_matches(module, p) for p in prefixes):
            return room
    raise AssertionError(f"module {module} belongs to no room; add it to tests/test_architecture.py")


def core_level(module: str) -> int:
    for level, prefixes in enumerate(CORE_ORDER):
        if any(_matches(module, p) for p in prefixes):
            return level
    raise AssertionError(f"{module} is not in the core")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> nx.DiGraph:
    """Module -> the package modules it imports (``from a import b`` counts as importing
    ``a.b`` when that is a module), anywhere in its source."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                if target in modules and target != name:
                    graph.add_edge(name, target)
    return graph


def test_every_module_has_a_room():
    for module in import_graph():
        if module != "tfremat":
            room_of(module)


def test_no_import_cycles():
    graph = import_graph()
    graph.remove_node("tfremat")  # the package root re-exports lazily; nothing imports it back
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not cycles, f"import cycles: {cycles}"


def test_imports_flow_down():
    wrong = []
    for module, target in import_graph().edges:
        if module == "tfremat":
            continue
        source, dest = room_of(module), room_of(target)
        if RANK[dest] > RANK[source]:
            wrong.append(f"{module} ({source}) imports {target} ({dest})")
        elif source == dest == "core" and core_level(target) > core_level(module):
            wrong.append(f"{module} imports {target}, above it in the core")
        elif {source, dest} == {"extract", "static_graph"}:
            wrong.append(f"{module} imports {target}: extraction and the compiled step are side by side")
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_a_violation():
    """The rules above fail on the shapes they forbid (so a passing run means something)."""
    assert RANK[room_of("tfremat.extract.analysis")] > RANK[room_of("tfremat.runtime.memory")]
    assert core_level("tfremat.plan.registry") < core_level("tfremat.ilp.portfolio") < core_level("tfremat.strategies")
    cyclic = nx.DiGraph([("a", "b"), ("b", "a")])
    assert any(len(c) > 1 for c in nx.strongly_connected_components(cyclic))


@pytest.mark.parametrize("module", ["tfremat", "tfremat.strategies", "tfremat.maxbatch", "tfremat.cache",
                                    "tfremat.planner", "tfremat.plots", "tfremat.ilp", "tfremat.plan"])
def test_core_imports_with_tensorflow_blocked(module):
    code = (
        "import sys\n"
        "sys.modules['tensorflow'] = None\nsys.modules['keras'] = None\n"
        f"import {module}\n"
        "from tfremat.strategies import get_strategy\n"
        "assert 'tensorflow' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert run.returncode == 0, run.stderr
