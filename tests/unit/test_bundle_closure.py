"""Every project module a bundled module imports at load time is in the bundle too.

A module missing from the bundle only shows inside a bare image (``ModuleNotFoundError`` in the
task), so the closure is checked here from the source, with :mod:`ast`.
"""

from __future__ import annotations

import ast
from pathlib import Path

from dreamlake.lakeshore.daemon.bundle import BUNDLED_FILES

ROOT = Path(__file__).resolve().parents[2]


def _top_level_project_imports(path: Path) -> set[str]:
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    if path.name == "__init__.py":
        module = package
    found: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package
                for _ in range(node.level - 1):
                    parent = parent.rpartition(".")[0]
                base = f"{parent}.{base}" if base else parent
            found.update(f"{base}.{a.name}" for a in node.names)
            found.add(base)
    return {name for name in found if name.startswith("dreamlake.")}


def _file_of(module: str) -> str | None:
    path = ROOT / Path(*module.split("."))
    if (path / "__init__.py").is_file():
        return str((path / "__init__.py").relative_to(ROOT))
    if path.with_suffix(".py").is_file():
        return str(path.with_suffix(".py").relative_to(ROOT))
    return None  # a name imported from a module, not a module


def test_the_bundle_holds_what_its_modules_import_at_load() -> None:
    bundled = {f for f in BUNDLED_FILES if f.startswith("dreamlake/")}
    missing = {
        (src, target)
        for src in sorted(bundled)
        for name in _top_level_project_imports(ROOT / src)
        if (target := _file_of(name)) is not None and target not in bundled
    }
    assert missing == set(), f"bundled modules import modules the bundle lacks: {sorted(missing)}"


def test_the_bundle_lists_each_file_once() -> None:
    # a file named twice (a merge that added it on both sides) is one more zip entry to dedupe
    twice = sorted({f for f in BUNDLED_FILES if BUNDLED_FILES.count(f) > 1})
    assert twice == [], f"listed more than once in bundle.py: {twice}"
