"""Placement: what a call needs, what a poller offers, and whether the one fits the other.

A call's needs come from its ``run_config`` (:func:`needs_of`): ``resources.gpus`` (a whole
number; alias ``nvidia.com/gpu``; read by :func:`dreamlake.lakeshore.gpucount.gpus_of`, as nymph
reads it), ``selector`` (label -> value, every one of which the poller's
labels must equal; a key the poller has no label for never matches; an entry no nymph label could
be, by ``dreamlake.lakeshore.labels``' rule, is refused) and ``concurrency_key``
(calls sharing it count against one fleet-wide ``max_concurrency``). Calls with the same needs
share a *shape*: :meth:`Needs.key`, a short hash ('' for a call with none, the plain shape), stored
on the row and indexed, so a claim reads the heads of the shapes its poller may take, each one a
range read (store/claims.py).

``resources.memory`` (bytes, or a size such as ``"16g"`` / ``"512Mi"``) and ``resources.cpus``
are part of the needs too, read as nymph reads them (``dreamlake.lakeshore.resourcevalues``): a
positive limit; 0 is refused (400), not read as "not asked".

A poller's :class:`Offer` is what it has free now: its free GPUs and its labels (an old daemon that
sends none offers no GPUs and no labels: it takes plain calls and calls that need neither), and
what one task may be given there: ``memory`` (the most its runner lets one task have: the process
runner's cap where its memory controller holds it, 0 where none does, so a call that asks for
memory is never claimed by a host that would refuse it) and ``cpus``. A poller that sends neither
(a runner that does not say: kube, slurm) is not matched on them.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from dreamlake.lakeshore import resourcevalues
from dreamlake.lakeshore.errors import PlaneError
from dreamlake.lakeshore.gpucount import MAX_GPUS, gpus_of
from dreamlake.lakeshore.humanize import size as human_size
from dreamlake.lakeshore.labels import MAX_LABEL, label_problem, label_shown

PLAIN = ""  # the shape of a call that needs nothing placement matches on
MAX_SELECTOR = 16  # labels one selector may name
MAX_NOT_BEFORE_S = 366 * 86400.0  # a not_before further ahead than this is refused
SHAPE_LEN = 16
MAX_CPUS = 4096


@dataclass(frozen=True)
class Needs:
    """What placement matches of one call."""

    gpus: int = 0
    selector: tuple[tuple[str, str], ...] = ()
    concurrency_key: str | None = None
    max_concurrency: int | None = None  # not part of the shape: the limit of its key (latest wins)
    memory: int = 0  # bytes one task needs (0: not asked)
    cpus: float = 0.0  # CPUs one task needs (0: not asked)

    def key(self) -> str:
        """The shape: '' when the call needs nothing, else a hash of the needs."""
        if not (self.gpus or self.selector or self.memory or self.cpus) and self.concurrency_key is None:
            return PLAIN
        return hashlib.sha256(json.dumps(self.as_json(), sort_keys=True).encode()).hexdigest()[:SHAPE_LEN]

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "gpus": self.gpus,
            "selector": dict(self.selector),
            "concurrency_key": self.concurrency_key,
        }
        if self.memory:  # only when asked: the shapes of calls that ask neither keep their keys
            out["memory"] = self.memory
        if self.cpus:
            out["cpus"] = self.cpus
        return out

    @classmethod
    def from_json(cls, data: Any) -> Needs:
        data = data if isinstance(data, dict) else {}
        selector = data.get("selector") or {}
        return cls(
            gpus=int(data.get("gpus") or 0),
            selector=tuple(sorted((str(k), str(v)) for k, v in selector.items())),
            concurrency_key=data.get("concurrency_key"),
            memory=int(data.get("memory") or 0),
            cpus=float(data.get("cpus") or 0.0),
        )

    def describe(self) -> str:
        parts = []
        if self.gpus:
            parts.append(f"{self.gpus} GPU{'s' if self.gpus != 1 else ''}")
        if self.memory:
            parts.append(f"{human_size(self.memory)} of memory")
        if self.cpus:
            parts.append(f"{self.cpus:g} CPUs")
        parts += [label_shown(k, v) for k, v in self.selector]
        if self.concurrency_key is not None:
            parts.append(f"concurrency_key={self.concurrency_key}")
        return ", ".join(parts) or "nothing"


@dataclass(frozen=True)
class Offer:
    """What one poller has free now (the poll's ``offer``)."""

    gpus: int = 0
    labels: tuple[tuple[str, str], ...] = field(default=())
    memory: int | None = None  # the most memory one task may have here; None: not said (not matched)
    cpus: float | None = None  # the CPUs one task may use here; None: not said

    @classmethod
    def of(
        cls,
        gpus: int = 0,
        labels: dict[str, str] | None = None,
        memory: int | None = None,
        cpus: float | None = None,
    ) -> Offer:
        return cls(int(gpus), tuple(sorted((labels or {}).items())), memory, cpus)

    def fits(self, needs: Needs, gpus_left: int | None = None) -> bool:
        """Whether a call of ``needs`` may run here (with ``gpus_left`` free, default all offered)."""
        free = self.gpus if gpus_left is None else gpus_left
        if needs.gpus > free:
            return False
        if needs.memory and self.memory is not None and needs.memory > self.memory:
            return False
        if needs.cpus and self.cpus is not None and needs.cpus > self.cpus:
            return False
        if needs.selector:
            labels = dict(self.labels)
            return all(labels.get(k) == v for k, v in needs.selector)
        return True


NO_OFFER = Offer()


def _gpus(resources: Any) -> int:
    try:
        return gpus_of(resources)  # nymph reads the count by the same function (dreamlake.lakeshore.gpucount)
    except ValueError as exc:
        raise PlaneError(str(exc), 400) from None


def _memory(resources: Any) -> int:
    """``resources.memory`` in bytes (a number, or a size such as ``"16g"``, ``"512Mi"``: read as
    nymph reads it, by ``resourcevalues``); 0 when absent."""
    value = resources.get("memory") if isinstance(resources, dict) else None
    if value is None:
        return 0
    size = resourcevalues.size(value)
    if size is None:
        raise PlaneError(
            f"run_config.resources.memory must be {resourcevalues.EXPECTED['memory']}, got {value!r:.40}", 400
        )
    return size


def _cpus(resources: Any) -> float:
    """``resources.cpus`` or its alias ``cpu`` (a number, or millicpus such as ``"500m"``: read as
    nymph reads it, by ``resourcevalues``); 0 when absent."""
    value, name = None, "cpus"
    if isinstance(resources, dict):
        value = resources.get("cpus")
        if value is None:
            value, name = resources.get("cpu"), "cpu"
    if value is None:
        return 0.0
    milli = resourcevalues.millicpus(value)
    if milli is None or milli > MAX_CPUS * 1000:
        raise PlaneError(
            f"run_config.resources.{name} must be {resourcevalues.EXPECTED['cpus']}, at most {MAX_CPUS}, "
            f"got {value!r:.40}",
            400,
        )
    return milli / 1000


def _label_text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_LABEL:
        raise PlaneError(f"{what} must be a string of 1 to {MAX_LABEL} characters, got {value!r:.60}", 400)
    return value


def scoped_key(namespace: str, key: str) -> str:
    """A concurrency key as placement holds it: ``<namespace>/<key>`` (a namespace name has no
    ``/``). Keys belong to the namespace that submits them: a tenant naming another tenant's key
    gets a key of its own by that name, never a share of that key's room or a say over its
    ``max_concurrency``."""
    return f"{namespace}/{key}"


def shown_key(namespace: str | None, key: str) -> str:
    """``key`` as a caller of ``namespace`` knows it (its own prefix off); a fleet-wide caller
    (None) sees the whole ``<namespace>/<key>``."""
    return key.removeprefix(f"{namespace}/") if namespace is not None else key


NO_NEEDS = Needs()
_NEEDS_KEYS = frozenset(("selector", "concurrency_key", "max_concurrency", "resources"))


def needs_of(run_config: dict[str, Any], namespace: str) -> Needs:
    """The needs of a call submitted in ``namespace`` (its concurrency key scoped to it:
    :func:`scoped_key`); PlaneError(400) for a malformed ``selector``, ``resources.gpus``,
    ``concurrency_key`` or ``max_concurrency``."""
    if _NEEDS_KEYS.isdisjoint(run_config):  # most calls ask nothing placement matches
        return NO_NEEDS
    selector = run_config.get("selector")
    pairs: list[tuple[str, str]] = []
    if selector is not None:
        if not isinstance(selector, dict) or len(selector) > MAX_SELECTOR:
            raise PlaneError(
                f"run_config.selector must be a map of at most {MAX_SELECTOR} labels such as "
                f"{{'pool': 'a'}}, got {selector!r:.60}",
                400,
            )
        for k, v in selector.items():
            refused = label_problem(k, v, "run_config.selector")  # nymph's own rule for its labels
            if refused is not None:
                raise PlaneError(refused, 400)
            pairs.append((k, v))
    key = run_config.get("concurrency_key")
    if key is not None:
        key = _label_text(key, "run_config.concurrency_key")
    limit = run_config.get("max_concurrency")
    if limit is not None:
        if key is None:
            raise PlaneError("run_config.max_concurrency needs a concurrency_key", 400)
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 2**31 - 1:
            raise PlaneError(
                f"run_config.max_concurrency must be a whole number >= 1, got {limit!r:.40}", 400
            )
    resources = run_config.get("resources")
    if key is not None:
        key = scoped_key(namespace, key)
    return Needs(
        _gpus(resources), tuple(sorted(pairs)), key, limit, memory=_memory(resources), cpus=_cpus(resources)
    )


def not_before_of(run_config: dict[str, Any], now: float | None = None) -> float | None:
    """``run_config.not_before`` (epoch seconds) when it is still ahead; None when absent or past;
    PlaneError(400) when it is not a time or more than a year ahead."""
    value = run_config.get("not_before")
    if value is None:
        return None
    now = time.time() if now is None else now
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PlaneError(f"run_config.not_before must be a time in epoch seconds, got {value!r:.40}", 400)
    if value > now + MAX_NOT_BEFORE_S:
        raise PlaneError("run_config.not_before must be at most a year ahead", 400)
    return float(value) if value > now else None


def parse_offer(value: Any) -> Offer:
    """A poll's ``offer`` field (``{"gpus": N, "labels": {k: v}}``); None or absent: no GPUs, no
    labels. ValueError naming what is wrong."""
    if value is None:
        return NO_OFFER
    if not isinstance(value, dict):
        raise ValueError("field 'offer' must be a map such as {'gpus': 2, 'labels': {'pool': 'a'}}")
    gpus = value.get("gpus", 0)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 0 <= gpus <= MAX_GPUS:
        raise ValueError(f"field 'offer.gpus' must be a whole number from 0 to {MAX_GPUS}")
    labels = value.get("labels") or {}
    if not isinstance(labels, dict) or len(labels) > 64:
        raise ValueError("field 'offer.labels' must be a map of at most 64 labels")
    for k, v in labels.items():
        if not isinstance(k, str) or not isinstance(v, str) or len(k) > MAX_LABEL or len(v) > MAX_LABEL:
            raise ValueError(
                f"field 'offer.labels' must map strings to strings of at most {MAX_LABEL} characters"
            )
    memory = value.get("memory")
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int) or memory < 0):
        raise ValueError("field 'offer.memory' must be the bytes one task may have (a whole number >= 0)")
    cpus = value.get("cpus")
    if cpus is not None and (
        isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not 0 <= cpus <= MAX_CPUS
    ):
        raise ValueError(f"field 'offer.cpus' must be a number of CPUs from 0 to {MAX_CPUS}")
    return Offer.of(gpus, labels, memory, None if cpus is None else float(cpus))
