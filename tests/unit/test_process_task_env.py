"""The process runner's task environment: the documented host base (PATH, HOME, LANG, TZ, ...:
nymph.taskenv), never nymph's whole environment, decoded once, yet every change of nymph's base
reaches the next task."""

from __future__ import annotations

from pathlib import Path

import pytest

from nymph.runner import Task
from nymph_process import ProcessRunner


def _task(tmp_path: Path, **env: str) -> Task:
    return Task(invocation_id="01J0000000000000000000000A", attempt=1, workdir=tmp_path, env=dict(env))


def test_a_task_sees_the_host_base_as_it_is_now_and_nothing_else_of_nymphs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = ProcessRunner(prefork=False)
    try:
        monkeypatch.setenv("TZ", "UTC")
        monkeypatch.setenv("NYMPH_TEST_SECRET", "nymph's own")
        monkeypatch.setenv("MYSECRET_X", "a variable set for nymph")  # the leak of issue 33
        first = runner._task_env(_task(tmp_path, LAKESHORE_INVOCATION_ID="x"))
        assert first["TZ"] == "UTC" and first["LAKESHORE_INVOCATION_ID"] == "x"
        assert "NYMPH_TEST_SECRET" not in first and "MYSECRET_X" not in first
        first["TZ"] = "changed by a caller"  # a task's copy is its own
        assert runner._task_env(_task(tmp_path))["TZ"] == "UTC"
        monkeypatch.setenv("TZ", "Europe/Paris")  # nymph's environment changed: seen at once
        monkeypatch.delenv("HOME", raising=False)
        again = runner._task_env(_task(tmp_path))
        assert again["TZ"] == "Europe/Paris" and "HOME" not in again
        assert "LAKESHORE_INVOCATION_ID" not in again  # nothing of the last task's
    finally:
        runner.close()


def test_the_zygote_key_is_the_task_environments_less_its_per_task_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nymph_process import _interpreter_key

    runner = ProcessRunner(prefork=False)
    try:
        tasks = [
            _task(tmp_path, LAKESHORE_INVOCATION_ID="x", CUDA_VISIBLE_DEVICES="0"),
            _task(tmp_path, LAKESHORE_INVOCATION_ID="y", CUDA_VISIBLE_DEVICES="1"),  # the same interpreter
            _task(tmp_path, LAKESHORE_INVOCATION_ID="z", SOME_SETTING="on"),  # another one
        ]
        keys = [_interpreter_key(runner._task_env(t)) for t in tasks]
        assert keys[0] == keys[1] != keys[2]
        monkeypatch.setenv("LANG", "C.UTF-8-test")  # nymph's base changed: so does every key
        assert _interpreter_key(runner._task_env(tasks[0])) != keys[0]
    finally:
        runner.close()
