"""Pure decisions of the slurm runner: the batch script, the sbatch options, reading a job record.

Nothing here runs a Slurm command, so every rule is testable without a cluster:

- :func:`batch_script`: the ``/bin/sh`` script written into the workdir: it exports the task's
  environment, refuses to run anywhere but the workdir, and ``exec``\\ s the entry (or
  ``bash -c SCRIPT``) under :mod:`nymph_slurm.reaper`, a child subreaper that keeps every
  descendant (a ``setsid()`` daemon too) inside the job as Slurm tracks it and kills what the
  entry left when it ends; Slurm's signals reach the entry as before;
- :func:`resource_args`: ``run_config.resources`` (read by :mod:`nymph.resources`) as sbatch
  options (``cpus`` -> ``--cpus-per-task``, ``memory`` -> ``--mem``, ``gpus`` -> ``--gres=gpu:N``);
  ``pids`` and ``shm`` are refused (:data:`UNSUPPORTED_RESOURCES`);
- :func:`parse_record`: one line of ``scontrol show job -o`` as a :class:`JobRecord`;
- :func:`job_name`: ``nymph-<invocation id>-a<attempt>``, the job's identity on the cluster, and
  :func:`lookup_names` / :func:`parse_queue` / :func:`plan_start`: what a start does with the jobs
  squeue knows under this invocation's names in its workdir (adopt this attempt's, cancel the rest);
- :func:`exit_status`: a finished job's ``JobState`` and ``ExitCode`` (``"3:0"``: exit 3,
  ``"0:9"``: signal 9) as an :class:`~nymph.runner.ExitStatus` with a reason.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nymph.resources import parse_resources
from nymph.runner import ExitStatus, RunnerError

# Job states (scontrol's JobState) that still hold processes or will run; anything else has ended.
ACTIVE_STATES = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",  # the batch step ended, Slurm is still killing what it left (KillWait)
        "SUSPENDED",
        "STOPPED",
        "REQUEUED",
        "REQUEUE_FED",
        "REQUEUE_HOLD",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
        "SPECIAL_EXIT",
        "RESV_DEL_HOLD",
    }
)
# What a terminal state means, for ExitStatus.reason (COMPLETED / FAILED carry the exit code).
STATE_REASONS = {
    "CANCELLED": "cancelled (scancel)",
    "TIMEOUT": "Slurm time limit reached",
    "NODE_FAIL": "NodeFail",
    "OUT_OF_MEMORY": "OOMKilled",
    "PREEMPTED": "preempted by Slurm",
    "BOOT_FAIL": "node boot failure",
    "DEADLINE": "Slurm deadline reached",
}
# Variables nymph sets for a local GPU assignment; Slurm sets its own for a --gres allocation.
GPU_ENV = frozenset(
    {"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"}
)
# The code Slurm reports (ExitCode 0:53) when the batch step cannot start: an output file or the
# working directory could not be opened as the job's user.
LAUNCH_FAILED_SIGNAL = 53

_UNINFORMATIVE = frozenset({"None", "NonZeroExitCode", "JobLaunchFailure", ""})
_KEY = re.compile(r"^[A-Za-z][A-Za-z0-9_:/.]*=")
_MIB = 1024**2
#: run_config.resources fields a Slurm job cannot enforce, with why (see nymph.resources).
UNSUPPORTED_RESOURCES = {
    "pids": "Slurm has no per-job process limit",
    "shm": "a job's /dev/shm is the compute node's own, not sized per job",
}


# squeue's columns for the look-up before a submission: id, name, long state, workdir (last: a path
# may hold the separator)
QUEUE_FORMAT = "%i|%j|%T|%Z"


@dataclass(frozen=True)
class JobRecord:
    """What the runner reads from ``scontrol show job -o``."""

    job_id: str
    name: str
    state: str  # JobState, e.g. RUNNING, COMPLETED, FAILED, CANCELLED
    exit_code: int  # the batch step's exit code (ExitCode "N:S" -> N)
    signal: int  # the signal that ended it (ExitCode "N:S" -> S), 0 for none
    reason: str  # Slurm's Reason (None, NonZeroExitCode, JobLaunchFailure, Resources, ...)
    fields: Mapping[str, str]

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES


def parse_record(line: str) -> JobRecord:
    """One record of ``scontrol show job -o`` (``Key=Value`` pairs; values may hold spaces)."""
    fields: dict[str, str] = {}
    key = None
    for token in line.strip().split(" "):
        if _KEY.match(token):
            key, _, value = token.partition("=")
            fields[key] = value
        elif key is not None:  # a value with spaces (Command=..., Comment=..., WorkDir=...)
            fields[key] += " " + token
    if "JobId" not in fields or "JobState" not in fields:
        raise RunnerError(f"slurm runner: cannot read a job record from scontrol: {line[:300]!r}")
    code, _, sig = fields.get("ExitCode", "0:0").partition(":")
    return JobRecord(
        job_id=fields["JobId"],
        name=fields.get("JobName", ""),
        state=fields["JobState"].split("+")[0].upper(),
        exit_code=_int(code),
        signal=_int(sig),
        reason=fields.get("Reason", "None"),
        fields=fields,
    )


def job_name(invocation_id: str, attempt: int) -> str:
    """``nymph-<invocation id>-a<attempt>`` (:func:`nymph.runnerkit.task_name`), the job's name.

    The attempt is part of it so that the look-up before a submission finds this attempt's job and
    never an earlier attempt's in the same workdir (the workdir is the invocation's, every attempt
    uses it); 36 characters for a ULID, far inside Slurm's limits.
    """
    return f"nymph-{invocation_id.lower()}-a{attempt}"


def legacy_job_name(invocation_id: str) -> str:
    """``nymph-<invocation id>``: the name older nymphs gave every attempt's job (no attempt in it)."""
    return f"nymph-{invocation_id}"


def lookup_names(invocation_id: str, attempt: int) -> list[str]:
    """The names a start of ``attempt`` asks squeue about: its own first, then every earlier
    attempt's and the older nymphs' name, whose jobs must not run beside it in the same workdir."""
    earlier = [job_name(invocation_id, k) for k in range(attempt - 1, 0, -1)]
    return [job_name(invocation_id, attempt), *earlier, legacy_job_name(invocation_id)]


@dataclass(frozen=True)
class QueuedJob:
    """One line of ``squeue --format=QUEUE_FORMAT``."""

    job_id: str
    name: str
    state: str  # the long form, as scontrol's JobState
    workdir: str

    @property
    def active(self) -> bool:
        return self.state.split("+")[0].upper() in ACTIVE_STATES


def parse_queue(text: str) -> list[QueuedJob]:
    """The jobs in squeue's answer (``--noheader --format=QUEUE_FORMAT``); other lines are skipped."""
    jobs = []
    for line in text.splitlines():
        parts = line.strip().split("|", 3)
        if len(parts) == 4 and parts[0].isdigit():
            jobs.append(QueuedJob(*parts))
    return jobs


@dataclass(frozen=True)
class StartPlan:
    """What a start does before (or instead of) submitting."""

    adopt: str | None  # this attempt's job, submitted by a start whose answer was lost: not again
    cancel: tuple[str, ...]  # other jobs of the invocation active in its workdir: never beside it


def plan_start(
    jobs: list[QueuedJob], invocation_id: str, attempt: int, workdir: str, destroyed: Collection[str]
) -> StartPlan:
    """Decide from the jobs squeue knows under :func:`lookup_names` (in any state).

    Only jobs in ``workdir`` count (the name alone could be another nymph's with the same
    invocation: another workdir root), and none this runner destroyed. This attempt's job is
    adopted whatever its state, so a lost sbatch answer never submits twice, even across a nymph
    restart (the name, not a memory of the lost answer, finds it); when there are several (the
    double submission this prevents), the first one is adopted. Every other one still active (an
    earlier attempt's, one named the older nymphs' way, a duplicate) is cancelled: it would run
    the invocation a second time in the same workdir. A finished one is left alone.
    """
    own = job_name(invocation_id, attempt)
    names = set(lookup_names(invocation_id, attempt))
    found = sorted(
        (j for j in jobs if j.workdir == workdir and j.name in names and j.job_id not in destroyed),
        key=lambda j: int(j.job_id),
    )
    adopt = next((j.job_id for j in found if j.name == own), None)
    cancel = tuple(j.job_id for j in found if j.active and j.job_id != adopt)
    return StartPlan(adopt, cancel)


def exit_status(record: JobRecord) -> ExitStatus:
    """The ExitStatus of a finished job: the exit code, or minus the signal, with why it ended."""
    state, code, sig = record.state, record.exit_code, record.signal
    if code:
        exit_code = code
    elif sig:
        exit_code = -sig
    elif state in ("COMPLETED",):
        exit_code = 0
    elif state == "CANCELLED":
        exit_code = -15  # scancel of a pending job, or a cancel whose signal Slurm did not record
    else:
        exit_code = -1
    reason: str | None = STATE_REASONS.get(state)
    if state == "FAILED" and not code and sig == LAUNCH_FAILED_SIGNAL:
        reason = (
            "the Slurm job failed to launch (ExitCode 0:53): the workdir or its stdout.log / "
            "stderr.log could not be opened as the job's user on the compute node"
        )
    elif exit_code < 0 and state not in ("CANCELLED", "OUT_OF_MEMORY", "NODE_FAIL"):
        reason = f"signal {sig}" if reason is None else f"{reason} (signal {sig})"
    # Slurm's Reason adds to TIMEOUT, OOM, NODE_FAIL...; a cancelled job keeps a stale pending reason
    if reason is not None and state != "CANCELLED" and record.reason not in _UNINFORMATIVE:
        reason = f"{reason}; Slurm reason: {record.reason}"
    return ExitStatus(exit_code=exit_code, reason=reason)


def resource_args(resources: Any, gpus_assigned: int) -> list[str]:
    """sbatch options for ``run_config.resources``; ``gpus`` defaults to the GPUs nymph assigned.

    Raises :class:`~nymph.resources.ResourceError` for a bad value or a field Slurm cannot enforce.
    """
    wanted = parse_resources(resources, "slurm", unsupported=UNSUPPORTED_RESOURCES)
    args: list[str] = []
    if wanted.millicpus is not None:
        args.append(f"--cpus-per-task={math.ceil(wanted.millicpus / 1000)}")  # Slurm allocates whole CPUs
    if wanted.memory is not None:
        args.append(f"--mem={math.ceil(wanted.memory / _MIB)}M")
    gpus = wanted.gpus if wanted.gpus is not None else gpus_assigned
    if gpus:
        args.append(f"--gres=gpu:{gpus}")
    return args


REAPER_SOURCE = (Path(__file__).with_name("reaper.py")).read_text()


# The job starts with the submitter's environment (sbatch exports it): the script keeps only what
# Slurm set for the job (SLURM_*, and the GPU variables of its --gres) and then exports the task's
# own (nymph.taskenv), so nothing of nymph's environment reaches the task. ``env`` and ``sed`` run
# before the loop (the command substitution); the loop uses builtins only.
CLEAN_ENV = (
    "for _v in $(env | sed -n 's/^\\([A-Za-z_][A-Za-z0-9_]*\\)=.*/\\1/p'); do case $_v in "
    "SLURM_*|" + "|".join(sorted(GPU_ENV)) + "|GPU_DEVICE_ORDINAL) ;; *) unset $_v ;; esac; done; unset _v"
)


def batch_script(
    workdir: str, env: Mapping[str, str], command: list[str], header: str, python: str | None = None
) -> str:
    """The batch script: export ``env``, insist on ``workdir`` (a missing --chdir runs in /tmp), exec.

    With ``python``, the command runs under :mod:`nymph_slurm.reaper` (inline, with that
    interpreter), so no process the task starts outlives the job; when the job's user cannot run
    that interpreter on the node (a script needs none otherwise), the command runs without it.
    """
    lines = ["#!/bin/sh", f"# {header}", CLEAN_ENV]
    for key, value in sorted(env.items()):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise RunnerError(f"slurm runner: environment variable name {key!r} cannot be exported")
        lines.append(f"export {key}={shlex.quote(value)}")
    lines.append(f'cd {shlex.quote(workdir)} || {{ echo "nymph: no workdir on $(hostname)" >&2; exit 2; }}')
    if python is not None:
        reaped = [python, "-c", REAPER_SOURCE, *command]
        lines.append(f"[ -x {shlex.quote(python)} ] && exec {shlex.join(reaped)}")
    lines.append("exec " + shlex.join(command))
    return "\n".join(lines) + "\n"


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return 0
