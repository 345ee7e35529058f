"""Finding, loading and validating runner plugins (the ``nymph.runners`` entry-point group).

A runner is a class registered under a name in the ``nymph.runners`` entry-point group, exactly as
a third-party distribution would register one::

    [project.entry-points."nymph.runners"]
    slurm = "nymph_slurm:SlurmRunner"

Plugins are loaded lazily, by name, and validated when they load (as pluggy does): the object must
be a class whose ``name`` matches the entry-point name, whose ``capabilities`` is a
:class:`~nymph.runner.Capabilities`, which has every method of the :class:`~nymph.runner.Runner`
protocol (:data:`REQUIRED_METHODS`), and the method of every optional feature its capabilities
declare (``list_labelled``, ``reap_orphans``). The distribution a plugin came from is recorded, so
every error names the plugin, where it came from and what is wrong with it.

Runners written before ``close()`` joined the protocol still load: a class without it is given a
no-op one (a subclass of the same name; :data:`OPTIONAL_METHODS`). A class with an optional
feature's method whose capabilities do not declare it is loaded with a warning: nymph reads
features only from ``capabilities`` and will not call that method.

A broken plugin (it fails to import, has the wrong shape, or its ``check()`` fails) is reported,
never fatal: :func:`load_runner` raises :class:`RunnerLoadError` for the one runner asked for, and
:func:`list_runners` describes every registered runner with ``usable`` and ``problem`` without
raising at all.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from nymph.errors import RunnerLoadError as RunnerLoadError  # re-exported: raised here
from nymph.runner import Capabilities, Runner, RunnerUnavailable

log = logging.getLogger(__name__)

GROUP = "nymph.runners"
REQUIRED_METHODS = ("check", "start", "wait", "stop", "destroy", "inspect", "recover")
#: Protocol methods added after the first plugins were written: a class without one gets a no-op.
OPTIONAL_METHODS = ("close",)
#: The method each optional feature of Capabilities needs.
FEATURE_METHODS = {
    "list_labelled": "list_labelled",
    "reap_orphans": "reap_orphans",
    "exit_fd": "exit_fd",
    "withdraw": "withdraw",
}


@dataclass(frozen=True)
class RunnerInfo:
    """What ``nymph runners`` shows for one registered runner."""

    name: str
    value: str  # the entry-point target, "module:Class"
    distribution: str | None
    version: str | None
    usable: bool  # loads, has the right shape, and check() passes on this host
    problem: str | None  # why it is not usable, None when it is


def _dist(ep: EntryPoint) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    try:
        return dist.metadata["Name"], dist.version
    except Exception:  # a damaged dist-info must not break the listing
        return None, None


def _origin(ep: EntryPoint) -> str:
    name, version = _dist(ep)
    where = f"{name} {version}" if name else "an unknown distribution"
    return f"runner plugin {ep.name!r} ({ep.value} from {where})"


def _registered() -> dict[str, EntryPoint]:
    """Entry points of the group by name; when two distributions claim a name, the first wins."""
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=GROUP):
        if ep.name in found:
            if found[ep.name].value != ep.value:
                log.warning("%s is shadowed by %s and ignored", _origin(ep), _origin(found[ep.name]))
            continue
        found[ep.name] = ep
    return found


def available_runners() -> list[str]:
    """The names registered in the group, sorted; nothing is imported."""
    return sorted(_registered())


def _shape_problem(obj: object, name: str) -> str | None:
    """Why ``obj`` is not a runner class registered as ``name``; None when it is one."""
    if not inspect.isclass(obj):
        return f"is a {type(obj).__name__}, not a class"
    declared = getattr(obj, "name", None)
    if not isinstance(declared, str):
        return "has no string attribute 'name'"
    if declared != name:
        return f"declares name {declared!r} but is registered as {name!r} (handles would not re-attach)"
    caps = getattr(obj, "capabilities", None)
    if not isinstance(caps, Capabilities):
        return "has no 'capabilities' attribute of type nymph.runner.Capabilities"
    missing = [m for m in REQUIRED_METHODS if not callable(getattr(obj, m, None))]
    if missing:
        return f"lacks the Runner method(s) {', '.join(missing)}"
    for feature, method in FEATURE_METHODS.items():
        if getattr(caps, feature) and not callable(getattr(obj, method, None)):
            return f"declares capabilities.{feature} but has no {method}() method"
    return None


def _completed(cls: type[Any], origin: str) -> type[Any]:
    """``cls``, or a subclass of the same name with a no-op for each missing optional method.

    Also warns about a feature method its capabilities leave undeclared (it will not be called).
    """
    for feature, method in FEATURE_METHODS.items():
        if callable(getattr(cls, method, None)) and not getattr(cls.capabilities, feature):
            log.warning(
                "%s has %s() but its capabilities do not declare %s=True: nymph will not call it",
                origin,
                method,
                feature,
            )
    missing = [m for m in OPTIONAL_METHODS if not callable(getattr(cls, m, None))]
    if not missing:
        return cls
    log.debug("%s has no %s(): using a no-op", origin, ", ".join(missing))
    namespace: dict[str, Any] = {m: _noop for m in missing}
    namespace.update(__module__=cls.__module__, __qualname__=cls.__qualname__, __doc__=cls.__doc__)
    return type(cls.__name__, (cls,), namespace)


def _noop(self: object) -> None:
    """Nothing to release (the plugin predates ``close()``)."""


def install_hint(ep: EntryPoint, missing: str | None) -> str:
    """``; install it: pip install 'DIST[EXTRA]'`` when ``missing`` (a top-level module) is a
    requirement of an extra of the plugin's distribution (``docker`` of ``dreamlake-lakeshore``), or
    the extra named after the runner when ``missing`` is one of its dependencies' (``kube``);
    ``; install it: pip install NAME`` otherwise; empty when nothing is known to be missing."""
    if not missing:
        return ""
    top = missing.split(".")[0]
    dist = getattr(ep, "dist", None)
    try:
        from packaging.requirements import Requirement

        name = dist.metadata["Name"] if dist is not None else None
        extras = []
        for line in (dist.requires or []) if dist is not None else []:
            req = Requirement(line)
            marker = str(req.marker or "")
            if req.name.lower().replace("-", "_") == top.lower() and "extra ==" in marker:
                extras.append(marker.split("extra ==", 1)[1].strip().strip("'\")"))
        if extras:  # the extra made for it, rather than 'all'
            extra = sorted(extras, key=lambda e: (e == "all", e))[0]
            return f"; install it: pip install '{name}[{extra}]'"
        if dist is not None and ep.name in (dist.metadata.get_all("Provides-Extra") or []):
            # a dependency of a dependency (kubernetes' urllib3): the runner's own extra brings it
            return f"; install the {ep.name} runner's extra: pip install '{name}[{ep.name}]'"
    except Exception:  # a damaged dist-info: the plain hint below
        pass
    return f"; install it: pip install {top}"


def _load(ep: EntryPoint) -> type[Runner]:
    try:
        obj = ep.load()
    except (Exception, SystemExit) as exc:
        hint = install_hint(ep, exc.name) if isinstance(exc, ModuleNotFoundError) else ""
        raise RunnerLoadError(f"{_origin(ep)} failed to import: {type(exc).__name__}: {exc}{hint}") from exc
    problem = _shape_problem(obj, ep.name)
    if problem is not None:
        raise RunnerLoadError(f"{_origin(ep)} is not a runner: it {problem}")
    cls: type[Runner] = _completed(obj, _origin(ep))
    return cls


def load_runner(name: str) -> type[Runner]:
    """Import and validate the runner registered as ``name``; raise :class:`RunnerLoadError`."""
    registered = _registered()
    ep = registered.get(name)
    if ep is None:
        names = ", ".join(sorted(registered)) or "none"
        raise RunnerLoadError(
            f"no runner plugin named {name!r} in entry-point group {GROUP!r}; available: {names}"
        )
    cls = _load(ep)
    dist, version = _dist(ep)
    log.debug("loaded runner %r from %s %s", name, dist, version)
    return cls


def _describe(ep: EntryPoint) -> RunnerInfo:
    dist, version = _dist(ep)
    problem: str | None = None
    try:
        cls = _load(ep)
        cls().check()
    except RunnerLoadError as exc:
        problem = str(exc)
    except RunnerUnavailable as exc:
        problem = f"unavailable on this host: {exc}"
    except (Exception, SystemExit) as exc:
        problem = f"check failed: {type(exc).__name__}: {exc}"
    return RunnerInfo(ep.name, ep.value, dist, version, problem is None, problem)


def list_runners() -> list[RunnerInfo]:
    """Every registered runner, sorted by name, with whether it can work here; never raises."""
    return [_describe(ep) for _, ep in sorted(_registered().items())]
