"""A long-lived worker remembers the ``ref`` functions it resolved (``fn_gates._RESOLVED``), and
what it remembers is never served stale: a reloaded or re-imported module, a rebound attribute,
a swapped ``__code__`` and another runtime policy each go through the gates again; a pickle is
never remembered (refused on every call without ``allow_pickled``)."""

from __future__ import annotations

import hashlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import dreamlake.lakeshore as dls
from dreamlake.lakeshore import fn_gates, fn_record
from dreamlake.lakeshore.dispatch import Dispatch
from dreamlake.lakeshore.envelope import fn_for, resolve_fn
from dreamlake.lakeshore.errors import DispatchError, PickleRefused, StaleSource
from tests import fixtures_fns as ff

V1 = "def f(x):\n    return x + 1\n"
V2 = "def f(x):\n    return x + 2  # edited\n"


def _hash(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


@pytest.fixture(autouse=True)
def _forgotten() -> Iterator[None]:
    fn_gates._RESOLVED.clear()
    fn_record._MATCHED.clear()
    yield
    fn_gates._RESOLVED.clear()
    fn_record._MATCHED.clear()


@pytest.fixture
def edited(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """A module ``name`` of its own in ``tmp_path`` (V1), importable and forgotten after."""
    name = f"cache_fns_{tmp_path.name.replace('-', '_')}"
    path = tmp_path / f"{name}.py"
    path.write_text(V1)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield name, path
    sys.modules.pop(name, None)


def _record(name: str, text: str) -> dict[str, Any]:
    return {"kind": "ref", "module": name, "qualname": "f", "src_hash": _hash(text)}


def test_a_resolved_ref_is_remembered_and_not_imported_or_hashed_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    record = fn_for(ff.add)
    fn = resolve_fn(record, allow_pickled=False)
    assert fn is ff.add
    imported: list[str] = []
    monkeypatch.setattr(importlib, "import_module", lambda name: imported.append(name))
    monkeypatch.setattr(fn_record, "_local_src_hash", lambda *a: pytest.fail("hashed again"))
    for _ in range(3):
        assert resolve_fn(dict(record), allow_pickled=False) is ff.add
    assert imported == []


def test_a_reloaded_module_is_not_served_stale(edited: tuple[str, Path]) -> None:
    name, path = edited
    assert resolve_fn(_record(name, V1), allow_pickled=False)(1) == 2
    path.write_text(V2)
    importlib.reload(sys.modules[name])  # the same module object, f rebound to the edited code
    with pytest.raises(StaleSource):  # the submitter's old code is not what the worker has now
        resolve_fn(_record(name, V1), allow_pickled=False)
    assert resolve_fn(_record(name, V2), allow_pickled=False)(1) == 3


def test_a_module_imported_again_is_resolved_from_the_new_module(edited: tuple[str, Path]) -> None:
    name, path = edited
    first = resolve_fn(_record(name, V1), allow_pickled=False)
    del sys.modules[name]
    path.write_text(V2)
    importlib.invalidate_caches()
    fresh = resolve_fn(_record(name, V2), allow_pickled=False)
    assert fresh is not first and fresh(1) == 3
    with pytest.raises(StaleSource):
        resolve_fn(_record(name, V1), allow_pickled=False)


def test_a_function_whose_code_was_swapped_is_checked_again(edited: tuple[str, Path]) -> None:
    """A hot reload that patches ``__code__`` in place keeps the function object: the remembered
    resolution notices the new code and the source gate runs again."""
    name, path = edited
    fn = resolve_fn(_record(name, V1), allow_pickled=False)
    path.write_text(V2)
    namespace: dict[str, Any] = {}
    exec(compile(V2, str(path), "exec"), namespace)
    fn.__code__ = namespace["f"].__code__
    with pytest.raises(StaleSource):
        resolve_fn(_record(name, V1), allow_pickled=False)


def test_the_runtime_policy_is_part_of_what_is_remembered() -> None:
    stale = {**fn_for(ff.add), "src_hash": "sha256:" + "0" * 16}
    assert resolve_fn(stale, allow_pickled=False, runtime_policy="off") is ff.add  # no source check
    for _ in range(2):
        with pytest.raises(StaleSource):
            resolve_fn(stale, allow_pickled=False, runtime_policy="minor")


def test_an_unknown_policy_and_a_malformed_record_are_refused_after_a_hit() -> None:
    record = fn_for(ff.add)
    resolve_fn(record, allow_pickled=False)
    with pytest.raises(ValueError, match="'strict', 'minor' or 'off'"):
        resolve_fn(record, allow_pickled=False, runtime_policy="lax")
    with pytest.raises(Exception, match="must be str"):
        resolve_fn({**record, "module": ["tests", "fixtures_fns"]}, allow_pickled=False)


def test_a_refused_pickle_is_refused_on_every_call() -> None:
    record = fn_for(lambda: 1, transport="pickle")
    assert resolve_fn(record, allow_pickled=True)() == 1
    for _ in range(2):
        with pytest.raises(PickleRefused):
            resolve_fn(record, allow_pickled=False)
    assert fn_gates._RESOLVED == {}


def test_a_long_lived_worker_refuses_every_pickle_and_runs_each_ref() -> None:
    plane = Dispatch(":memory:")
    q = dls.SyncQueue("jobs", dispatch=plane)
    pickled = [dls.udf(queue="jobs")(lambda: 1).submit(_dispatch=plane) for _ in range(2)]
    byref = [dls.udf(queue="jobs")(ff.add).submit(i, 1, _dispatch=plane) for i in range(2)]
    for _ in range(4):
        assert dls.run_worker(q, once=True, allow_pickled=False, poll_timeout=5.0) in ("failed", "succeeded")
    for inv in pickled:
        with pytest.raises(DispatchError, match="PickleRefused"):
            q.result(inv, timeout=5.0)
    assert [q.result(inv, timeout=5.0) for inv in byref] == [1, 2]
