"""Imports point one way: no cycle between the project's modules, nor between its packages.

Every ``import`` / ``from ... import`` of the source counts, at module level and inside functions
(a function-level import still ties the two modules together), except those under
``if TYPE_CHECKING:``, which never run. ``passes/`` is installed as ``galvatron_fx.passes``.
A package is a directory of ``galvatron_fx`` (``cost``, ``runtime``, ``solver`` ...) or ``passes``;
the top-level modules of ``galvatron_fx`` are each their own node.
"""

from __future__ import annotations

import ast
import os

import networkx as nx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP = ("galvatron_fx", "passes")


def _modules() -> dict[str, str]:
    out = {}
    for top in TOP:
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _runtime_imports(tree: ast.AST):
    """Import nodes outside ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _targets(module: str, path: str, node, modules: dict[str, str]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
        base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
        stem = ".".join(base + ([node.module] if node.module else []))
        names = [f"{stem}.{a.name}" for a in node.names]
    out = []
    for name in names:
        if name.startswith("galvatron_fx.passes"):
            name = "passes" + name[len("galvatron_fx.passes"):]
        while name and name not in modules:
            name = name.rsplit(".", 1)[0] if "." in name else ""
        if name and name != module:
            out.append(name)
    return out


def import_graph() -> nx.DiGraph:
    modules = _modules()
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for module, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in _runtime_imports(tree):
            for target in _targets(module, path, node, modules):
                g.add_edge(module, target)
    return g


def _package(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "passes":
        return "passes"
    if len(parts) > 2 or (len(parts) == 2 and os.path.isdir(os.path.join(ROOT, *parts))):
        return ".".join(parts[:2])
    return module


def test_no_module_imports_itself_back():
    g = import_graph()
    assert g.number_of_edges() > 300   # the walk saw the project (function-level imports included)
    cycles = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert not cycles, f"import cycles between modules: {cycles}"


def test_no_package_imports_itself_back():
    g = import_graph()
    packages = nx.DiGraph()
    for a, b in g.edges():
        if _package(a) != _package(b):
            packages.add_edge(_package(a), _package(b))
    cycles = [sorted(c) for c in nx.strongly_connected_components(packages) if len(c) > 1]
    assert not cycles, f"import cycles between packages: {cycles}"


def test_the_check_sees_function_level_imports():
    """A cycle made only by an import inside a function is found."""
    g = import_graph()
    assert g.has_edge("galvatron_fx.api", "galvatron_fx.selection")       # inside api.search
    g.add_edge("galvatron_fx.selection", "galvatron_fx.api")
    assert any(len(c) > 1 for c in nx.strongly_connected_components(g))


def test_the_runtime_imports_nothing_above_it():
    """What the generated program calls (``runtime/``) imports neither the search, the cost model,
    the passes nor the entry points: planner -> passes -> runtime, shared modules below."""
    above = ("galvatron_fx.solver", "galvatron_fx.cost", "passes", "galvatron_fx.planner", "galvatron_fx.api",
             "galvatron_fx.selection", "galvatron_fx.parallelize", "galvatron_fx.cli", "galvatron_fx.backend")
    g = import_graph()
    wrong = [(a, b) for a, b in g.edges() if a.startswith("galvatron_fx.runtime") and b.startswith(above)]
    assert not wrong, wrong
