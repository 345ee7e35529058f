"""Rooms of one idea (issue 28): no product module over 600 lines unless it says it is one idea.

A product module (under ``dreamlake/``, ``nymph/`` or ``runners/``; tests and bench are not product)
past :data:`MAX_LINES` lines must say ``One idea`` in its module docstring, with the reason: a
module that grew past that size by holding two ideas is split along them instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("dreamlake", "nymph", "runners")
MAX_LINES = 600
MARK = "One idea"


def _product_modules() -> list[Path]:
    return sorted(p for top in PRODUCT for p in (ROOT / top).rglob("*.py") if "migrations" not in p.parts)


def _oversized(paths: list[Path]) -> list[str]:
    """``path (lines)`` of each module over the limit whose docstring does not say it is one idea."""
    out: list[str] = []
    for path in paths:
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        if lines <= MAX_LINES:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if MARK not in doc:
            out.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} ({lines} lines)")
    return out


def test_every_product_module_over_the_limit_is_one_idea() -> None:
    modules = _product_modules()
    assert len(modules) > 50  # the walk found the product (not an empty tree)
    bad = _oversized(modules)
    assert not bad, (
        f"over {MAX_LINES} lines without {MARK!r} in the module docstring (split it along its ideas, "
        f"or say why it is one): {', '.join(bad)}"
    )


def test_the_check_names_a_long_module_without_the_mark(tmp_path: Path) -> None:
    body = "x = 1\n" * (MAX_LINES + 1)
    two = tmp_path / "two.py"
    two.write_text('"""Two ideas in one room."""\n' + body)
    one = tmp_path / "one.py"
    one.write_text(f'"""{MARK}: a reason."""\n' + body)
    short = tmp_path / "short.py"
    short.write_text('"""Short."""\nx = 1\n')
    assert _oversized([two, one, short]) == [f"{two} ({MAX_LINES + 2} lines)"]
