"""The slurm runner's job identity and the decision before a submission (:mod:`nymph_slurm.jobs`).

The attempt is in the job's name, and a start decides from what squeue knows under the
invocation's names alone (no memory of a lost sbatch answer), so a restarted nymph decides the same
way; an earlier attempt's job in the same workdir is never adopted. Against a real cluster:
``tests/integration/test_runner_slurm.py``.
"""

from __future__ import annotations

from pathlib import Path

from nymph.runner import Task
from nymph.runnerkit import task_name
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
