"""The function author's surface: ``@udf``, :class:`UDF`, :class:`Thunk`, ``scope`` and ``run``.

A decorated function stays an ordinary function locally: calling it runs it in this process and
builds no Envelope. Whether the function is a generator function is decided once, at decoration: a
call returns a value or a lazy iterator; a generator call runs nothing until it is pulled.

Run context. Every call carries a small, immutable :class:`RunState` in a context variable: the
invocation id (``None`` for a local call outside any invocation), the key prefix built by
``scope`` blocks, and the name of the UDF whose body is executing. For a generator call the state
lives in a private :class:`contextvars.Context` captured at call time, and that context is entered
only around each ``next()`` / ``send()`` / ``throw()`` / ``close()`` (and the close of a generator
dropped mid-iteration): a ``scope`` opened inside the body never leaks into the consumer between
two pulls, and a scope the consumer opens later does not reach into the body.

``run`` (exported as ``dls.run``) reads that state:

* ``run.id`` -- the invocation id inside a remote invocation (worker or entry), else ``None``.
* ``run.prefix`` -- the current key prefix: the submitter's ``scope`` prefix carried by the
  Envelope, joined with every ``scope`` opened since; ``""`` when there is none.
* ``run.key(name)`` -- ``"<prefix>/<name>"`` (just ``name`` without a prefix): the one way a body
  names the objects it writes, so the same code writes under ``scenes/0007/...`` when submitted
  inside ``dls.scope("scenes/0007")`` and at the top level otherwise.
* ``run.name`` -- the qualified name of the UDF body executing, else ``None``.

``.submit()`` sends a call to a dispatch plane (``.call()`` sends it and waits for its value: one
request over HTTP): the ``_dispatch`` argument, else the plane given to
``@udf(dispatch=...)``, else the process default of :func:`set_default_dispatch`, else an
``HttpDispatch(url, token)`` built once from ``LAKESHORE_URL`` / ``LAKESHORE_TOKEN`` or the config
file (``dreamlake.lakeshore.settings``). Nothing else is built implicitly.

This module is what a user's module imports inside a sandbox, so it is part of the entry bundle
(Python >= 3.9, only msgpack present) and kept lean: no ``typing``, ``dataclasses``, ``inspect`` or
``logging`` at import; the Envelope, the planes and their HTTP client load on first use.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import types
from collections import namedtuple
from collections.abc import Generator, Mapping

from dreamlake.lakeshore.default_dispatch import get_default_dispatch as get_default_dispatch
from dreamlake.lakeshore.default_dispatch import set_default_dispatch as set_default_dispatch
from dreamlake.lakeshore.errors import PlaneError, Unavailable

TYPE_CHECKING = False  # typing, dataclasses, inspect and logging cost every invocation's start-up
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from typing import Any, NamedTuple, overload

    from dreamlake.lakeshore.dispatch import Plane
    from dreamlake.lakeshore.envelope import Envelope
    from dreamlake.lakeshore.handles import Invocation

__all__ = [
    "UDF",
    "Calls",
    "RunState",
    "Thunk",
    "get_default_dispatch",
    "invocation_context",
    "run",
    "scope",
    "set_default_code",
    "set_default_dispatch",
    "submit_all",
    "udf",
]

TRANSPORTS = ("auto", "ref", "pickle")
DEFAULT_QUEUE = "default"
MAP_CHUNK = 500  # calls of a map built and sent together (one submit-batch request over HTTP)
_CO_GENERATOR = 0x20
_CO_COROUTINE = 0x80
_CO_ASYNC_GENERATOR = 0x200


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
    fn = envelope.fn if isinstance(envelope.fn, dict) else {}
    state = RunState(id=envelope.id, prefix=envelope.prefix or "", name=fn.get("qualname"))
    token = _STATE.set(state)
    try:
        yield state
    finally:
        _STATE.reset(token)


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


# --- UDF and Thunk --------------------------------------------------------------------------------


def _check_queue(queue: object) -> str:
    if not isinstance(queue, str) or not queue:
        raise ValueError(f"queue must be a non-empty str like 'gpu', got {queue!r}")
    return queue


def _check_priority(priority: object) -> float:
    if isinstance(priority, bool) or not isinstance(priority, (int, float)) or not math.isfinite(priority):
        raise ValueError(f"priority must be a finite number (higher runs first), got {priority!r}")
    return float(priority)


def _check_key(key: object) -> str | None:
    if key is not None and (not isinstance(key, str) or not key):
        raise ValueError(f"key (the idempotency key) must be a non-empty str or None, got {key!r}")
    return key


def _code_flags(fn: object) -> int:
    """The code flags of ``fn`` (0 for a callable that is not a function): bound methods and
    partials unwrap, as ``inspect.isgeneratorfunction`` would, without importing inspect."""
    while True:
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif isinstance(fn, types.MethodType):
            fn = fn.__func__
        else:
            break
    return fn.__code__.co_flags if isinstance(fn, types.FunctionType) else 0


def _is_generator_function(fn: object) -> bool:
    return bool(_code_flags(fn) & _CO_GENERATOR)


def check_async_plane(udf: UDF, plane: Plane) -> None:
    """TypeError when ``udf`` is an ``async def`` and ``plane`` cannot run one (a plane says it
    can with ``runs_async = True``: both of the SDK's planes, and every runner of nymph)."""
    if udf.is_async and not plane.runs_async:
        raise TypeError(
            f"{udf.__qualname__} is an async def, and the plane {plane!r} cannot run one (it does "
            "not declare runs_async = True): use Dispatch or HttpDispatch, or make it a plain def"
        )


if TYPE_CHECKING:

    class _ThunkFields(NamedTuple):
        udf: UDF
        args: tuple[Any, ...]
        kwargs: dict[str, Any]
        queue: str
        priority: float
        key: str | None
        prefix: str
        parent: str | None
        code: Any = _INHERIT
        selector: dict[str, str] | None = None
        not_before: float | None = None
        env: dict[str, str] | None = None

else:
    _ThunkFields = namedtuple(
        "_ThunkFields",
        (
            "udf",
            "args",
            "kwargs",
            "queue",
            "priority",
            "key",
            "prefix",
            "parent",
            "code",
            "selector",
            "not_before",
            "env",
        ),
        defaults=(_INHERIT, None, None, None),
    )


def _check_selector(selector: Any) -> dict[str, str] | None:
    if selector is None:
        return None
    if not isinstance(selector, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in selector.items()
    ):
        raise ValueError(
            f"selector must map label names to values, e.g. {{'pool': 'a'}}; got {selector!r:.60}"
        )
    return dict(selector)


def _check_not_before(when: Any) -> float | None:
    """``_not_before``: a datetime (naive: local time) or seconds from now, as epoch seconds."""
    import datetime
    import time

    if when is None:
        return None
    if isinstance(when, datetime.datetime):
        return when.timestamp()
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not when == when:
        raise ValueError(f"_not_before must be a datetime or seconds from now, got {when!r:.40}")
    return time.time() + float(when)


class Thunk(_ThunkFields):
    """A call captured but not sent: ``to_envelope()`` builds the Envelope, ``submit()`` sends it.

    Immutable; fields ``udf, args, kwargs, queue, priority, key, prefix, parent, code`` (``parent`` is
    the invocation the call was captured in, ``None`` outside one; ``code`` what the call ships: the
    udf's ``code=``, else the innermost ``scope(code=...)`` at capture, else the process default)."""

    __slots__ = ()

    def run_config(self) -> dict[str, Any]:
        """The Submit ``run_config``: queue, priority, key, plus prefix and the UDF's options."""
        cfg: dict[str, Any] = dict(self.udf.options)
        cfg.update({"queue": self.queue, "priority": self.priority, "key": self.key})
        if self.prefix:
            cfg["prefix"] = self.prefix
        if self.selector is not None:
            cfg["selector"] = self.selector
        if self.not_before is not None:
            cfg["not_before"] = self.not_before
        if self.env:  # per call _env= over the udf's env=
            cfg["env"] = {**(cfg.get("env") or {}), **self.env}
        return cfg

    def code_record(self, dispatch: Plane | None = None) -> dict[str, Any] | None:
        """The ``cfg["code"]`` record of this call's code archive, None when none ships
        (``dispatch``: the plane whose payload store takes a large one)."""
        from dreamlake.lakeshore import codeship

        return codeship.code_record(
            self.udf, codeship.default_code() if self.code == _INHERIT else self.code, dispatch
        )

    def to_envelope(self, dispatch: Plane | None = None, *, record: Any = _INHERIT) -> Envelope:
        """The Envelope of this call (a fresh invocation id each time), with ``cfg["code"]`` when a
        code archive ships (``dispatch``: the plane whose payload store takes a large one;
        ``record``: :meth:`code_record`, when the caller made it already)."""
        from dreamlake.lakeshore.envelope import Envelope, fn_for

        if record is _INHERIT:
            record = self.code_record(dispatch)
        return Envelope.create(
            fn_for(self.udf, self.udf.transport),
            self.args,
            self.kwargs,
            prefix=self.prefix,
            key=self.key,
            cfg=_cfg(self.udf, record),
            parent=self.parent,
        )

    def submit(self, dispatch: Plane | None = None) -> Invocation:
        """Send the call; returns its handle, the invocation id (the existing one when ``key``
        matched)."""
        from dreamlake.lakeshore.handles import Invocation

        plane = dispatch or self.udf.dispatch or get_default_dispatch()
        check_async_plane(self.udf, plane)
        envelope = self.to_envelope(plane)
        _warn_if_pickled(plane, envelope.fn, self.queue, self.udf)
        # The plane takes the Envelope itself: HttpDispatch streams a big one to the payload store
        # from its parts, so the arguments are never copied a second time.
        inv = str(plane.submit(envelope, self.queue, self.run_config(), self.parent))
        import logging

        logging.getLogger(__name__).debug(
            "submitted %s to queue %s as %s", self.udf.__qualname__, self.queue, inv
        )
        return Invocation(inv, plane, self.queue)

    def call(self, dispatch: Plane | None = None, timeout: float = 60.0) -> Any:
        """Send the call and wait for its value (DispatchError when it failed, TimeoutError when
        still pending after ``timeout`` s). Over HTTP, submit and wait are one request."""
        from dreamlake.lakeshore.queue import SyncQueue

        plane = dispatch or self.udf.dispatch or get_default_dispatch()
        check_async_plane(self.udf, plane)
        envelope = self.to_envelope(plane)
        _warn_if_pickled(plane, envelope.fn, self.queue, self.udf)
        q = SyncQueue(self.queue, dispatch=plane)
        return q.call(envelope, self.run_config(), self.parent, timeout)


class UDF:
    """A function decorated with ``@dls.udf``: call it locally, or ``submit()`` it to a plane."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        queue: str = DEFAULT_QUEUE,
        transport: str = "auto",
        priority: float = 0,
        key: str | None = None,
        timeout_s: float | None = None,
        max_attempts: int | None = None,
        retry_on: tuple[type[BaseException] | str, ...] | None = None,
        backoff_s: float | None = None,
        resumable: bool = False,
        dispatch: Plane | None = None,
        code: Any = _INHERIT,
        pip: Any = None,
        requirements: Any = None,
        env: Mapping[str, str] | None = None,
        secrets: Any = None,
        mounts: Any = None,
        **options: Any,
    ) -> None:
        from dreamlake.lakeshore import runenv

        if not callable(fn):
            raise TypeError(f"@dls.udf decorates a function, got {type(fn).__name__}")
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {transport!r}: use 'auto', 'ref' or 'pickle'")
        if timeout_s is not None and (
            isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0
        ):
            raise ValueError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")
        if max_attempts is not None and (
            isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1
        ):
            raise ValueError(f"max_attempts must be an int >= 1 or None, got {max_attempts!r}")
        functools.update_wrapper(self, fn)
        self.__qualname__: str = getattr(fn, "__qualname__", type(fn).__qualname__)
        self.__lakeshore_fn__ = fn
        flags = _code_flags(fn)
        # an async def runs to completion on the worker (asyncio.run); an async generator streams
        self.is_async = bool(flags & (_CO_COROUTINE | _CO_ASYNC_GENERATOR))
        self.is_generator = bool(flags & (_CO_GENERATOR | _CO_ASYNC_GENERATOR))
        self.queue = _check_queue(queue)
        self.transport = transport
        self.priority = _check_priority(priority)
        self.key = _check_key(key)
        self.dispatch = dispatch
        if dispatch is not None:
            check_async_plane(self, dispatch)  # refused here, at decoration, not on the worker
        self.code = _check_code(code)  # "auto", None, paths, or _INHERIT: the scope's or the default
        self.options: dict[str, Any] = dict(options)
        # what the call's environment needs (docs/nymph.md "Environments"): the pip environment
        # rides in the Envelope's cfg, the rest (names and plain values, never a secret's) in run_config
        self.pip = runenv.pip_record(pip, requirements)
        if env is not None:
            self.options["env"] = runenv.user_env(env, "env")
        if secrets is not None:
            self.options["secrets"] = runenv.secret_names(secrets, "secrets")
        if mounts is not None:
            self.options["mounts"] = runenv.names(mounts, "mounts")
        if "selector" in self.options:
            self.options["selector"] = _check_selector(self.options["selector"])
        if timeout_s is not None:
            self.options["timeout_s"] = float(timeout_s)
        if max_attempts is not None:
            self.options["max_attempts"] = max_attempts
        if retry_on is not None:
            self.options["retry_on"] = _retry_names(retry_on)
        if backoff_s is not None:
            if isinstance(backoff_s, bool) or not isinstance(backoff_s, (int, float)) or not backoff_s >= 0:
                raise ValueError(f"backoff_s must be a number of seconds >= 0, got {backoff_s!r}")
            self.options["backoff_s"] = float(backoff_s)
        if resumable:  # a deterministic generator: a new attempt continues its stream
            self.options["resumable"] = True
        self._two_way(fn)

    def _two_way(self, fn: Callable[..., Any]) -> None:
        """``options["two_way"]`` for a generator body that reads what is sent into it (twoway.py),
        unless ``two_way=False`` said otherwise; ``send_timeout_s`` checked."""
        from dreamlake.lakeshore import twoway

        two_way = self.options.pop("two_way", None)
        if two_way is not None and not isinstance(two_way, bool):
            raise ValueError(f"two_way must be True, False or None (decided from the body), got {two_way!r}")
        if two_way and not self.is_generator:
            raise ValueError(f"two_way=True needs a generator body; {self.__qualname__} is a plain function")
        if two_way is None:
            two_way = self.is_generator and twoway.takes_sends(fn)
        if two_way:
            self.options["two_way"] = True
        timeout = self.options.get("send_timeout_s")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
        ):
            raise ValueError(f"send_timeout_s must be a positive number of seconds, got {timeout!r}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run locally. A generator body returns a lazy iterator; nothing runs until pulled."""
        fn = self.__lakeshore_fn__
        if self.is_async:  # a coroutine or an async generator, as the plain function returns it
            return fn(*args, **kwargs)
        if self.is_generator:
            return LocalGenerator(fn, self.__qualname__, args, kwargs)
        token = _STATE.set(_STATE.get()._replace(name=self.__qualname__))
        try:
            return fn(*args, **kwargs)
        finally:
            _STATE.reset(token)

    def thunk(
        self,
        *args: Any,
        _queue: str | None = None,
        _priority: float | None = None,
        _key: str | None = None,
        _selector: dict[str, str] | None = None,
        _not_before: Any = None,
        _env: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> Thunk:
        """Capture a call (and the current ``scope`` prefix and parent invocation) without sending.
        ``_selector``: labels the nymph must have (over the udf's ``selector``); ``_not_before``: a
        datetime, or seconds from now, before which the call is not claimed; ``_env``: environment
        variables of this call, over the udf's ``env``."""
        state = _STATE.get()
        if _env is not None:
            from dreamlake.lakeshore import runenv

            _env = runenv.user_env(_env, "_env")
        return Thunk(
            udf=self,
            args=args,
            kwargs=kwargs,
            queue=_check_queue(_queue) if _queue is not None else self.queue,
            priority=_check_priority(_priority) if _priority is not None else self.priority,
            key=_check_key(_key) if _key is not None else self.key,
            prefix=state.prefix,
            parent=state.id,
            code=self.code if self.code != _INHERIT else _CODE.get(),
            selector=_check_selector(_selector),
            not_before=_check_not_before(_not_before),
            env=_env or None,
        )

    def submit(
        self,
        *args: Any,
        _dispatch: Plane | None = None,
        _queue: str | None = None,
        _priority: float | None = None,
        _key: str | None = None,
        _selector: dict[str, str] | None = None,
        _not_before: Any = None,
        _env: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> Invocation:
        """Send a call to a plane; returns its :class:`~dreamlake.lakeshore.handles.Invocation`:
        the invocation id (a ULID ``str``) with ``.result()``, ``.stream()``, ``.logs()``,
        ``.status()`` and ``.cancel()``. ``_selector``, ``_not_before`` and ``_env`` as :meth:`thunk`'s."""
        thunk = self.thunk(
            *args,
            _queue=_queue,
            _priority=_priority,
            _key=_key,
            _selector=_selector,
            _not_before=_not_before,
            _env=_env,
            **kwargs,
        )
        return thunk.submit(_dispatch)

    async def submit_async(self, *args: Any, **kwargs: Any) -> Invocation:
        """``await f.submit_async(...)``: :meth:`submit` without blocking the event loop."""
        import asyncio

        return await asyncio.to_thread(functools.partial(self.submit, *args, **kwargs))

    async def call_async(self, *args: Any, **kwargs: Any) -> Any:
        """``await f.call_async(...)``: :meth:`call` without blocking the event loop (the same
        client, in a worker thread)."""
        import asyncio

        return await asyncio.to_thread(functools.partial(self.call, *args, **kwargs))

    def map(
        self,
        *iterables: Any,
        _dispatch: Plane | None = None,
        _queue: str | None = None,
        _priority: float | None = None,
        _selector: dict[str, str] | None = None,
        _not_before: Any = None,
    ) -> Calls:
        """Submit one call per element, as the builtin ``map`` would call: ``f.map(xs)`` calls
        ``f(x)`` for each ``x``, ``f.map(xs, ys)`` calls ``f(x, y)`` (shortest input wins).

        The calls go in batches of ``MAP_CHUNK`` (over HTTP one request and one transaction each:
        a sweep of 100,000 calls is 200 requests, not 100,000), each call with its own invocation
        id. Returns :class:`Calls`: the ids in input order (use them as ``submit()``'s: status,
        ``SyncQueue.result`` / ``stream``, cancel) with ``results()`` to collect the values. When
        a call is refused (or a batch stays unanswered past the retry window) the map stops after
        that batch and raises that call's error, with ``invocation_ids`` holding every id sent
        (None where refused, not stored; an unanswered call's id is kept: ask its status)."""
        if not iterables:
            raise TypeError("map() needs at least one iterable of arguments, e.g. f.map(range(10))")
        pairs = zip(*iterables)  # noqa: B905 (the builtin map stops at the shortest; Python 3.9 has no strict)
        return self.starmap(
            pairs,
            _dispatch=_dispatch,
            _queue=_queue,
            _priority=_priority,
            _selector=_selector,
            _not_before=_not_before,
        )

    def starmap(
        self,
        iterable: Any,
        *,
        _dispatch: Plane | None = None,
        _queue: str | None = None,
        _priority: float | None = None,
        _selector: dict[str, str] | None = None,
        _not_before: Any = None,
    ) -> Calls:
        """:meth:`map` of argument tuples: ``f.starmap([(1, 2), (3, 4)])`` calls ``f(1, 2)`` and
        ``f(3, 4)``."""
        if self.key is not None:
            raise ValueError(
                f"{self.__qualname__} has key={self.key!r}: every call of a map would be the same "
                "(idempotent) call. Give each call its own key: "
                "dls.submit_all(f.thunk(x, _key=f'...{x}') for x in xs)"
            )
        template = self.thunk(
            _queue=_queue, _priority=_priority, _selector=_selector, _not_before=_not_before
        )
        plane = _dispatch or self.dispatch or get_default_dispatch()
        check_async_plane(self, plane)
        return _submit_calls(plane, template, (tuple(args) for args in iterable))

    def call(
        self,
        *args: Any,
        _dispatch: Plane | None = None,
        _queue: str | None = None,
        _priority: float | None = None,
        _key: str | None = None,
        _timeout: float = 60.0,
        _selector: dict[str, str] | None = None,
        _not_before: Any = None,
        _env: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Send a call to a plane and wait for its value (a generator's: its return value); over
        HTTP one request submits and waits (the warm path's short calls)."""
        thunk = self.thunk(
            *args,
            _queue=_queue,
            _priority=_priority,
            _key=_key,
            _selector=_selector,
            _not_before=_not_before,
            _env=_env,
            **kwargs,
        )
        return thunk.call(_dispatch, _timeout)

    def __repr__(self) -> str:
        kind = "generator " if self.is_generator else ""
        return f"<dls.udf {kind}{self.__module__}.{self.__qualname__} queue={self.queue!r}>"


class Calls(list):  # type: ignore[type-arg]  # list[Invocation], subclassed at runtime on Python 3.9
    """The calls of a :meth:`UDF.map` (or :func:`submit_all`), in input order: a list of
    :class:`~dreamlake.lakeshore.handles.Invocation` s (invocation ids, as ``submit()`` returns
    them one by one; None where a call was refused), and the plane they went to."""

    def __init__(self, ids: Any = (), dispatch: Plane | None = None) -> None:
        super().__init__(ids)
        self.dispatch = dispatch

    def results(
        self, timeout: float = 60.0, *, return_exceptions: bool = False, progress: bool | str = False
    ) -> Iterator[Any]:
        """Each call's value, in input order (``timeout`` is the wait for the next one;
        TimeoutError past it). The outcomes are read in batches of up to 1,000 calls per request
        (``dls.as_completed`` has them in the order they end). A failed call raises its
        DispatchError, or with ``return_exceptions`` is yielded as it, in its place.
        ``progress``: a bar with done / failed / running counts (True: tqdm, rich or text)."""
        from dreamlake.lakeshore.handles import handles, results_in_order

        return results_in_order(handles(self, self.dispatch), timeout, return_exceptions, progress)


def submit_all(thunks: Any, dispatch: Plane | None = None) -> Calls:
    """Submit many captured calls (``f.thunk(...)``, of any udfs) together: in batches of
    ``MAP_CHUNK`` as :meth:`UDF.map` does, each call with its own queue, priority, key and code.
    Returns :class:`Calls`; a refusal raises as in :meth:`UDF.map`. ``dispatch``: the plane for
    every call, else each udf's own, else the default."""
    out = Calls(dispatch=dispatch)
    chunk: list[tuple[Any, ...]] = []
    plane: Plane | None = None
    # one code record per (udf, code, plane), each a walk of the shipped files; the udf and the
    # plane are kept beside it, so their ids stay theirs
    records: dict[tuple[int, Any, int], tuple[Any, Any, Any]] = {}
    for thunk in thunks:
        target = dispatch or thunk.udf.dispatch or get_default_dispatch()
        check_async_plane(thunk.udf, target)
        if plane is not None and chunk and (target is not plane or len(chunk) >= MAP_CHUNK):
            _send(plane, chunk, out)
            chunk = []
        plane = out.dispatch = target
        mine = (id(thunk.udf), thunk.code, id(target))
        if mine not in records:
            records[mine] = (thunk.udf, target, thunk.code_record(target))
        envelope = thunk.to_envelope(target, record=records[mine][2])
        _warn_if_pickled(target, envelope.fn, thunk.queue, thunk.udf)
        chunk.append((envelope, thunk.queue, thunk.run_config(), thunk.parent))
    if plane is not None and chunk:
        _send(plane, chunk, out)
    return out


def _submit_calls(plane: Plane, template: Thunk, args_of: Any) -> Calls:
    """The calls of a map: ``template`` (a thunk without arguments) with each tuple of
    ``args_of``; the function record and the code archive are made once for all of them."""
    from dreamlake.lakeshore.envelope import Envelope, fn_for

    udf = template.udf
    record = template.code_record(plane)
    fn = fn_for(udf, udf.transport)
    _warn_if_pickled(plane, fn, template.queue, udf)
    cfg = _cfg(udf, record)
    from dreamlake.lakeshore.ids import new_ulid

    # one id for the calls of this map: the dashboard shows them as one group with its progress
    run_config = {**template.run_config(), "sweep": new_ulid()}
    out = Calls(dispatch=plane)
    chunk: list[tuple[Any, ...]] = []
    for args in args_of:
        envelope = Envelope.create(fn, args, prefix=template.prefix, cfg=cfg, parent=template.parent)
        chunk.append((envelope, template.queue, run_config, template.parent))
        if len(chunk) >= MAP_CHUNK:
            _send(plane, chunk, out)
            chunk = []
    if chunk:
        _send(plane, chunk, out)
    return out


def _send(plane: Plane, chunk: list[tuple[Any, ...]], out: Calls) -> None:
    """Submit ``chunk`` (``(envelope, queue, run_config, parent)`` each) to ``plane`` in one batch
    (``Plane.submit_batch``: one call each on a plane that keeps the default); the ids onto ``out``,
    or raise the first refusal (see :meth:`UDF.map`)."""
    results = plane.submit_batch(chunk)
    from dreamlake.lakeshore.handles import Invocation

    first = None
    start = len(out)
    for got, call in zip(results, chunk):  # noqa: B905 (Python 3.9 has no strict; one result per call)
        if isinstance(got, PlaneError):
            first = first or (len(out), got)
            # unanswered (the retry window ran out): perhaps stored, so its id stays for a status
            kept = got.invocation_id if isinstance(got, Unavailable) else None
            out.append(Invocation(kept, plane, call[1]) if kept else None)
        else:
            out.append(Invocation(got, plane, call[1]))
    if first is None:
        return
    index, err = first
    refused = sum(1 for x in out[start:] if x is None)
    new = type(err)(
        f"call {index} of the map (invocation {err.invocation_id}) failed: {err}. "
        f"{refused} of the {len(chunk)} calls of its batch were refused; the others, and every "
        "call before the batch, were submitted (or, unanswered, perhaps stored: ask their status): "
        "exc.invocation_ids holds their ids in input order (None: refused, not stored)",
        err.status,
    )
    new.invocation_id = err.invocation_id
    new.invocation_ids = list(out)
    raise new


def _warn_if_pickled(plane: Plane, fn: Any, queue: str, udf: UDF) -> None:
    """A pickled call: the plane warns when it knows the queue's workers refuse pickles."""
    if isinstance(fn, dict) and fn.get("kind") == "pickle":
        plane.warn_if_pickles_refused(queue, udf.__qualname__)


def _cfg(udf: UDF, record: Any) -> dict[str, Any] | None:
    """The Envelope's ``cfg``: the code archive's record and the pip environment, when there are."""
    cfg: dict[str, Any] = {}
    if record is not None:
        cfg["code"] = record
    if udf.pip is not None:
        cfg["pip"] = udf.pip
    return cfg or None


def _retry_names(retry_on: Any) -> list[str]:
    """``retry_on`` (exception classes or their names) as the names run_config carries: the
    control plane matches them against the failure's type and its base classes."""
    if isinstance(retry_on, (str, type)):
        retry_on = (retry_on,)
    names: list[str] = []
    for item in retry_on:
        if isinstance(item, type) and issubclass(item, BaseException):
            names.append(item.__name__)
        elif isinstance(item, str) and item:
            names.append(item)
        else:
            raise ValueError(
                f"retry_on takes exception classes or their names, e.g. (TimeoutError, 'Timeout'), got {item!r}"
            )
    return names


if TYPE_CHECKING:

    @overload
    def udf(fn: Callable[..., Any], /) -> UDF: ...
    @overload
    def udf(
        *,
        queue: str = ...,
        transport: str = ...,
        priority: float = ...,
        key: str | None = ...,
        timeout_s: float | None = ...,
        max_attempts: int | None = ...,
        retry_on: tuple[type[BaseException] | str, ...] | None = ...,
        backoff_s: float | None = ...,
        resumable: bool = ...,
        dispatch: Plane | None = ...,
        code: Any = ...,
        pip: Any = ...,
        requirements: Any = ...,
        env: Mapping[str, str] | None = ...,
        secrets: Any = ...,
        mounts: Any = ...,
        **options: Any,
    ) -> Callable[[Callable[..., Any]], UDF]: ...


def udf(fn: Callable[..., Any] | None = None, /, **config: Any) -> Any:
    """``@dls.udf`` or ``@dls.udf(queue=..., transport=..., priority=..., key=..., timeout_s=...,
    max_attempts=..., retry_on=..., backoff_s=..., resumable=..., dispatch=..., code=...,
    **run_config)``: wrap a plain or generator function.

    ``max_attempts`` bounds the attempts; a failure queues another one (after ``backoff_s * 2**(n-1)``
    seconds) when its exception is one of ``retry_on`` (classes or names; base classes match too),
    or when the task's process died. docs/protocol.md "Retries" says what retries and what never.
    A generator's new attempt restarts its stream (``StreamRestarted``); ``resumable=True`` declares
    it deterministic, and the new attempt continues the stream where the journal stands instead.
    A generator whose ``yield`` expressions are used (``x = yield v``) is two-way: a remote
    consumer's ``stream.send(value)`` reaches it (``two_way=`` overrides the detection;
    ``send_timeout_s`` bounds each wait, see :mod:`dreamlake.lakeshore.twoway`).

    ``code`` is what a submitted call ships with it: ``"auto"`` (the default) the local,
    non-installed package the function comes from, a list of paths those, ``None`` nothing (see
    :mod:`dreamlake.lakeshore.codeship`).

    The call's environment (docs/nymph.md "Environments"): ``pip=["numpy==2.1.*"]`` or
    ``requirements="reqs.txt"`` (a requirements file, a ``pylock.toml`` or a ``uv.lock``) is built
    once per lock on each worker; ``env={"OMP_NUM_THREADS": "4"}`` (per call ``_env=``) are
    variables; ``secrets=["HF_TOKEN"]`` puts this namespace's secret of that name in the task's
    environment (``lakeshore secret set``); ``mounts=["datasets"]`` asks for a directory the
    worker's operator offers (``nymph start --mount datasets=/srv/datasets:ro``).

    Extra keywords (``image``, ``resources``, ``network``, ...) ride in the Submit ``run_config``.
    """
    if fn is not None:
        if config:
            raise TypeError("use either @dls.udf or @dls.udf(queue=...), not both")
        return UDF(fn)

    def decorate(f: Callable[..., Any]) -> UDF:
        return UDF(f, **config)

    return decorate
