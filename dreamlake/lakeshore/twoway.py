"""Two-way generators across the wire: a consumer's ``send()`` reaches a paused remote body.

A generator body that uses the value of its ``yield`` expressions (``loss = yield lr``) takes
sends; one whose yields are statements (``yield frame``) does not, and streams ahead as before.
:func:`takes_sends` tells them apart once, at decoration, from the body's bytecode (a ``yield``
whose value is discarded is followed by ``POP_TOP``; a ``yield from`` delegates and is not counted),
and ``@dls.udf(two_way=True | False)`` overrides it. A two-way call carries ``run_config.two_way``.

The protocol (docs/protocol.md, "Two-way streams"): each VALUE frame a two-way body yields carries
``meta.send``, its index in the attempt (0, 1, ...). The consumer answers it with a send of that
index (``POST /v1/producer/invocations/:id/send``): a value (what the ``yield`` expression
returns), a throw (the exception raised at the ``yield``) or a close (``GeneratorExit`` there).
``next()`` on the consumer's stream is ``send(None)``, as in Python. The body waits at each yield
for its answer, up to ``run_config.send_timeout_s`` (default :data:`SEND_TIMEOUT_S`), then gets
:class:`~dreamlake.lakeshore.errors.SendTimeout` raised there. :func:`drive` is that loop, shared by
the entry (answers read from ``sends.msgpack`` in the workdir, which nymph fills) and the SDK's
worker (answers read from the plane).

This module is part of the entry bundle: Python 3.9 and msgpack only.
"""

from __future__ import annotations

import builtins

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.errors import SendTimeout

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Generator

SEND_TIMEOUT_S = 600.0
SENDS_FILE = "sends.msgpack"  # in the workdir: the answers nymph fetched, one frame each
SENDS_ENV = "LAKESHORE_SENDS"  # nymph sets it for a two-way call: how long a yield waits (s)
_SKIP = frozenset({"RESUME", "CACHE", "NOP", "EXTENDED_ARG"})
_DELEGATING = frozenset({"JUMP_BACKWARD_NO_INTERRUPT", "SEND", "END_SEND", "CLEANUP_THROW"})


SEND_KINDS = {"value": wire.FRAME_VALUE, "throw": wire.FRAME_ERROR, "close": wire.FRAME_END}
MAX_THROWN_TEXT = 4096  # a thrown exception's type and message, each


def encode_send(index: int, kind: str, body: Any) -> bytes:
    """The journal frame of a send answering yield ``index``: ``value`` (``body``: the
    ``wire.pack`` of the value), ``throw`` (``body``: ``{type, message}``) or ``close`` (no body).
    ValueError naming what is wrong otherwise."""
    if kind not in SEND_KINDS:
        raise ValueError(f"a send's kind must be one of {sorted(SEND_KINDS)}, got {str(kind)[:40]!r}")
    payload: Any = {}  # a close carries nothing
    if kind == "value":
        if not isinstance(body, (bytes, bytearray)):
            raise ValueError("a sent value travels packed: body must be the bytes of wire.pack(value)")
        payload = bytes(body)
    elif kind == "throw":
        body = body if isinstance(body, dict) else {}
        payload = {}
        for key in ("type", "message"):
            text = body.get(key, "")
            if not isinstance(text, str) or len(text) > MAX_THROWN_TEXT:
                raise ValueError(
                    f"a thrown exception's {key} must be a str of at most {MAX_THROWN_TEXT} characters"
                )
            payload[key] = text
        if not payload["type"]:
            raise ValueError("a throw must name the exception type to raise in the body")
    return wire.encode_frame(SEND_KINDS[kind], index, payload, None)


def takes_sends(fn: Any) -> bool:
    """Whether the generator function ``fn`` uses the value of any of its ``yield`` expressions."""
    import dis

    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    ops = [i.opname for i in dis.get_instructions(code)]
    for at, op in enumerate(ops):
        if op != "YIELD_VALUE":
            continue
        after = next((o for o in ops[at + 1 :] if o not in _SKIP), "POP_TOP")
        if after != "POP_TOP" and after not in _DELEGATING:
            return True
    return False


def thrown(info: Any) -> BaseException:
    """The exception a consumer's ``throw()`` raises in the body: the builtin exception of that
    name with its message, else a RuntimeError naming the type (the consumer's class may not
    exist where the body runs)."""
    info = info if isinstance(info, dict) else {}
    name, message = str(info.get("type") or "Exception"), str(info.get("message") or "")
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls(message)
    return RuntimeError(f"{name}: {message}" if message else name)


def drive(
    gen: Generator[Any, Any, Any],
    emit: Callable[[Any, int], None],
    receive: Callable[[int], wire.Frame | None],
    timeout_s: float,
) -> Any:
    """Run the two-way generator ``gen`` to its end and return its return value: ``emit(value,
    index)`` each yield, then ``receive(index)`` its answer (a frame: VALUE sends its unpacked body,
    ERROR throws :func:`thrown`, END closes; None: none came within ``timeout_s``, so
    :class:`SendTimeout` is raised at the yield). What the body raises propagates."""
    index = 0
    try:
        value = next(gen)
        while True:
            emit(value, index)
            try:
                answer = receive(index)
            except BaseException as exc:  # an interrupt while the body waits: raised at its yield
                value = gen.throw(exc)
                index += 1
                continue
            if answer is None:
                value = gen.throw(
                    SendTimeout(
                        f"no value was sent into yield {index} within {timeout_s:g} s; the consumer is gone?"
                    )
                )
            elif answer.kind == wire.FRAME_VALUE and isinstance(answer.body, bytes):
                value = gen.send(wire.unpack(answer.body))
            elif answer.kind == wire.FRAME_ERROR:
                value = gen.throw(thrown(answer.body))
            else:  # END: the consumer closed the stream
                gen.close()
                return None
            index += 1
    except StopIteration as stop:
        return stop.value


def timeout_of(run_config: Dict[str, Any]) -> float:
    """``run_config.send_timeout_s`` when it is a positive number, else :data:`SEND_TIMEOUT_S`."""
    value = run_config.get("send_timeout_s")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return SEND_TIMEOUT_S
