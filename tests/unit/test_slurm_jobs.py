"""The slurm runner's job identity and the decision before a submission (:mod:`nymph_slurm.jobs`).

The attempt is in the job's name, and a start decides from what squeue knows under the
invocation's names alone (no memory of a lost sbatch answer), so a restarted nymph decides the same
way; an earlier attempt's job in the same workdir is never adopted. Against a real cluster:
``tests/integration/test_runner_slurm.py``.
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from nymph.runner import RunnerUnavailable, Task
from nymph.runnerkit import task_name
from nymph_slurm import SlurmRunner
from nymph_slurm.jobs import (
    QUEUE_FORMAT,
    QueuedJob,
    StartPlan,
    job_name,
    lookup_names,
    parse_queue,
    plan_start,
)

INV = "01HZZZZZZZZZZZZZZZZZZZZZZZ"
WD = "/w/01HZZZZZZZZZZZZZZZZZZZZZZZ"


def _job(job_id: str, name: str, state: str = "RUNNING", workdir: str = WD) -> QueuedJob:
    return QueuedJob(job_id, name, state, workdir)


def test_the_attempt_is_in_the_job_name_as_the_other_runners_name_their_tasks() -> None:
    assert job_name(INV, 2) == "nymph-01hzzzzzzzzzzzzzzzzzzzzzzz-a2"
    assert job_name(INV, 2) == task_name(Task(INV, 2, Path(WD), {}))  # one naming rule
    assert job_name(INV, 1) != job_name(INV, 2)
    # this attempt's first, then the earlier ones, then the older nymphs' name (no attempt in it)
    assert lookup_names(INV, 3) == [job_name(INV, 3), job_name(INV, 2), job_name(INV, 1), f"nymph-{INV}"]
    assert lookup_names(INV, 1) == [job_name(INV, 1), f"nymph-{INV}"]


def test_parse_queue_reads_squeue_lines_and_keeps_a_workdir_with_the_separator() -> None:
    assert QUEUE_FORMAT == "%i|%j|%T|%Z"
    text = f"12|{job_name(INV, 1)}|PENDING|{WD}\n\n13|n|COMPLETED|/a|b\nsqueue: noise\n"
    assert parse_queue(text) == [
        _job("12", job_name(INV, 1), "PENDING"),
        _job("13", "n", "COMPLETED", "/a|b"),
    ]
    assert _job("1", "n", "COMPLETING").active and not _job("1", "n", "CANCELLED+").active


def test_a_start_adopts_its_own_attempts_job_in_any_state_and_nothing_else() -> None:
    mine = job_name(INV, 2)
    # no memory of a lost answer needed: the name finds it (a restarted nymph's start too)
    assert plan_start([_job("7", mine, "PENDING")], INV, 2, WD, set()) == StartPlan("7", ())
    assert plan_start([_job("7", mine, "COMPLETED")], INV, 2, WD, set()) == StartPlan("7", ())
    assert plan_start([], INV, 2, WD, set()) == StartPlan(None, ())
    # another workdir (the same invocation under another nymph's root), or destroyed here: not ours
    assert plan_start([_job("7", mine, workdir="/other")], INV, 2, WD, set()) == StartPlan(None, ())
    assert plan_start([_job("7", mine)], INV, 2, WD, {"7"}) == StartPlan(None, ())
    # a name squeue should not have answered with: ignored
    assert plan_start([_job("7", "nymph-someone-a2")], INV, 2, WD, set()) == StartPlan(None, ())


def test_an_earlier_attempts_job_is_never_adopted_and_cancelled_while_active() -> None:
    earlier, legacy = job_name(INV, 1), f"nymph-{INV}"
    plan = plan_start([_job("5", earlier), _job("6", legacy, "PENDING")], INV, 2, WD, set())
    assert plan == StartPlan(None, ("5", "6"))  # submitted anew, after these are cancelled
    # finished ones are left alone; an older nymph's job is never taken for this attempt's
    done = [_job("5", earlier, "COMPLETED"), _job("6", legacy, "FAILED")]
    assert plan_start(done, INV, 2, WD, set()) == StartPlan(None, ())
    assert plan_start([_job("6", legacy, "COMPLETED")], INV, 1, WD, set()) == StartPlan(None, ())


def test_of_two_jobs_of_one_attempt_the_first_is_adopted_and_the_other_cancelled() -> None:
    mine = job_name(INV, 1)
    jobs = [_job("21", mine), _job("9", mine, "COMPLETED"), _job("30", mine, "PENDING")]
    assert plan_start(jobs, INV, 1, WD, set()) == StartPlan("9", ("21", "30"))


# --- the look-up's command line (fake Slurm tools that record what they were run with) ------------


def _fake_slurm(tmp_path: Path) -> tuple[SlurmRunner, Path]:
    """A runner whose sbatch answers job 4242 (or, while ``tmp_path/down`` exists, that the
    controller cannot be reached: a lost answer) and whose squeue knows no job; both, and runuser,
    record their command line in ``calls``."""
    calls = tmp_path / "calls"
    down = tmp_path / "down"
    tools = {
        "sbatch": f'echo "sbatch $*" >> {calls}\n'
        f'if [ -e {down} ]; then echo "sbatch: error: Unable to contact slurm controller" >&2; exit 1; fi\n'
        "echo 4242\n",
        "squeue": f'echo "squeue $*" >> {calls}\n',
        "runuser": f'echo "runuser $1 $2" >> {calls}\nshift 3\nexec "$@"\n',
    }
    for tool, body in tools.items():
        (tmp_path / tool).write_text("#!/bin/sh\n" + body)
        (tmp_path / tool).chmod(0o755)
    runner = SlurmRunner(
        sbatch=str(tmp_path / "sbatch"), squeue=str(tmp_path / "squeue"), runuser=str(tmp_path / "runuser")
    )
    return runner, calls


def _calls(calls: Path, tool: str) -> list[list[str]]:
    if not calls.exists():
        return []
    return [line.split()[1:] for line in calls.read_text().splitlines() if line.split()[0] == tool]


def test_the_look_up_is_filtered_by_the_controller_and_skipped_where_nothing_can_be_found(
    tmp_path: Path,
) -> None:
    """``squeue --name`` alone makes squeue load the cluster's whole job table and filter it
    itself: every start did that. The look-up names the submitting user (``--user``, filtered by the
    controller) and every partition (``--all``), and a first attempt's first start does not look at
    all; a start tried again after an sbatch whose answer was lost, or a later attempt's, does,
    whatever the task did to its workdir (which it can write: nothing of it decides this)."""
    runner, calls = _fake_slurm(tmp_path)
    me = pwd.getpwuid(os.geteuid()).pw_name
    workdir = tmp_path / INV
    workdir.mkdir()
    task = Task(INV, 1, workdir, {})
    assert runner.start(task).data["job_id"] == "4242"
    assert _calls(calls, "squeue") == []  # nothing submitted before: nothing to look up
    assert len(_calls(calls, "sbatch")) == 1
    other = Task("01J0000000000000000000000B", 1, tmp_path / "other", {})
    other.workdir.mkdir()
    (tmp_path / "down").touch()
    with pytest.raises(RunnerUnavailable):
        runner.start(other)  # the sbatch went, its answer did not come
    (tmp_path / "down").unlink()
    for leftover in other.workdir.iterdir():  # the task user empties its workdir meanwhile
        leftover.unlink()
    runner.start(other)  # tried again: it looks first
    names = ",".join(lookup_names(other.invocation_id, 1))
    assert _calls(calls, "squeue") == [
        ["--noheader", "--all", "--states=all", f"--user={me}", f"--name={names}", f"--format={QUEUE_FORMAT}"]
    ]
    # a later attempt (an earlier one's job may still run there), submitted with runuser: its user
    calls.unlink()
    later = tmp_path / "later" / INV
    later.mkdir(parents=True)
    runner.start(Task(INV, 2, later, {}, as_user="alice"))
    [squeue] = _calls(calls, "squeue")
    assert (
        "--user=alice" in squeue
        and "--all" in squeue
        and f"--name={','.join(lookup_names(INV, 2))}" in squeue
    )
    assert _calls(calls, "runuser") == [["-u", "alice"]]


def test_a_withdrawal_always_looks_the_job_up(tmp_path: Path) -> None:
    """A withdrawal is rare (a job stopped while its start was tried again, an attempt a restarted
    nymph releases) and its sbatch may have been sent by this nymph before a restart, so it looks
    whether or not this runner sent one, with the workdir there or gone."""
    runner, calls = _fake_slurm(tmp_path)
    workdir = tmp_path / INV
    workdir.mkdir()
    runner.withdraw(Task(INV, 1, workdir, {}))
    runner.withdraw(Task(INV, 1, tmp_path / "gone", {}))
    assert len(_calls(calls, "squeue")) == 2
