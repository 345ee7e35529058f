"""Sending calls: a call's routing options checked, and calls submitted in batches.

:meth:`UDF.map` and :func:`submit_all` build their Envelopes in chunks of :data:`MAP_CHUNK` and
hand each chunk to the plane's ``submit_batch`` (over HTTP one request and one transaction);
:class:`Calls` is what they return. The checks here are those of the options a call is routed by
(queue, priority, idempotency key, selector, not-before, retry_on, the plane's async support),
shared by ``@udf(...)`` and a call's ``_queue=``-style overrides (``decorator``).

Part of the entry bundle (Python >= 3.9) and kept lean, as ``decorator`` is.
"""

from __future__ import annotations

import math

from dreamlake.lakeshore.default_dispatch import get_default_dispatch
from dreamlake.lakeshore.errors import PlaneError, Unavailable
from dreamlake.lakeshore.labels import label_problem

TYPE_CHECKING = False  # typing costs every invocation's start-up
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any

    from dreamlake.lakeshore.dispatch import Plane

__all__ = ["MAP_CHUNK", "Calls", "check_async_plane", "submit_all"]

MAP_CHUNK = 500  # calls of a map built and sent together (one submit-batch request over HTTP)


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


def check_async_plane(udf: Any, plane: Plane) -> None:
    """TypeError when ``udf`` is an ``async def`` and ``plane`` cannot run one (a plane says it
    can with ``runs_async = True``: both of the SDK's planes, and every runner of nymph)."""
    if udf.is_async and not plane.runs_async:
        raise TypeError(
            f"{udf.__qualname__} is an async def, and the plane {plane!r} cannot run one (it does "
            "not declare runs_async = True): use Dispatch or HttpDispatch, or make it a plain def"
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
    for name, value in selector.items():  # one no nymph's label could be would wait for ever
        refused = label_problem(name, value, "selector")
        if refused is not None:
            raise ValueError(refused)
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


def _submit_calls(plane: Plane, template: Any, args_of: Any) -> Calls:
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


def _warn_if_pickled(plane: Plane, fn: Any, queue: str, udf: Any) -> None:
    """A pickled call: the plane warns when it knows the queue's workers refuse pickles."""
    if isinstance(fn, dict) and fn.get("kind") == "pickle":
        plane.warn_if_pickles_refused(queue, udf.__qualname__)


def _cfg(udf: Any, record: Any) -> dict[str, Any] | None:
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
