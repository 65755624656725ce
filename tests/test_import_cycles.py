"""No import circles inside src/conveyor: neither between modules nor between its layers (its
direct subpackages, such as ``core``, ``engine``, ``executor``, ``model``). Two modules, or two
layers, never import each other, directly or through others.

The graph comes from an AST walk, so every import counts: absolute and relative,
``from package import submodule``, imports inside functions and under ``TYPE_CHECKING``.
Importing ``a.b.c`` also runs ``a`` and ``a.b``, so those are edges too, except towards the
importing module's own packages (a module may import its parent package's other modules).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "conveyor"

Graph = dict[str, set[str]]


def module_files(src: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package's ``__init__``)."""
    modules = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _packages_above(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> list[str]:
    here = module if is_package else module.rpartition(".")[0]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = here.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            names.append(base)
            names += [f"{base}.{alias.name}" for alias in node.names]  # submodules among them
    return names


def import_graph(src: Path, package: str) -> Graph:
    """Module -> the modules of ``package`` that importing it runs directly."""
    modules = module_files(src, package)
    graph: Graph = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        own_packages = set(_packages_above(name))
        for imported in _imported_names(ast.parse(path.read_text(), str(path)), name, is_package):
            for target in [*_packages_above(imported), imported]:
                if target in modules and target != name and target not in own_packages:
                    graph[name].add(target)
    return graph


def layer_graph(graph: Graph, package: str) -> Graph:
    """The module graph collapsed onto ``package``'s direct subpackages and modules."""
    prefix = package + "."

    def layer(name: str) -> str | None:
        return prefix + name[len(prefix):].split(".")[0] if name.startswith(prefix) else None

    layers: Graph = {}
    for name, targets in graph.items():
        source = layer(name)
        if source is None:
            continue
        edges = layers.setdefault(source, set())
        for target in targets:
            t = layer(target)
            if t is not None and t != source:
                edges.add(t)
    return layers


def find_cycles(graph: Graph) -> list[list[str]]:
    """Every group of nodes that import each other in a circle (strongly connected components
    of more than one node, Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def _describe(cycles: list[list[str]], graph: Graph) -> str:
    lines = []
    for cycle in cycles:
        members = set(cycle)
        lines.append("circle: " + ", ".join(cycle))
        lines += [f"    {a} -> {b}" for a in cycle for b in sorted(graph[a] & members)]
    return "\n".join(lines)


# ---------------------------------------------------------------------- the real package

def test_no_import_cycles_between_modules():
    graph = import_graph(SRC, PACKAGE)
    assert len(graph) > 50 and graph["conveyor.core.scheduler"], "the walk found no imports"
    cycles = find_cycles(graph)
    assert not cycles, "\n" + _describe(cycles, graph)


def test_no_import_cycles_between_layers():
    layers = layer_graph(import_graph(SRC, PACKAGE), PACKAGE)
    assert {"conveyor.core", "conveyor.engine", "conveyor.sim"} <= set(layers)
    cycles = find_cycles(layers)
    assert not cycles, "\n" + _describe(cycles, layers)


# ---------------------------------------------------------------------- the walk itself

def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_every_import_form_is_an_edge(tmp_path):
    src = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "import pkg.b\n",
        "pkg/b.py": "from . import c\nfrom .sub.d import thing\n",
        "pkg/c.py": "def f():\n    from pkg import e\n",
        "pkg/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..pkg.sub import f\n",
        "pkg/sub/__init__.py": "from .d import thing\n",
        "pkg/sub/d.py": "from .. import a\nimport os\nthing = 1\n",
        "pkg/sub/f.py": "import pkg.sub\n",
    })
    graph = import_graph(src, "pkg")
    assert graph == {
        "pkg": set(),
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.c", "pkg.sub", "pkg.sub.d"},
        "pkg.c": {"pkg.e"},
        "pkg.e": {"pkg.sub", "pkg.sub.f"},
        "pkg.sub": {"pkg.sub.d"},
        "pkg.sub.d": {"pkg.a"},
        "pkg.sub.f": set(),  # its own package: not an edge
    }
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.e", "pkg.sub", "pkg.sub.d"]]


def test_the_circles_this_project_once_had_are_found(tmp_path):
    """A policy typing its scheduler under TYPE_CHECKING; handlers importing the app's state;
    two layers importing each other through different modules."""
    src = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/core/__init__.py": "",
        "pkg/core/scheduler.py": "from pkg.core.policy import schedule\n",
        "pkg/core/policy.py": ("from typing import TYPE_CHECKING\n"
                               "if TYPE_CHECKING:\n    from pkg.core.scheduler import Scheduler\n"),
        "pkg/server/__init__.py": "",
        "pkg/server/app.py": "from pkg.server.chat import create\nclass State: ...\n",
        "pkg/server/chat.py": "def create(state):\n    from pkg.server.app import State\n",
        "pkg/executor/__init__.py": "",
        "pkg/executor/simulated.py": "from pkg.sim.clock import Clock\n",
        "pkg/sim/__init__.py": "",
        "pkg/sim/clock.py": "class Clock: ...\n",
        "pkg/sim/runner.py": "from pkg.executor.simulated import Executor\n",
    })
    graph = import_graph(src, "pkg")
    assert find_cycles(graph) == [["pkg.core.policy", "pkg.core.scheduler"],
                                  ["pkg.server.app", "pkg.server.chat"]]
    assert find_cycles(layer_graph(graph, "pkg")) == [["pkg.executor", "pkg.sim"]]
