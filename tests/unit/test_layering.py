"""The import graph holds its layers: runners -> nymph -> dreamlake.lakeshore, server -> store, no cycles.

Walks every module's imports with :mod:`ast`, so it sees the code as written, not as a test happens to
load it: the top-level ones, and for the cycle test also the lazy ones (inside functions) and the
type-only ones (``if TYPE_CHECKING:``). A circle of lazy imports still ties its modules into one
(neither can be read, tested or moved without the other), so none is allowed. A module importing
its own package (``from dreamlake.lakeshore import x``) counts as importing the package's
``__init__``; a package's ``__init__`` must not import back the modules that import it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREES = {
    "dreamlake": ROOT / "dreamlake",
    "nymph": ROOT / "nymph",
    **{p.name: p for p in sorted((ROOT / "runners").glob("nymph_*")) if p.is_dir()},
}


def _module_name(path: Path) -> str:
    base = ROOT / "runners" if path.is_relative_to(ROOT / "runners") else ROOT
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for tree in TREES.values():
        for path in tree.rglob("*.py"):
            if "migrations" in path.parts:
                continue
            found[_module_name(path)] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level_imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node):
                yield from _top_level_imports(node.body)
                yield from _top_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _top_level_imports(block)


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    if node.level:
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        yield sub if sub in MODULES else base


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        edges = graph.setdefault(module, set())
        for node in _top_level_imports(tree.body):
            for target in _targets(module, path, node):
                # the deepest project module the import names (``a.b.c`` where only ``a.b`` exists -> ``a.b``)
                while target and target not in MODULES:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    edges.add(target)
    return graph


GRAPH = _graph()


def _layer(module: str) -> str:
    if module.startswith("nymph_"):
        return "runners"
    if module == "nymph" or module.startswith("nymph."):
        return "nymph"
    return "lakeshore"


def _imports_anywhere(path: Path) -> Iterator[str]:
    """Every import in the file, lazy ones included (a layer must not reach up even lazily)."""
    module = _module_name(path)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield from _targets(module, path, node)


def _full_graph() -> dict[str, set[str]]:
    """Every import, lazy (inside a function) and type-only (``if TYPE_CHECKING:``) ones included."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        edges = graph.setdefault(module, set())
        for target in _imports_anywhere(path):
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != module:
                edges.add(target)
    return graph


FULL_GRAPH = _full_graph()


def test_the_graph_sees_the_project() -> None:
    assert {"dreamlake.lakeshore.wire", "nymph.agent", "nymph_process"} <= set(GRAPH)
    assert any(GRAPH.values())


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
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
    return cycles


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _describe(graph: dict[str, set[str]], cycle: list[str]) -> str:
    members = set(cycle)
    return "; ".join(f"{m} -> {', '.join(sorted(graph[m] & members))}" for m in cycle)


def test_no_import_cycles() -> None:
    found = [_describe(GRAPH, c) for c in _cycles(GRAPH)]
    assert found == [], f"import cycles (module-level imports): {found}"


def test_no_import_cycles_lazy_or_type_only_imports_included() -> None:
    """Moving an import into a function or under ``TYPE_CHECKING`` hides a circle; it does not
    break it. Break one by moving the shared piece to a module both import."""
    found = [_describe(FULL_GRAPH, c) for c in _cycles(FULL_GRAPH)]
    assert found == [], f"import cycles (lazy and type-only imports included): {found}"


def test_the_full_graph_sees_lazy_and_type_only_imports() -> None:
    # decorator.py imports handles only inside functions and under TYPE_CHECKING
    assert "dreamlake.lakeshore.handles" not in GRAPH["dreamlake.lakeshore.decorator"]
    assert "dreamlake.lakeshore.handles" in FULL_GRAPH["dreamlake.lakeshore.decorator"]


ORDER = {"lakeshore": 0, "nymph": 1, "runners": 2}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_upward_import(module: str) -> None:
    """runners -> nymph -> dreamlake.lakeshore; never the other way, not even lazily."""
    here = _layer(module)
    upward = sorted(
        t
        for t in _imports_anywhere(MODULES[module])
        if t.split(".")[0] in TREES or t.startswith("dreamlake")
        if ORDER[_layer(t)] > ORDER[here]
    )
    assert upward == [], f"{module} ({here}) imports a higher layer: {upward}"


SERVER_SIDE = ("dreamlake.lakeshore.server",)
CLIENT_SIDE = (
    "dreamlake.lakeshore.blobs",
    "dreamlake.lakeshore.codeship",
    "dreamlake.lakeshore.dispatch.http",
    "dreamlake.lakeshore.protocol",
    "dreamlake.lakeshore.decorator",
    "dreamlake.lakeshore.queue",
    "dreamlake.lakeshore.envelope",
    "dreamlake.lakeshore.wire",
    "dreamlake.lakeshore.daemon",
    "nymph",
)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_server_and_client_sides_stay_apart(module: str) -> None:
    """The store never imports the server; client code (SDK HTTP plane, nymph) imports neither."""
    imports = set(_imports_anywhere(MODULES[module]))
    if module.startswith("dreamlake.lakeshore.store"):
        assert not {t for t in imports if t.startswith(SERVER_SIDE)}, f"{module} imports the server"
    if module.startswith(CLIENT_SIDE) or _layer(module) != "lakeshore":
        banned = (*SERVER_SIDE, "dreamlake.lakeshore.store")
        bad = sorted(t for t in imports if t.startswith(banned))
        assert bad == [], f"{module} is client-side but imports {bad}"
