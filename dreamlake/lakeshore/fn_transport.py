"""Function transport, the submitter's side: the ``fn`` record for a callable.

:func:`fn_for` ships an importable module-level function by reference (``module``, ``qualname``
and its :func:`~dreamlake.lakeshore.fn_record.src_hash`) and pickles (cloudpickle) exactly what
cannot travel that way (``transport="auto"``), with the runtime it was pickled under
(:func:`runtime_info`) and a 32 KiB inline limit; the worker's side is
:mod:`dreamlake.lakeshore.fn_gates`. cloudpickle and ``inspect`` are imported only to pickle.
"""

from __future__ import annotations

import sys

from dreamlake.lakeshore.errors import TransportError
from dreamlake.lakeshore.fn_record import _getattr_chain, _sha256_hex, _underlying, src_hash

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict

    FnRecord = Dict[str, Any]

__all__ = ["INLINE_PICKLE_LIMIT", "TRANSPORTS", "fn_for", "runtime_info"]

INLINE_PICKLE_LIMIT = 32 * 1024
TRANSPORTS = ("auto", "ref", "pickle")


def _not_importable(obj: Any) -> str | None:
    """Why ``obj`` cannot be shipped by reference, or None when it can."""
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(qualname, str):
        return f"{type(obj).__name__} instance has no __qualname__ of its own (a callable instance)"
    bound_to = getattr(obj, "__self__", None)
    if bound_to is not None and not isinstance(bound_to, type) and type(bound_to).__name__ != "module":
        return f"{qualname} is a method bound to a {type(bound_to).__name__} instance (it carries state)"
    if "<lambda>" in qualname:
        return f"{qualname} is a lambda"
    if "<locals>" in qualname:
        return f"{qualname} is defined inside a function (<locals> closure)"
    module = getattr(obj, "__module__", None)
    if module is None or module == "__main__":
        return f"{qualname} is defined in __main__, which the worker cannot import"
    return None


def fn_for(fn: Callable[..., Any], transport: str = "auto") -> FnRecord:
    """The ``fn`` record for ``fn``: ``auto`` pickles exactly what cannot travel by reference."""
    if transport not in TRANSPORTS:
        raise TransportError(f"unknown transport {transport!r}: use 'auto', 'ref' or 'pickle'")
    if not callable(fn):
        raise TransportError(f"cannot ship {type(fn).__name__} object: it is not callable")
    target = _underlying(fn)
    why = _not_importable(target)
    if transport == "pickle" or (transport == "auto" and why is not None):
        return _pickle_record(target)
    if why is not None:
        raise TransportError(
            f"cannot ship {why} by reference: the worker imports functions by module and qualname. "
            "Move it to module level in an importable module, or use transport='pickle' (or 'auto') "
            "on a worker started with --allow-pickled"
        )
    module, qualname = target.__module__, target.__qualname__
    loaded = sys.modules.get(module)
    if loaded is not None:
        try:
            _getattr_chain(loaded, qualname)
        except AttributeError as exc:
            raise TransportError(
                f"cannot ship {module}.{qualname} by reference: the module has no attribute at that "
                "qualname (was the name rebound or deleted?). Keep the function reachable under its "
                "own name, or use transport='pickle'"
            ) from exc
    return {"kind": "ref", "module": module, "qualname": qualname, "src_hash": src_hash(target)}


def runtime_info() -> dict[str, Any]:
    """The runtime record a pickle carries: python, impl, cloudpickle, pickle_protocol, platform."""
    import platform

    import cloudpickle

    return {
        "python": platform.python_version(),
        "impl": sys.implementation.name,
        "cloudpickle": cloudpickle.__version__,
        "pickle_protocol": cloudpickle.DEFAULT_PROTOCOL,
        "platform": f"{sys.platform}-{platform.machine()}",
    }


def _pickle_record(obj: Any) -> FnRecord:
    import inspect

    import cloudpickle

    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(qualname, str):
        qualname = type(obj).__qualname__
    source: str | None = None
    where = f"{qualname} (<unknown>)"
    for candidate in (obj, type(obj)):
        try:
            source = inspect.getsource(candidate)
            lines = inspect.getsourcelines(candidate)[1]
            where = f"{qualname} ({inspect.getsourcefile(candidate)}:{lines})"
            break
        except (OSError, TypeError):
            continue
    runtime = runtime_info()
    try:
        blob = cloudpickle.dumps(obj, protocol=runtime["pickle_protocol"])
    except Exception as exc:
        raise TransportError(
            f"cannot pickle {where}: {exc}. Pass unpicklable state (locks, sockets, clients) as "
            "arguments or build it inside the function"
        ) from exc
    if len(blob) > INLINE_PICKLE_LIMIT:
        raise TransportError(
            f"pickled {where} is {len(blob)} bytes, over the {INLINE_PICKLE_LIMIT}-byte (32 KiB) inline "
            "limit: that is captured state (closure variables, globals or defaults the function drags "
            "along). Pass the data as arguments instead"
        )
    return {
        "kind": "pickle",
        "blob": blob,
        "hash": "sha256:" + _sha256_hex(blob),
        "source": source,
        "qualname": qualname,
        "where": where,
        "runtime": runtime,
    }
