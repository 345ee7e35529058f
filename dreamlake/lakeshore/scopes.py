"""Run context and key scopes: ``scope``, ``run``, :class:`RunState` (re-exported by ``decorator``).

Every call carries a small, immutable :class:`RunState` in a context variable: the invocation id
(``None`` for a local call outside any invocation), the key prefix built by ``scope`` blocks, and
the name of the UDF whose body is executing. For a local generator call (:class:`LocalGenerator`)
the state lives in a private :class:`contextvars.Context` captured at call time, and that context
is entered only around each ``next()`` / ``send()`` / ``throw()`` / ``close()`` (and the close of a
generator dropped mid-iteration): a ``scope`` opened inside the body never leaks into the consumer
between two pulls, and a scope the consumer opens later does not reach into the body.

``run`` (exported as ``dls.run``) reads that state:

* ``run.id`` -- the invocation id inside a remote invocation (worker or entry), else ``None``.
* ``run.prefix`` -- the current key prefix: the submitter's ``scope`` prefix carried by the
  Envelope, joined with every ``scope`` opened since; ``""`` when there is none.
* ``run.key(name)`` -- ``"<prefix>/<name>"`` (just ``name`` without a prefix): the one way a body
  names the objects it writes, so the same code writes under ``scenes/0007/...`` when submitted
  inside ``dls.scope("scenes/0007")`` and at the top level otherwise.
* ``run.name`` -- the qualified name of the UDF body executing, else ``None``.

``scope(code=...)`` also says what the calls submitted inside it ship (``codeship``).

Part of the entry bundle (Python >= 3.9) and kept lean, as ``decorator`` is: no ``typing``,
``dataclasses``, ``inspect`` or ``logging`` at import.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import namedtuple
from collections.abc import Generator

TYPE_CHECKING = False  # typing costs every invocation's start-up
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from typing import Any, NamedTuple

    from dreamlake.lakeshore.envelope import Envelope

__all__ = [
    "LocalGenerator",
    "RunState",
    "begin_invocation",
    "end_invocation",
    "invocation_context",
    "run",
    "scope",
    "set_default_code",
]

# --- run context ----------------------------------------------------------------------------------


if TYPE_CHECKING:

    class _RunFields(NamedTuple):
        id: str | None = None
        prefix: str = ""
        name: str | None = None

else:
    _RunFields = namedtuple("_RunFields", ("id", "prefix", "name"), defaults=(None, "", None))


class RunState(_RunFields):
    """What ``dls.run`` reports: invocation id, key prefix, executing UDF name (immutable)."""

    __slots__ = ()


_STATE: contextvars.ContextVar[RunState] = contextvars.ContextVar(
    "lakeshore_run",
    default=RunState(),  # noqa: B039 (RunState is immutable)
)


def _check_segment_path(value: object, what: str) -> str:
    """A ``/``-separated relative path without empty, ``.`` or ``..`` segments."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str like 'scenes/0007', got {type(value).__name__}")
    path = value.strip("/")
    if not path:
        raise ValueError(f"{what} {value!r} is empty: pass a name like 'scenes/0007'")
    for part in path.split("/"):
        if part in ("", ".", ".."):
            raise ValueError(
                f"{what} {value!r} has an empty, '.' or '..' segment: use plain names joined by '/'"
            )
    return path


def _join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


_INHERIT = "<inherit>"  # a udf or scope that does not say what code it ships
# What the calls captured inside ``scope(code=...)`` ship, unless their udf says: "auto", None or paths.
_CODE: contextvars.ContextVar[Any] = contextvars.ContextVar("lakeshore_code", default=_INHERIT)


def _check_code(code: object) -> Any:
    if code == _INHERIT:
        return code
    from dreamlake.lakeshore.codeship import normalize_code

    return normalize_code(code)


def set_default_code(code: Any = _INHERIT) -> None:
    """The code every call ships when neither its udf nor a scope says: ``"auto"`` (the default),
    ``None`` or a list of paths (see :mod:`dreamlake.lakeshore.codeship`); no argument: back to
    ``LAKESHORE_CODE``."""
    from dreamlake.lakeshore import codeship

    if code == _INHERIT:
        codeship.set_default_code()
    else:
        codeship.set_default_code(code)


@contextlib.contextmanager
def scope(prefix: str | None = None, *, code: Any = _INHERIT) -> Iterator[str]:
    """Open a key scope: ``run.key(name)`` and submitted calls inside it resolve under ``prefix``.

    Scopes nest by joining: ``scope("scenes")`` then ``scope("0007")`` gives ``"scenes/0007"``.
    Yields the full prefix. ``code=`` (``"auto"``, ``None`` or a list of paths) is what the calls
    submitted inside ship, unless their ``@udf(code=...)`` says; ``scope(code=...)`` alone keeps
    the prefix.
    """
    state = _STATE.get()
    full = (
        state.prefix if prefix is None else _join(state.prefix, _check_segment_path(prefix, "scope prefix"))
    )
    if prefix is None and code == _INHERIT:
        raise ValueError("scope() needs a prefix like 'scenes/0007', code=..., or both")
    token = _STATE.set(state._replace(prefix=full))
    code_token = _CODE.set(_check_code(code)) if code != _INHERIT else None
    try:
        yield full
    finally:
        if code_token is not None:
            _CODE.reset(code_token)
        _STATE.reset(token)


class _Run:
    """``dls.run``: the state of the call executing now (see the module docstring)."""

    __slots__ = ()

    @property
    def id(self) -> str | None:
        """The invocation id inside a remote invocation; ``None`` for a local call."""
        return _STATE.get().id

    @property
    def prefix(self) -> str:
        """The key prefix in force: Envelope prefix joined with open ``scope`` blocks, or ``""``."""
        return _STATE.get().prefix

    @property
    def name(self) -> str | None:
        """The qualified name of the UDF whose body is executing, else ``None``."""
        return _STATE.get().name

    def key(self, name: str) -> str:
        """``"<prefix>/<name>"`` (``name`` alone without a prefix); ``name`` is a relative path."""
        return _join(_STATE.get().prefix, _check_segment_path(name, "run key"))

    def __repr__(self) -> str:
        state = _STATE.get()
        return f"<dls.run id={state.id!r} prefix={state.prefix!r} name={state.name!r}>"


run = _Run()


@contextlib.contextmanager
def invocation_context(envelope: Envelope) -> Iterator[RunState]:
    """The run state of a remote invocation, around its call (used by workers and the entry)."""
    token = begin_invocation(envelope)
    try:
        yield _STATE.get()
    finally:
        end_invocation(token)


def begin_invocation(envelope: Envelope) -> contextvars.Token[RunState]:
    """Set the run state of a remote invocation (what :func:`invocation_context` does around a
    call), for a caller that undoes it with :func:`end_invocation` in a ``finally``: the warm
    worker, once a call, without the context manager's generator machinery."""
    fn = envelope.fn if isinstance(envelope.fn, dict) else {}
    # tuple.__new__ itself: RunState(...) would run namedtuple's __new__, a Python function
    return _STATE.set(_new_tuple(RunState, (envelope.id, envelope.prefix or "", fn.get("qualname"))))


def end_invocation(token: contextvars.Token[RunState]) -> None:
    """Undo :func:`begin_invocation`."""
    _STATE.reset(token)


_new_tuple = tuple.__new__


# --- local generator calls ------------------------------------------------------------------------


if TYPE_CHECKING:
    _GeneratorBase = Generator[Any, Any, Any]
else:
    _GeneratorBase = Generator


class LocalGenerator(_GeneratorBase):
    """A local generator call: the body runs in its own context, entered only around each pull."""

    __slots__ = ("_ctx", "_gen")

    def __init__(self, fn: Callable[..., Generator[Any, Any, Any]], name: str, args: Any, kwargs: Any):
        ctx = contextvars.copy_context()
        ctx.run(_STATE.set, ctx.run(_STATE.get)._replace(name=name))
        self._ctx = ctx
        self._gen = fn(*args, **kwargs)  # creating a generator object runs none of its body

    def __iter__(self) -> LocalGenerator:
        return self

    def __next__(self) -> Any:
        return self._ctx.run(next, self._gen)

    def send(self, value: Any) -> Any:
        return self._ctx.run(self._gen.send, value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        if val is None and tb is None:
            return self._ctx.run(self._gen.throw, typ)
        return self._ctx.run(self._gen.throw, typ, val, tb)

    def close(self) -> None:
        self._ctx.run(self._gen.close)

    def __del__(self) -> None:
        # Dropped while paused: close the body here, inside its own context. Left to the body's own
        # finaliser it would run in whatever context collects it, and every ``scope`` still open in
        # the body would fail to reset its token ("created in a different Context").
        gen = getattr(self, "_gen", None)  # absent when the call itself raised
        if gen is not None and gen.gi_frame is not None and not gen.gi_running:
            self._ctx.run(gen.close)

    def __repr__(self) -> str:
        return f"<lakeshore local generator {getattr(self._gen, '__qualname__', '?')}>"
