"""The function author's surface: ``@udf``, :class:`UDF`, :class:`Thunk`, ``scope`` and ``run``.

A decorated function stays an ordinary function locally: calling it runs it in this process and
builds no Envelope. Whether the function is a generator function is decided once, at decoration: a
call returns a value or a lazy iterator; a generator call runs nothing until it is pulled.

Run context and key scopes (``scope``, ``run``, :class:`RunState`) are :mod:`.scopes`; sending
calls in batches (``UDF.map``, ``submit_all``, :class:`Calls`) and the checks of a call's routing
options are :mod:`.calls`. Both are re-exported here under their old names.

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

import functools
import types
from collections import namedtuple
from collections.abc import Mapping

from dreamlake.lakeshore.calls import (
    Calls,
    _cfg,
    _check_key,
    _check_not_before,
    _check_priority,
    _check_queue,
    _check_selector,
    _retry_names,
    _submit_calls,
    _warn_if_pickled,
    check_async_plane,
    submit_all,
)
from dreamlake.lakeshore.default_dispatch import get_default_dispatch as get_default_dispatch
from dreamlake.lakeshore.default_dispatch import set_default_dispatch as set_default_dispatch
from dreamlake.lakeshore.scopes import (
    _CODE,
    _INHERIT,
    _STATE,
    LocalGenerator,
    RunState,
    _check_code,
    invocation_context,
    run,
    scope,
    set_default_code,
)

TYPE_CHECKING = False  # typing, dataclasses, inspect and logging cost every invocation's start-up
if TYPE_CHECKING:
    from collections.abc import Callable
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
_CO_GENERATOR = 0x20
_CO_COROUTINE = 0x80
_CO_ASYNC_GENERATOR = 0x200


# --- UDF and Thunk --------------------------------------------------------------------------------


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
            self.options["mounts"] = runenv.mount_names(mounts, "mounts")
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
