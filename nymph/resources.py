"""The one reader of ``run_config.resources``: every runner parses limits here, with one set of units.

A task asks for limits in ``run_config.resources``; a runner may add defaults of its own (its
``cpus``, ``memory``, ``pids``, ``shm`` options). :func:`parse_resources` reads a task's mapping and
:func:`parse_defaults` a runner's options into the same typed :class:`Resources`, which each runner
turns into its own form (docker SDK keywords, a pod's requests and limits, sbatch options):

========== ====================================================== ==================================
field      accepted                                               read as
========== ====================================================== ==================================
``cpus``   a positive number (``2``, ``1.5``, ``"1.5"``) or        millicores (``millicpus``), at
           millicores (``"500m"``); alias ``cpu``                  least 1
``memory`` bytes (``1073741824``) or a number with a binary unit   bytes, at least 1
           (``64k``, ``512m``, ``1g``, ``1t``, ``512Mi``,
           ``2GiB``): k/m/g/t and Ki/Mi/Gi/Ti are powers of 1024
``pids``   a positive whole number (``1024``, ``"1024"``)           processes and threads of the task
``shm``    a size, as ``memory``                                  bytes of ``/dev/shm``
``gpus``   a whole number from 0 to 1024 (``2``, ``2.0``, ``"2"``);  a GPU count, read as the control
           alias ``nvidia.com/gpu``                                plane reads it (``gpucount``)
========== ====================================================== ==================================

A runner that cannot enforce a field names it in ``unsupported`` (field -> why); a task asking
for it is refused. Every problem (a bad value, an unknown key, a field this runner cannot honour)
is one :class:`ResourceError` with one message format, naming the runner, the field and what to do::

    kube runner: run_config.resources.pids: not enforced by this runner (a pod cannot set its own
    pids limit: the kubelet's podPidsLimit does); leave it out, or send the task to a nymph whose
    runner enforces it

A :class:`ResourceError` is a :class:`~nymph.runner.RunnerError`, so the invocation is acked
``failed`` (type ``ResourceError``) with that message, before anything runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

# the parsers and their words are the control plane's too: it refuses at submit what they refuse
from dreamlake.lakeshore.resourcevalues import ALIASES, EXPECTED, FIELDS, PARSERS
from nymph.runner import RunnerError

__all__ = ["ALIASES", "FIELDS", "ResourceError", "Resources", "parse_defaults", "parse_resources"]

TASK_SOURCE = "run_config.resources"
_REFUSED_FIX = "leave it out, or send the task to a nymph whose runner enforces it"


class ResourceError(RunnerError):
    """``run_config.resources`` (or a runner's default limits) cannot be honoured as given.

    ``runner`` and ``field`` say where (``field`` is empty for the mapping as a whole), ``problem``
    what is wrong and ``fix`` what to do; the message is always
    ``"{runner} runner: {source}.{field}: {problem}; {fix}"``.
    """

    def __init__(self, runner: str, field: str, problem: str, fix: str, source: str = TASK_SOURCE) -> None:
        self.runner, self.field, self.problem, self.fix = runner, field, problem, fix
        where = f"{source}.{field}" if field else source
        super().__init__(f"{runner} runner: {where}: {problem}; {fix}")


@dataclass(frozen=True)
class Resources:
    """Parsed limits; None means "not asked for" (no limit, or the runner's default)."""

    millicpus: int | None = None
    memory: int | None = None  # bytes
    pids: int | None = None
    shm: int | None = None  # bytes
    gpus: int | None = None

    @property
    def cpus(self) -> float | None:
        """CPUs as a number (``1500`` millicores -> ``1.5``)."""
        return None if self.millicpus is None else self.millicpus / 1000

    def over(self, defaults: Resources) -> Resources:
        """These values, each missing one taken from ``defaults``."""
        missing = {f.name: getattr(defaults, f.name) for f in fields(self) if getattr(self, f.name) is None}
        return replace(self, **missing)

    def given(self) -> tuple[str, ...]:
        """The fields that are set, by their ``run_config.resources`` names."""
        return tuple(name for name in FIELDS if self._value(name) is not None)

    def _value(self, name: str) -> int | None:
        value: int | None = getattr(self, "millicpus" if name == "cpus" else name)
        return value


def parse_resources(value: Any, runner: str, *, unsupported: Mapping[str, str] | None = None) -> Resources:
    """A task's ``run_config.resources`` for ``runner``; raise :class:`ResourceError`.

    ``unsupported`` maps each field ``runner`` cannot enforce to why; asking for one is refused.
    None (or ``{}``) asks for nothing.
    """
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise ResourceError(
            runner, "", f"expected a table, got {value!r}", "give a mapping such as {'cpus': 2}"
        )
    wanted: dict[str, Any] = {}
    for key, raw in value.items():
        name = ALIASES.get(str(key), str(key))
        if name in wanted:
            raise ResourceError(
                runner, name, f"given twice (as {name!r} and its alias {key!r})", "give it once"
            )
        wanted[name] = raw
    unknown = sorted(set(wanted) - set(FIELDS))
    if unknown:
        raise ResourceError(
            runner,
            "",
            f"unknown keys {unknown}",
            f"use {', '.join(FIELDS)} (aliases: {', '.join(ALIASES)})",
        )
    res = _read(wanted, runner, TASK_SOURCE)
    for name in res.given():
        why = (unsupported or {}).get(name)
        if why is not None:
            raise ResourceError(runner, name, f"not enforced by this runner ({why})", _REFUSED_FIX)
    return res


def parse_defaults(runner: str, **options: Any) -> Resources:
    """A runner's default limits from its options (``cpus=``, ``memory=``, ...); None ones unset.

    Read like a task's, so ``memory="512m"`` means the same as an option and in a task; an error
    names the option (``docker runner: runner_options.memory: ...``).
    """
    unknown = sorted(set(options) - set(FIELDS))
    if unknown:  # a programming error in the runner, not an operator's
        raise TypeError(f"parse_defaults: unknown resource options {unknown}")
    return _read({k: v for k, v in options.items() if v is not None}, runner, "runner_options")


def _read(wanted: Mapping[str, Any], runner: str, source: str) -> Resources:
    def bad(name: str) -> ResourceError:
        return ResourceError(
            runner, name, f"expected {EXPECTED[name]}, got {wanted[name]!r}", "correct the value", source
        )

    out: dict[str, int] = {}
    for name, raw in wanted.items():
        parsed = PARSERS[name](raw)
        if parsed is None:
            raise bad(name)
        out["millicpus" if name == "cpus" else name] = parsed
    return Resources(**out)
