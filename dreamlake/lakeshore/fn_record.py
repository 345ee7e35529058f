"""The ``fn`` record of an Envelope, and the source hash that names the code it points at.

``fn`` is a tagged union: ``{"kind": "ref", module, qualname, src_hash}`` for importable functions,
``{"kind": "pickle", blob, hash, source, qualname, where, runtime}`` for everything else.
:func:`check_fn` validates either arm (unknown keys pass). :func:`src_hash` is the one definition
of a function's source hash, which the submitter puts in a ``ref`` record
(:mod:`dreamlake.lakeshore.fn_transport`) and the worker compares with its own
(:mod:`dreamlake.lakeshore.fn_gates`, through the cheaper :func:`_local_src_hash`).

Part of the entry bundle, like :mod:`dreamlake.lakeshore.envelope`: no ``typing`` or
``dataclasses`` at runtime, importable on Python 3.9.
"""

from __future__ import annotations

from dreamlake.lakeshore.errors import EnvelopeError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Mapping

    FnRecord = Dict[str, Any]

__all__ = ["check_fn", "is_pickled", "src_hash"]


def _expect(record: Mapping[str, Any], name: str, types: tuple[type, ...], what: str = "envelope") -> None:
    value = record.get(name)
    if not isinstance(value, types):
        names = " or ".join("None" if t is type(None) else t.__name__ for t in types)
        raise EnvelopeError(f"{what} field {name!r} must be {names}, got {type(value).__name__}")


def check_fn(fn: Any) -> FnRecord:
    """Validate a ``fn`` record (either arm); unknown keys pass. Returns it unchanged."""
    if not isinstance(fn, dict):
        raise EnvelopeError(f"fn must be a map, got {type(fn).__name__}")
    kind = fn.get("kind")
    if kind == "ref":
        module, qualname, hashed = fn.get("module"), fn.get("qualname"), fn.get("src_hash")
        if not (isinstance(module, str) and isinstance(qualname, str)):
            _expect(fn, "module", (str,), "fn")
            _expect(fn, "qualname", (str,), "fn")
        if not module or not qualname:
            raise EnvelopeError("fn 'module' and 'qualname' must not be empty")
        if hashed is not None and not isinstance(hashed, str):
            _expect(fn, "src_hash", (str,), "fn")
    elif kind == "pickle":
        _expect(fn, "blob", (bytes,), "fn")
        _expect(fn, "hash", (str,), "fn")
        _expect(fn, "qualname", (str,), "fn")
        _expect(fn, "runtime", (dict,), "fn")
        if not fn["hash"].startswith("sha256:"):
            raise EnvelopeError("fn 'hash' must be 'sha256:<hex>'")
    else:
        raise EnvelopeError(f"fn 'kind' must be 'ref' or 'pickle', got {kind!r}")
    return fn


def is_pickled(fn: Mapping[str, Any]) -> bool:
    """True for the pickle arm of the ``fn`` union."""
    return fn.get("kind") == "pickle"


def _underlying(obj: Any) -> Any:
    """The user function behind an SDK wrapper (``__lakeshore_fn__``, else the ``__wrapped__`` chain)."""
    inner = getattr(obj, "__lakeshore_fn__", None)
    if inner is not None:
        return inner
    seen = 0
    while hasattr(obj, "__wrapped__") and seen < 100:
        obj = obj.__wrapped__
        seen += 1
    return obj


def _getattr_chain(obj: Any, qualname: str) -> Any:
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _sha256_hex(data: bytes) -> str:
    """hashlib.sha256(data).hexdigest(), from the small built-in module when there is one: hashlib
    loads OpenSSL, which costs the entry more than the rest of its imports."""
    try:
        from _sha256 import sha256  # Python <= 3.11
    except ImportError:
        try:
            from _sha2 import sha256  # Python >= 3.12
        except ImportError:
            from hashlib import sha256
    return sha256(data).hexdigest()  # type: ignore[no-any-return]


def src_hash(fn: Callable[..., Any]) -> str | None:
    """``"sha256:" + 16 hex`` of the function's source, or None when the source is unavailable."""
    import inspect

    target = _underlying(fn)
    key = _hash_key(target)
    kept = _HASHED.get(key) if key is not None else None  # one lookup: another thread may clear it
    if kept is not None:
        return kept
    try:
        source = inspect.getsource(target)
    except (OSError, TypeError):
        return None
    hashed = "sha256:" + _sha256_hex(source.encode("utf-8"))[:16]
    if key is not None:
        if len(_HASHED) >= _HASHED_MAX:
            _HASHED.clear()
        _HASHED[key] = hashed
    return hashed


# The source hashes made (``src_hash``: each submit of a function by reference makes one), by
# function code and its file's size and modification time. ``inspect`` reads a source through
# ``linecache``, which reads the file again exactly when its size or modification time changed,
# so a hash kept under them is the one ``inspect`` would give: an edited file is hashed again
# (shipped code follows the edit), an unchanged one is not tokenized again on every call (that
# was about 0.1 ms of each ``f.call()``).
_HASHED: dict[tuple[Any, int, float], str] = {}
_HASHED_MAX = 4096


def _hash_key(target: Any) -> tuple[Any, int, float] | None:
    import os

    code = getattr(target, "__code__", None)
    if type(target).__name__ != "function" or code is None:
        return None
    try:
        st = os.stat(code.co_filename)
    except (OSError, TypeError, ValueError):  # no file (an interactive cell): inspect decides
        return None
    return (code, st.st_size, st.st_mtime)  # the code names its file


def _local_src_hash(fn: Callable[..., Any], expected: str) -> str | None:
    """``src_hash(fn)`` for the staleness gate, trying first a slice of the source file that needs
    neither inspect nor tokenize (the entry's start-up): lines from the function's first line (its
    first decorator) to the last line any of its bytecode (nested code included) comes from.

    The slice is trusted only when it hashes to ``expected``; otherwise (it may differ from
    ``inspect.getsource``, e.g. on a trailing comment) ``src_hash`` decides, as it always did. A
    match is sound: the slice holds every line of the function that compiles to code, and equals the
    submitter's source.
    """
    code = getattr(_underlying(fn), "__code__", None)
    key = (code, expected) if code is not None else None
    if key is not None and key in _MATCHED:
        return expected
    local: str | None = None
    fast = _sliced_source(fn)
    if fast is not None:
        local = "sha256:" + _sha256_hex(fast.encode("utf-8"))[:16]
    if local != expected:
        local = src_hash(fn)
    if key is not None and local == expected:
        if len(_MATCHED) >= _MATCHED_MAX:
            _MATCHED.clear()
        _MATCHED.add(key)
    return local


# The loaded functions (by code object) whose source matched a submitter's hash: a long-lived
# worker (``lakeshore worker``, nymph's warm workers) runs the same functions again and again, and
# their loaded code does not change; without it each call read and hashed the file. Mismatches are
# not kept (each is read again: after the reload a StaleSource asks for, the file decides).
_MATCHED: set[tuple[Any, str]] = set()
_MATCHED_MAX = 4096


def _sliced_source(fn: Callable[..., Any]) -> str | None:
    try:
        target = _underlying(fn)
        code = getattr(target, "__code__", None)
        if type(target).__name__ != "function" or code is None:
            return None
        filename = code.co_filename
        if not filename.endswith(".py"):
            return None
        with open(filename, encoding="utf-8") as f:  # universal newlines, as linecache reads it
            lines = f.readlines()
        start = code.co_firstlineno - 1
        if not 0 <= start < len(lines) or not lines[start].lstrip().startswith(("def ", "async ", "@")):
            return None
        last, stack = 0, [code]
        while stack:
            c = stack.pop()
            for _, _, line in c.co_lines():
                if line is not None and line > last:
                    last = line
            for pos in getattr(c, "co_positions", lambda: ())():  # Python >= 3.11
                if pos[1] is not None and pos[1] > last:
                    last = pos[1]
            stack.extend(k for k in c.co_consts if type(k) is type(code))
        if last <= start:
            return None
        if not lines[-1].endswith("\n"):
            lines[-1] += "\n"  # as linecache does
        return "".join(lines[start:last])
    except Exception:  # anything odd: inspect decides
        return None
