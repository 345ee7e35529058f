"""What the entry leaves in the workdir when the function ends: ``result.msgpack`` or ``error.json``.

Both are written to a temporary name, fsynced and renamed (:func:`_write_atomic`): a host crash
leaves either a whole output or none, never a truncated one (nymph checks anyway:
``nymph/outputcheck.py``). A result comes with ``result.digest`` (:func:`_write_result`), the
blake2b digest and size of the exact bytes written, published before the result itself: nymph
compares them before it acks a success, so a byte changed on the way (a value still well-formed
msgpack, a string no longer UTF-8) is a ``DamagedOutput``, not a success. The directory is not
fsynced: it is the invocation's hot path. A result too big to pack within the task's memory
(``LAKESHORE_RESULT_MAX_BYTES``, which the process runner sets to half the task's memory limit) is
refused before it is packed (:class:`ResultTooLarge`).

Part of the entry bundle, like :mod:`dreamlake.lakeshore.daemon.entry`: importable on Python
3.9, no ``typing`` at runtime.
"""

from __future__ import annotations

import os
import sys

from dreamlake.lakeshore import envvars

TYPE_CHECKING = False  # no typing at runtime: start-up is what a noop invocation costs
if TYPE_CHECKING:
    from typing import Any, Dict

RESULT_FILE = "result.msgpack"
ERROR_FILE = "error.json"
# ``"blake2b-256 <64 hex digits> <size>\n"`` of result.msgpack's bytes; nymph's reader:
# nymph/outputcheck.py (an entry from before it wrote none: nymph then checks the structure only)
RESULT_DIGEST_FILE = "result.digest"
RESULT_DIGEST_KIND = "blake2b-256"

EXIT_OK = 0
EXIT_RAISED = 1
EXIT_REFUSED = 2


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until all of ``data`` is written (no file object)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _write_atomic(name: str, data: bytes, sync: bool = True) -> None:
    """``name`` replaced by ``data``: written to a temporary name, fsynced, renamed. The fsync is
    what keeps a host crash (a power loss) from leaving the new name with data not yet on disk (a
    truncated result nymph would otherwise find); the directory is not fsynced: a rename lost with
    the host leaves no output at all, which reads as a crash and is retried. ``sync=False`` skips
    the fsync (0.4 ms here) where a host crash can only make nymph fail the call safe."""
    tmp = f".{name}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)  # as open("wb")
    try:
        _write_all(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, name)


def result_digest(data: bytes) -> bytes:
    """The ``result.digest`` line of ``data``: :data:`RESULT_DIGEST_KIND`, its hex digest, its size."""
    try:  # hashlib's own blake2b; hashlib itself imports OpenSSL (ms on every start)
        from _blake2 import blake2b
    except ImportError:  # an interpreter built without it as a module of its own
        from hashlib import blake2b
    hexdigest = blake2b(data, digest_size=32).hexdigest()
    return f"{RESULT_DIGEST_KIND} {hexdigest} {len(data)}\n".encode("ascii")


def _write_result(packed: bytes) -> None:
    """``result.msgpack`` and its ``result.digest``, each written atomically: the digest first, so
    a result is never there without its digest (a digest without a result, left by an entry that
    died between the two renames, reads as no result: nymph looks at the digest only beside one).
    The digest is not fsynced: a host crash that loses its bytes but keeps the result's leaves a
    digest that does not match (a ``DamagedOutput``, retried) or none (the structural check)."""
    _write_atomic(RESULT_DIGEST_FILE, result_digest(packed), sync=False)
    _write_atomic(RESULT_FILE, packed)


def error_info(exc: BaseException) -> Dict[str, Any]:
    """An exception as an ack or ERROR frame carries it: type, message, traceback, and the class
    names of its MRO. The entry and `lakeshore worker` both ack with it."""
    import traceback

    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        # the class names of its MRO (less object): retry_on names a base class as well
        "mro": [c.__name__ for c in type(exc).__mro__ if c is not object],
    }


def _write_error(info: Dict[str, Any]) -> None:
    import json

    _write_atomic(ERROR_FILE, json.dumps(info).encode("utf-8"))


def _fail(info: Dict[str, Any], code: int) -> int:
    """Write error.json, say one line on stderr (nymph keeps stderr.log), return ``code``."""
    _write_error(info)
    invocation = envvars.string("LAKESHORE_INVOCATION_ID", None, "?")
    sys.stderr.write(
        f"lakeshore entry: invocation {invocation} exit {code}: {info['type']}: {info['message']}\n"
    )
    return code


# A result bigger than this is refused before it is serialised (the process runner sets half the
# task's memory limit: packing takes as much memory again, and an OOM kill would say less)
RESULT_MAX_ENV = "LAKESHORE_RESULT_MAX_BYTES"
_SIZE_WALK_MAX = 100_000  # values looked at; past it the estimate stops (it is a lower bound)


class ResultTooLarge(Exception):
    """The function's result is too big to serialise within the task's limits."""


def _check_result_size(result: Any) -> None:
    if not envvars.is_set(RESULT_MAX_ENV):
        return
    cap = envvars.integer(RESULT_MAX_ENV)
    size = _approx_size(result, cap)
    if size > cap:
        raise ResultTooLarge(
            f"the result holds at least {size} bytes, more than the {cap} this task may serialise "
            f"({RESULT_MAX_ENV}: packing it takes as much memory again, and the task's memory limit "
            "leaves room for no more); return less (a generator streams values one at a time), or "
            "write it to a file and return its path"
        )


def _approx_size(value: Any, cap: int) -> int:
    """A lower bound of ``value``'s packed size: its buffers' bytes (bytes, str, arrays' ``nbytes``)
    plus a few bytes per other value; stops once past ``cap``."""
    total, seen, stack = 0, 0, [value]
    while stack and total <= cap and seen < _SIZE_WALK_MAX:
        item = stack.pop()
        seen += 1
        if isinstance(item, (bytes, bytearray, str)):
            total += len(item)
        elif isinstance(item, memoryview):
            total += item.nbytes
        elif isinstance(item, dict):
            total += 1
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 1
            stack.extend(item)
        else:
            nbytes = getattr(item, "nbytes", None)  # numpy, torch (through wire's array codec)
            total += nbytes if isinstance(nbytes, int) else 1
    return total
