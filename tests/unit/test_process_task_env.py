"""The process runner's task environment: nymph's own (less NYMPH_ settings), decoded once, yet
every change of nymph's environment reaches the next task."""

from __future__ import annotations

from pathlib import Path

import pytest

from nymph.runner import Task
from nymph_process import ProcessRunner


def _task(tmp_path: Path, **env: str) -> Task:
    return Task(invocation_id="01J0000000000000000000000A", attempt=1, workdir=tmp_path, env=dict(env))


def test_a_task_sees_nymphs_environment_as_it_is_now(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = ProcessRunner(prefork=False)
    try:
        monkeypatch.setenv("LAKESHORE_TEST_SEEN", "one")
        monkeypatch.setenv("NYMPH_TEST_SECRET", "nymph's own")
        first = runner._task_env(_task(tmp_path, LAKESHORE_INVOCATION_ID="x"))
        assert first["LAKESHORE_TEST_SEEN"] == "one" and first["LAKESHORE_INVOCATION_ID"] == "x"
        assert "NYMPH_TEST_SECRET" not in first
        first["LAKESHORE_TEST_SEEN"] = "changed by a caller"  # a task's copy is its own
        assert runner._task_env(_task(tmp_path))["LAKESHORE_TEST_SEEN"] == "one"
        monkeypatch.setenv("LAKESHORE_TEST_SEEN", "two")  # nymph's environment changed: seen at once
        monkeypatch.delenv("HOME", raising=False)
        again = runner._task_env(_task(tmp_path))
        assert again["LAKESHORE_TEST_SEEN"] == "two" and "HOME" not in again
        assert "LAKESHORE_INVOCATION_ID" not in again  # nothing of the last task's
    finally:
        runner.close()
