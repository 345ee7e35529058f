"""A user's file type-checks against the SDK: ``dls.udf``, ``dls.SyncQueue`` and the handles resolve
to their real types through the lazy exports (``TYPE_CHECKING`` imports, ``py.typed``), not Any."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

USER = """
import dreamlake.lakeshore as dls


@dls.udf(queue="gpu")
def topk(xs: list[int], k: int) -> list[int]:
    return sorted(xs)[-k:]


inv = topk.submit([3, 1, 2], 2)
reveal_type(topk)
reveal_type(inv)
reveal_type(inv.result())
reveal_type(dls.SyncQueue("gpu"))
reveal_type(topk.map([[1]], [1]))
reveal_type(dls.wait([inv]).done)
reveal_type(dls.as_completed([inv]))
reveal_type(dls.Dispatch(":memory:"))
inv.no_such_method()
"""


def test_the_lazy_exports_resolve_to_their_real_types(tmp_path: Path) -> None:
    assert (ROOT / "dreamlake" / "lakeshore" / "py.typed").is_file()
    (tmp_path / "user.py").write_text(USER)
    env = {**os.environ, "MYPYPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--ignore-missing-imports", "user.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    revealed = [t.replace("builtins.", "") for t in re.findall(r'Revealed type is "(.*)"', out.stdout)]
    assert revealed == [
        "dreamlake.lakeshore.decorator.UDF",
        "dreamlake.lakeshore.handles.Invocation",
        "Any",  # a udf's value: the SDK does not track the body's return type
        "dreamlake.lakeshore.queue.SyncQueue",
        "dreamlake.lakeshore.calls.Calls",
        "set[dreamlake.lakeshore.handles.Invocation]",
        "typing.Iterator[dreamlake.lakeshore.handles.Invocation]",
        "dreamlake.lakeshore.dispatch.local.Dispatch",
    ], out.stdout
    assert '"Invocation" has no attribute "no_such_method"' in out.stdout  # typed, not Any
