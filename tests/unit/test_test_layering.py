"""The suite's own layering: one test stack, and no test module leaning on another.

What two test files share lives in ``tests/stack/`` (servers, nymphs, the producer routes,
``free_port``, ``until``) or in a kit module beside them (``*_kit.py``, ``*_fns.py``): a test
module imported by another runs its module-level code twice under two names, drags its fixtures
along, and breaks when its tests move. So no module under ``tests/`` or ``bench/`` imports a
``test_*`` module (absolute, relative or ``from package import test_x``), and the waits and ports
the stack owns are not written again elsewhere.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("tests", "bench")
STACK = ROOT / "tests" / "stack"
# the stack's helpers: a function of one of these names (with or without leading underscores)
# outside tests/stack/ is a copy of it
STACK_NAMES = {"free_port", "until", "until_async", "wait_until", "wait_for"}
# a module that may not import tests.stack, and why
STANDALONE = {
    "bench/control_plane.py": "run as PYTHONPATH=<tree> python bench/control_plane.py against any tree, "
    "older ones included: it imports nothing of the tree it measures",
}


def _modules() -> list[Path]:
    return sorted(p for top in SCANNED for p in (ROOT / top).rglob("*.py") if "user_code" not in p.parts)


def _is_test_module(name: str | None) -> bool:
    return bool(name) and str(name).rsplit(".", 1)[-1].startswith("test_")


def _test_imports(path: Path) -> list[str]:
    """``line: module`` for each import of a ``test_*`` module in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: {a.name}" for a in node.names if _is_test_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if _is_test_module(node.module):
                found.append(f"{node.lineno}: {'.' * node.level}{node.module}")
            else:  # from tests.integration import test_x
                found += [
                    f"{node.lineno}: {node.module}.{a.name}" for a in node.names if _is_test_module(a.name)
                ]
    return found


def _copies(path: Path) -> list[str]:
    """``line: name`` for each function (not a method) named like a stack helper in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    methods = {
        id(f)
        for cls in ast.walk(tree)
        if isinstance(cls, ast.ClassDef)
        for f in cls.body
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    return [
        f"{node.lineno}: {node.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and id(node) not in methods
        and node.name.lstrip("_") in STACK_NAMES
    ]


def test_no_module_of_the_suite_imports_a_test_module() -> None:
    bad = {str(p.relative_to(ROOT)): hits for p in _modules() if (hits := _test_imports(p))}
    assert not bad, f"test modules imported (move the helper into tests/stack/ or a *_kit.py): {bad}"


def test_the_stacks_waits_and_ports_are_written_once() -> None:
    bad = {
        str(p.relative_to(ROOT)): hits
        for p in _modules()
        if STACK not in p.parents and str(p.relative_to(ROOT)) not in STANDALONE and (hits := _copies(p))
    }
    assert not bad, f"copies of tests/stack helpers (import them from tests.stack instead): {bad}"


def test_the_guard_sees_each_kind_of_import_and_copy(tmp_path: Path) -> None:
    """The checks above can fail: each form they look for is found in a sample."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import tests.integration.test_a\n"
        "from tests.integration.test_b import helper\n"
        "from .test_c import Fake\n"
        "from tests.integration import test_d, conftest\n"
        "def _free_port(): ...\n"
        "async def _until(p): ...\n"
        "class Load:\n"
        "    def wait_for(self): ...\n"
    )
    assert [h.split(": ")[1] for h in _test_imports(sample)] == [
        "tests.integration.test_a",
        "tests.integration.test_b",
        ".test_c",
        "tests.integration.test_d",
    ]
    assert _copies(sample) == ["5: _free_port", "6: _until"]
