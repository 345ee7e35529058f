"""Function transport, the worker's side: the gates a ``fn`` record passes before it runs.

:func:`resolve_fn` applies them in order: ``allow_pickled``, the runtime policy (before any
unpickle: :func:`check_runtime`, ``strict`` | ``minor`` | ``off``) plus the blob hash, then for a
``ref`` the ``src_hash`` staleness check (the worker's source must hash as the submitter's did).
cloudpickle is imported only to unpickle.

A long-lived worker resolves the same few ``ref`` records all day: a record that passed every gate
is remembered (:data:`_RESOLVED`, by module, qualname, ``src_hash`` and runtime policy) with the
module object, the attribute and the callable it gave, and the code object its source check matched.
The next record with the same fields is answered from there only while all of them still hold:
the same module object in ``sys.modules``, the same attribute under the qualname (``importlib.reload``
rebinds it), the same callable behind it and the same code in that callable (a hot reload that
swaps ``__code__``); anything else goes through the gates again. A pickled function is never
remembered: each passes the gates (``allow_pickled`` first).
"""

from __future__ import annotations

import sys

from dreamlake.lakeshore.errors import EnvelopeError, PickleRefused, RuntimeMismatch, StaleSource
from dreamlake.lakeshore.fn_record import _getattr_chain, _local_src_hash, _sha256_hex, _underlying, check_fn

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Mapping

    FnRecord = Dict[str, Any]

__all__ = ["RUNTIME_POLICIES", "check_runtime", "resolve_fn", "unreadable_path"]

RUNTIME_POLICIES = ("strict", "minor", "off")


def check_runtime(runtime: Mapping[str, Any], policy: str = "minor") -> None:
    """Refuse a pickle whose runtime differs from this one beyond ``policy`` (strict | minor | off)."""
    if policy not in RUNTIME_POLICIES:
        raise ValueError(f"unknown runtime policy {policy!r}: use 'strict', 'minor' or 'off'")
    if policy == "off":
        return
    from collections.abc import Mapping

    if not isinstance(runtime, Mapping):
        raise RuntimeMismatch("the pickled function carries no runtime record; re-submit it")
    try:
        import cloudpickle
    except ImportError as exc:
        blocked = unreadable_path()
        if blocked:  # not a missing package: this process cannot read where it is
            raise RuntimeMismatch(
                f"cloudpickle cannot be imported: {blocked}; give the task user an interpreter and "
                "PYTHONPATH it can read (nymph start checks this: run `nymph doctor`)"
            ) from exc
        raise RuntimeMismatch(
            "cloudpickle is not installed in this runtime, so a pickled function cannot run here: "
            "install cloudpickle or put the lakeshore entry bundle on PYTHONPATH"
        ) from exc
    theirs_py, theirs_cp = str(runtime.get("python", "?")), str(runtime.get("cloudpickle", "?"))
    theirs_impl = str(runtime.get("impl", sys.implementation.name))
    mine_py = ".".join(str(n) for n in sys.version_info[:3])
    mine_cp = str(cloudpickle.__version__)
    if policy == "strict":
        same = theirs_py == mine_py and theirs_cp == mine_cp
        need = "the exact python and cloudpickle versions"
    else:
        same = _parts(theirs_py, 2) == _parts(mine_py, 2) and _parts(theirs_cp, 1) == _parts(mine_cp, 1)
        need = "the same python major.minor and cloudpickle major version"
    if not same or theirs_impl != sys.implementation.name:
        raise RuntimeMismatch(
            f"function pickled under {theirs_impl} {theirs_py} / cloudpickle {theirs_cp}, but this worker "
            f"runs {sys.implementation.name} {mine_py} / cloudpickle {mine_cp}; runtime policy {policy!r} "
            f"requires {need}. Run a matching runtime, ship the function by ref, or relax the policy "
            "(LAKESHORE_RUNTIME_POLICY=minor|off)"
        )


def _parts(version: str, n: int) -> tuple[str, ...]:
    return tuple(version.split(".")[:n])


def resolve_fn(
    fn: Mapping[str, Any], *, allow_pickled: bool, runtime_policy: str = "minor"
) -> Callable[..., Any]:
    """The callable for ``fn`` after the gates: allow_pickled, runtime + hash, src_hash staleness."""
    if type(fn) is dict and fn.get("kind") == "ref":
        key = (fn.get("module"), fn.get("qualname"), fn.get("src_hash"), runtime_policy)
        try:
            kept = _RESOLVED.get(key)
        except TypeError:  # an unhashable field: the gates below refuse it
            kept = None
        if kept is not None:
            obj = _still(key[0], kept)
            if obj is not None:
                return obj
    if runtime_policy not in RUNTIME_POLICIES:
        raise ValueError(f"unknown runtime policy {runtime_policy!r}: use 'strict', 'minor' or 'off'")
    record = check_fn(dict(fn))
    if record["kind"] == "pickle":
        return _unpickle(record, allow_pickled=allow_pickled, policy=runtime_policy)
    return _resolve_ref(record, policy=runtime_policy)


# The ``ref`` records that passed the gates (see the module docstring): (module, qualname,
# src_hash, policy) -> (module object, the qualname's parts, attribute, callable, code its source
# check matched or None). A key holds only str fields (check_fn passed) and a known policy, so a
# hit needs no check_fn.
_RESOLVED: dict[tuple[Any, Any, Any, str], tuple[Any, list[str], Any, Any, Any]] = {}
_RESOLVED_MAX = 1024


def _still(module_name: Any, kept: tuple[Any, list[str], Any, Any, Any]) -> Callable[..., Any] | None:
    """The remembered callable while its module, attribute, callable and code are those it was
    resolved from; None: resolve it again."""
    module, parts, attr, obj, code = kept
    fn: Callable[..., Any] = obj
    if sys.modules.get(module_name) is not module:
        return None
    now = module
    try:
        for part in parts:  # _getattr_chain(module, qualname)
            now = getattr(now, part)
    except Exception:  # gone, or a module __getattr__ that fails now: the gates say what
        return None
    if now is not attr:
        return None
    inner = getattr(attr, "__lakeshore_fn__", None)
    if (attr if inner is None else inner) is not obj:
        return None
    if code is not None and getattr(_underlying(obj), "__code__", None) is not code:
        return None
    return fn


def _remember(record: FnRecord, policy: str, module: Any, attr: Any, obj: Any, code: Any) -> None:
    key = (record["module"], record["qualname"], record.get("src_hash"), policy)
    if len(_RESOLVED) >= _RESOLVED_MAX:
        _RESOLVED.clear()
    _RESOLVED[key] = (module, record["qualname"].split("."), attr, obj, code)


def _unpickle(record: FnRecord, *, allow_pickled: bool, policy: str) -> Callable[..., Any]:
    where = record.get("where") or record["qualname"]
    if not allow_pickled:
        raise PickleRefused(
            f"refusing pickled function {where}: unpickling runs arbitrary code from the submitter. "
            "Start the worker with --allow-pickled (LAKESHORE_ALLOW_PICKLED=1) if it trusts the "
            "submitter, or ship the function by ref (an importable module-level function)"
        )
    check_runtime(record["runtime"], policy)
    digest = "sha256:" + _sha256_hex(record["blob"])
    if digest != record["hash"]:
        raise EnvelopeError(f"pickled function {where}: blob hash {digest} does not match {record['hash']}")
    import cloudpickle

    try:
        obj = cloudpickle.loads(record["blob"])
    except Exception as exc:
        raise EnvelopeError(f"cannot unpickle {where}: {type(exc).__name__}: {exc}") from exc
    if not callable(obj):
        raise EnvelopeError(f"pickled function {where} unpickled to a {type(obj).__name__}, not a callable")
    return obj  # type: ignore[no-any-return]


def unreadable_path() -> str | None:
    """What of this process's ``sys.path`` it cannot read (a directory its user may not enter or
    list, e.g. an interpreter under a 0700 home run by another user), said as a sentence; None when
    all of it is readable. An import that fails for that reason is not a missing package."""
    import os

    for entry in sys.path:
        if not entry:
            continue
        try:
            st = os.stat(entry)
        except FileNotFoundError:
            continue
        except PermissionError:
            return (
                f"uid {os.getuid()} cannot reach {entry} on sys.path (a directory on the way is closed to it)"
            )
        except OSError:
            continue
        import stat as _stat

        need = os.R_OK | os.X_OK if _stat.S_ISDIR(st.st_mode) else os.R_OK
        if not os.access(entry, need):
            return f"uid {os.getuid()} cannot read {entry} on sys.path"
    return None


def _shipped(module: Any) -> bool:
    """Whether ``module`` was imported from a code archive shipped with the call (LAKESHORE_CODE_PATH)."""
    import os

    from dreamlake.lakeshore import envvars

    file = getattr(module, "__file__", None) or ""
    dirs = [d for d in (envvars.string("LAKESHORE_CODE_PATH") or "").split(os.pathsep) if d]
    return any(file.startswith(d.rstrip(os.sep) + os.sep) for d in dirs)


def _resolve_ref(record: FnRecord, *, policy: str) -> Callable[..., Any]:
    import importlib

    module_name, qualname = record["module"], record["qualname"]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module_name + ".").startswith(exc.name + "."):
            raise
        blocked = unreadable_path()
        why = (
            f"{blocked}, so the module may be there and unreadable; give the task user an interpreter "
            "and PYTHONPATH it can read (nymph start checks this: run `nymph doctor`)"
            if blocked
            else "the function's module must be importable in the worker's runtime (install it or add "
            "it to PYTHONPATH)"
        )
        raise EnvelopeError(
            f"cannot import module {module_name!r} for {module_name}.{qualname}: {why}"
        ) from exc
    try:
        attr = obj = _getattr_chain(module, qualname)
    except AttributeError as exc:
        raise EnvelopeError(
            f"module {module_name!r} has no attribute {qualname!r}: deploy the same code on the worker "
            "as on the submitter"
        ) from exc
    inner = getattr(obj, "__lakeshore_fn__", None)
    if inner is not None:
        obj = inner
    if not callable(obj):
        raise EnvelopeError(f"{module_name}.{qualname} is a {type(obj).__name__}, not a callable")
    expected = record.get("src_hash")
    code = None  # the code the source check matched (None: no check made)
    if expected and policy != "off":
        local = _local_src_hash(obj, expected)
        if local is not None and local != expected:
            if _shipped(module):
                raise StaleSource(
                    f"{module_name}.{qualname}: the code shipped with the call hashes to {local} but the "
                    f"function the submitter had loaded to {expected}: the file changed after it was "
                    "imported. Reload the module (importlib.reload, or restart the kernel) after editing it"
                )
            raise StaleSource(
                f"{module_name}.{qualname}: the worker's source hashes to {local} but the submitter's "
                f"to {expected}, so the worker would run different code. Deploy the same code on both "
                "sides (or set the runtime policy to 'off' to skip this check)"
            )
        if local is None:  # no source to check: checked again next time, as the gate always did
            return obj  # type: ignore[no-any-return]
        code = getattr(_underlying(obj), "__code__", None)  # the code _local_src_hash matched
        if code is None:
            return obj  # type: ignore[no-any-return]
    _remember(record, policy, module, attr, obj, code)
    return obj  # type: ignore[no-any-return]
