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


def test_the_zygote_key_is_the_task_environments_less_its_per_task_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nymph_process import _interpreter_key

    runner = ProcessRunner(prefork=False)
    try:
        monkeypatch.setenv("LAKESHORE_TEST_KEYED", "a")
        tasks = [
            _task(tmp_path, LAKESHORE_INVOCATION_ID="x", CUDA_VISIBLE_DEVICES="0"),
            _task(tmp_path, LAKESHORE_INVOCATION_ID="y", CUDA_VISIBLE_DEVICES="1"),  # the same interpreter
            _task(tmp_path, LAKESHORE_INVOCATION_ID="z", SOME_SETTING="on"),  # another one
        ]
        keys = [_interpreter_key(runner._task_env(t)) for t in tasks]
        assert keys[0] == keys[1] != keys[2]
        monkeypatch.setenv("OTHER_SETTING", "1")  # nymph's environment changed: so does every key
        assert _interpreter_key(runner._task_env(tasks[0])) != keys[0]
    finally:
        runner.close()
