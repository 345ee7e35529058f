"""The in-sandbox program every runner starts: ``python3 -m dreamlake.lakeshore.daemon.entry [DIR]``.

It runs one invocation per the workdir contract (docs/architecture.md). With the workdir as cwd (or
``DIR``), it reads ``args.msgpack`` (the Envelope; a warm-forked entry may be handed its bytes
instead, :func:`run_args`), resolves the function through the worker-side gates, calls it and leaves:

- ``result.msgpack``: ``wire.pack(return value)``, exit 0 (for a generator: its return value);
- ``error.json``: ``{"type", "message", "traceback"}``, exit 1 when the function raised, exit 2 when a
  gate refused or the Envelope was bad;
- ``frames.msgpack`` for a generator result: one VALUE frame per yield, appended and flushed one by
  one, then END (body ``wire.pack(return value)``) or ERROR.

``result.msgpack`` and ``error.json`` are written to a temporary name, fsynced and renamed, and the
journal is fsynced after its last frame (before the result or error names the end): a host crash
leaves either a whole output or none, never a truncated one (nymph checks anyway:
``nymph/outputcheck.py``). Nothing else is fsynced (no directory, no per-frame sync): it is the
invocation's hot path.

Backpressure: with ``LAKESHORE_STREAM_WINDOW=<frames>:<bytes>`` set (nymph sets it), the generator
is paused at its next ``yield`` while that many of its frames (or bytes) are not yet delivered. The
delivered position is the file ``frames.delivered`` (``"<seq> <offset>"``, written by nymph), read
again with a short sleep (1 ms, doubling to 20 ms) until the window drains. Without the variable
(or with a malformed one) the generator is never paused.

Output: with ``LAKESHORE_CAPTURE_OUTPUT=1`` (nymph sets it for every invocation) the entry first
appends its own fd 1 and fd 2 to the workdir's ``stdout.log`` / ``stderr.log`` (``O_APPEND``, no
link followed; a child of the process runner's zygote has them so already) and makes
``sys.stdout`` / ``sys.stderr`` line-buffered (each line reaches the file
in one write as it is printed, as on a terminal; ``flush=True`` sends a partial line; a warm-forked
entry's interpreter started long before any ``PYTHONUNBUFFERED`` could apply), so
every runner, a container's or a Slurm job's as much as a spawned process, leaves the task's output
in the workdir while it runs, and nymph's pump streams it as LOG frames. Processes the function
starts inherit the same fds. What a process writes before the entry runs (the interpreter failing to
start) stays where the runner put fd 1/2 (for a container: its log, which the runner appends to the
files when it ends).

Stops: while the function runs, the first SIGTERM (the runners' ladder: interrupt, grace, kill)
raises :class:`~dreamlake.lakeshore.errors.Interrupted` in the function's thread, with the reason
nymph wrote to ``stop.reason`` in the workdir before signalling (``cancelled``, ``timeout``,
``preempted``; ``shutdown`` without the file), so ``try/finally`` and ``with`` blocks run; a
generator gets it at its current ``yield``. Later SIGTERMs are ignored (the grace is the
function's), and once the function returned the handler is gone: its result is written whole. The
handler is ``_signal``'s (a builtin: no import at start-up).

Environment: ``LAKESHORE_ALLOW_PICKLED=1`` allows pickled functions, ``LAKESHORE_RUNTIME_POLICY``
(``strict`` | ``minor`` | ``off``, default ``minor``), ``LAKESHORE_INVOCATION_ID`` (for messages),
``LAKESHORE_STREAM_WINDOW`` and ``LAKESHORE_CAPTURE_OUTPUT`` (above), ``LAKESHORE_SENDS`` (a
two-way generator, :mod:`dreamlake.lakeshore.twoway`: the seconds each yield waits for the answer
nymph appends to ``sends.msgpack``; its VALUE frames carry ``meta.send``, the yield's index), ``LAKESHORE_ALLOW_MODULES`` (nymph's ``--allow-module``
patterns, comma separated; see :func:`module_allowed`): when set, a ``ref`` function is refused
(exit 2, ``ModuleRefused``) unless its module matches, checked before the module is imported, and
again on the callable it resolved to (its ``__module__``), so ``allowed_module:os.system`` does not
reach ``os``.

The function's module must be importable in this runtime: the runner puts the user's code on
``PYTHONPATH``, and a code archive shipped with the call (``cfg["code"]``, unpacked by nymph into
its cache) comes as ``LAKESHORE_CODE_PATH`` (directories, ``os.pathsep`` separated, as the task
sees them): they go first on ``sys.path`` and on ``PYTHONPATH`` (for the processes the task
starts) before anything is imported, so the gates (``--allow-module``, pickles, ``src_hash``) see
the shipped code, not a copy the host has. Start-up is kept lean: no SDK, HTTP client,
database or server imports, and cloudpickle only for a pickled function. This module is part of the
entry bundle, so it must stay importable on Python 3.9 with only msgpack (and cloudpickle) present.
"""

from __future__ import annotations

import os
import sys
import time

from dreamlake.lakeshore import envvars, wire
from dreamlake.lakeshore.envelope import Envelope, resolve_fn
from dreamlake.lakeshore.errors import EnvelopeError, Interrupted, WireError

TYPE_CHECKING = False  # no typing at runtime: start-up is what a noop invocation costs
if TYPE_CHECKING:
    from typing import Any, Callable, ContextManager, Dict, Iterable, Iterator, List

ARGS_FILE = "args.msgpack"
RESULT_FILE = "result.msgpack"
ERROR_FILE = "error.json"
FRAMES_FILE = "frames.msgpack"
DELIVERED_FILE = "frames.delivered"
WINDOW_ENV = "LAKESHORE_STREAM_WINDOW"
CAPTURE_ENV = "LAKESHORE_CAPTURE_OUTPUT"
STDOUT_FILE = "stdout.log"
STDERR_FILE = "stderr.log"
CODE_PATH_ENV = "LAKESHORE_CODE_PATH"
SENDS_FILE = "sends.msgpack"  # twoway.SENDS_FILE (not imported before a two-way body runs)
SENDS_ENV = "LAKESHORE_SENDS"  # twoway.SENDS_ENV
STOP_REASON_FILE = "stop.reason"  # nymph writes why it stops the task before the SIGTERM
CHECKPOINT_ENV = "LAKESHORE_CHECKPOINT_DIR"  # dls.checkpoint_dir(): carried to the next attempt
CHECKPOINT_DIR = "checkpoint"
_PAUSE_MIN_S = 0.001
_PAUSE_MAX_S = 0.02

EXIT_OK = 0
EXIT_RAISED = 1
EXIT_REFUSED = 2

_CO_GENERATOR = 0x20
ALLOW_MODULES_ENV = "LAKESHORE_ALLOW_MODULES"
ALLOW_MODULE_FLAG = "--allow-module"
# Never matched by a wildcard when Python < 3.10 has no sys.stdlib_module_names (with it, every
# standard-library module is kept from wildcards).
_STDLIB_FALLBACK = frozenset(
    [
        "builtins",
        "os",
        "posix",
        "nt",
        "subprocess",
        "sys",
        "shutil",
        "importlib",
        "runpy",
        "pty",
        "ctypes",
        "code",
        "codeop",
        "pickle",
        "marshal",
        "socket",
        "multiprocessing",
        "signal",
        "tempfile",
        "io",
        "pathlib",
        "platform",
        "asyncio",
        "webbrowser",
        "threading",
    ]
)


class _Refused(Exception):
    """A gate refused or the Envelope was bad: exit 2."""


class ModuleRefused(Exception):
    """The function's module is not one the worker allows (``--allow-module``)."""


def module_allowed(module: str, patterns: Iterable[str]) -> bool:
    """Whether ``module`` matches one of the fnmatch ``patterns`` (case-sensitive, whole name).

    ``mypkg.*`` matches ``mypkg``'s submodules, ``mypkg`` the module itself. A pattern with a
    wildcard never matches a standard-library module (``builtins``, ``subprocess``, ``os``...): such
    a module is allowed only by a pattern that names it exactly.
    """
    from fnmatch import fnmatchcase

    top = module.partition(".")[0]
    stdlib = getattr(sys, "stdlib_module_names", None) or _STDLIB_FALLBACK | set(sys.builtin_module_names)
    for pattern in patterns:
        if pattern == module:
            return True
        if top not in stdlib and fnmatchcase(module, pattern):
            return True
    return False


def allow_modules_from_env() -> List[str]:
    """The ``LAKESHORE_ALLOW_MODULES`` patterns; empty: every module is allowed."""
    raw = envvars.string(ALLOW_MODULES_ENV) or ""
    return [p.strip() for p in raw.split(",") if p.strip()]


def module_refusal(module: str, qualname: str, patterns: List[str]) -> str:
    return (
        f"function {module}:{qualname} refused: this worker runs only functions of modules matching "
        f"{ALLOW_MODULE_FLAG} {' / '.join(patterns)}; deploy the function in an allowed module, or "
        f"start nymph with {ALLOW_MODULE_FLAG} matching {module!r}"
    )


class _NoContext:
    """contextlib.nullcontext without importing contextlib."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _run_context(envelope: Envelope) -> ContextManager[Any]:
    """The SDK's per-invocation run context when the user's code imported the SDK, else a no-op."""
    sdk = sys.modules.get("dreamlake.lakeshore.decorator")
    hook = getattr(sdk, "invocation_context", None)
    if hook is None:
        return _NoContext()
    return hook(envelope)  # type: ignore[no-any-return]


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until all of ``data`` is written (no file object)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _write_atomic(name: str, data: bytes) -> None:
    """``name`` replaced by ``data``: written to a temporary name, fsynced, renamed. The fsync is
    what keeps a host crash (a power loss) from leaving the new name with data not yet on disk (a
    truncated result nymph would otherwise find); the directory is not fsynced: a rename lost with
    the host leaves no output at all, which reads as a crash and is retried."""
    tmp = f".{name}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)  # as open("wb")
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, name)


def _error_info(exc: BaseException) -> Dict[str, Any]:
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


def _window() -> tuple[int, int] | None:
    """``(frames, bytes)`` of ``LAKESHORE_STREAM_WINDOW``; None: never pause."""
    raw = envvars.string(WINDOW_ENV) or ""
    frames, _, nbytes = raw.partition(":")
    try:
        window = int(frames), int(nbytes)
    except ValueError:
        return None
    return window if window[0] > 0 and window[1] > 0 else None


class _Journal:
    """``frames.msgpack``: frames appended with one ``os.write`` each, so a tail sees them at once."""

    def __init__(self, path: str, window: tuple[int, int] | None = None) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.seq = 0
        self.offset = 0  # bytes written
        self._window = window
        self._delivered = (-1, 0)  # the last (seq, offset) nymph said it delivered

    def append(self, kind: int, body: Any, send: int | None = None) -> None:
        meta: Dict[str, Any] = {"ts": time.time()}
        if send is not None:  # a two-way body's yield: the index its answer is sent to
            meta["send"] = send
        frame = wire.encode_frame(kind, self.seq, body, meta)
        _write_all(self._fd, frame)
        self.seq += 1
        self.offset += len(frame)

    def _over(self, window: tuple[int, int]) -> bool:
        frames, nbytes = window
        seq, offset = self._delivered
        return self.seq - 1 - seq >= frames or self.offset - offset >= nbytes

    def wait_window(self) -> None:
        """Block while the undelivered frames fill the window (see the module docstring)."""
        window = self._window
        if window is None or not self._over(window):
            return
        pause = _PAUSE_MIN_S
        while True:
            self._delivered = _read_delivered(self._delivered)
            if not self._over(window):
                return
            time.sleep(pause)
            pause = min(pause * 2, _PAUSE_MAX_S)

    def close(self, sync: bool = False) -> None:
        """Close the journal; ``sync``: its last frame (END or ERROR) is on disk first."""
        try:
            if sync:
                os.fsync(self._fd)
        finally:
            os.close(self._fd)


def _read_delivered(known: tuple[int, int]) -> tuple[int, int]:
    try:
        with open(DELIVERED_FILE, "rb") as f:
            seq, offset = f.read(64).split()
        return max(known, (int(seq), int(offset)))
    except (OSError, ValueError):
        return known


def capture_output(reopen: bool = True) -> None:
    """Append fd 1 / fd 2 to ``stdout.log`` / ``stderr.log`` of the cwd (the workdir) and make
    ``sys.stdout`` / ``sys.stderr`` line-buffered (see the module docstring). A file that
    cannot be opened leaves that fd as it was, with one line on the old stderr. ``reopen=False``:
    fd 1 and fd 2 are those files already (the zygote's child opened them): only the streams."""
    import io

    for fd, name, attr in ((1, STDOUT_FILE, "stdout"), (2, STDERR_FILE, "stderr")):
        old = getattr(sys, attr, None)
        try:
            if old is not None:
                old.flush()
        except (OSError, ValueError):
            pass
        if reopen:
            try:
                _append_fd(fd, name)
            except OSError as exc:
                sys.stderr.write(f"lakeshore entry: cannot append {attr} to {name}: {exc.strerror}\n")
                continue
        errors = "backslashreplace" if attr == "stderr" else (getattr(old, "errors", None) or "strict")
        if not reopen and old is not None and _writes_to(old, fd):  # the zygote's own: line-buffer it
            try:
                old.reconfigure(errors=errors, line_buffering=True)
                continue
            except (AttributeError, OSError, ValueError):
                pass
        encoding = getattr(old, "encoding", None) or "utf-8"
        buffer = io.BufferedWriter(io.FileIO(fd, "w", closefd=False))
        stream = io.TextIOWrapper(buffer, encoding=encoding, errors=errors, line_buffering=True)
        setattr(sys, attr, stream)


def _writes_to(stream: Any, fd: int) -> bool:
    """Whether ``stream`` is the interpreter's own text stream on ``fd`` (a forked child's inherited
    ``sys.stdout`` or ``sys.stderr``: reconfigured, it costs no new objects)."""
    import io

    try:
        return type(stream) is io.TextIOWrapper and stream.writable() and stream.fileno() == fd
    except (OSError, ValueError):
        return False


def _append_fd(fd: int, name: str) -> None:
    """Make ``fd`` append to ``name`` in the cwd (no link followed, no FIFO waited for)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    target = os.open(name, flags, 0o644)
    try:
        os.set_blocking(target, True)
        os.dup2(target, fd)  # the copy at fd is inheritable: child processes write there too
    finally:
        os.close(target)


def settled(result: Any) -> Any:
    """What an ``async def`` body's call comes to: a coroutine run to completion (``asyncio.run``:
    its value, or its exception raised), an async generator as a generator that streams its
    values (on one event loop of its own); anything else as it is. The entry and the SDK's worker
    both run bodies through this, so an async body runs on every runner."""
    import types

    if isinstance(result, types.CoroutineType):
        import asyncio

        return asyncio.run(result)
    if isinstance(result, types.AsyncGeneratorType):
        return _sync_stream(result)
    return result


def _sync_stream(agen: Any) -> Iterator[Any]:
    """The values of async generator ``agen``, pulled one by one on an event loop of their own;
    closing this generator closes ``agen`` (its ``finally`` blocks run)."""
    import asyncio

    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                value = loop.run_until_complete(agen.__anext__())
            except StopAsyncIteration:
                return
            yield value
    finally:
        try:
            loop.run_until_complete(agen.aclose())
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


def _is_stream(fn: Callable[..., Any], result: Any) -> bool:
    import types
    from collections.abc import Iterator

    if isinstance(result, types.GeneratorType):
        return True
    flags = getattr(getattr(fn, "__code__", None), "co_flags", 0)
    return bool(flags & _CO_GENERATOR) and isinstance(result, Iterator)


class _Interrupts:
    """The SIGTERM handler of a running function: the first SIGTERM raises Interrupted (with the
    reason nymph left in ``stop.reason``), later ones are ignored; :meth:`close` puts back the
    handler there was (a warm worker runs many calls in one process)."""

    def __init__(self) -> None:
        import _signal

        self.fired = False
        self.cwd = os.getcwd()  # the function may chdir; the reason file is the workdir's
        try:
            self.previous: Any = _signal.signal(_signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread (an embedding that runs the entry in a thread)
            self.previous = None

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self.fired:
            return
        self.fired = True
        raise Interrupted(_stop_reason(self.cwd))

    def close(self) -> None:
        """Stop raising: the function is done (its result is written whole whatever comes)."""
        import _signal

        if self.previous is not None:
            _signal.signal(_signal.SIGTERM, self.previous)
            self.previous = None


def _stop_reason(cwd: str) -> str:
    try:
        fd = os.open(os.path.join(cwd, STOP_REASON_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return "shutdown"
    try:
        return os.read(fd, 32).decode("ascii", "replace").strip()
    finally:
        os.close(fd)


def _journaled(
    journal: _Journal,
    body: Callable[[], bytes],
    interrupts: _Interrupts | None,
    settle: Callable[[BaseException], BaseException] | None = None,
) -> int:
    """Run ``body`` (it journals a generator's values and returns its packed return value), then
    END; on a raise, ERROR frame + error.json (``settle`` may turn the exception first). The journal
    is synced before result.msgpack names the call done. Returns the exit code."""
    ended = False
    try:
        try:
            returned = body()
            if interrupts is not None:
                interrupts.close()
        except BaseException as exc:
            if interrupts is not None:
                interrupts.close()
            info = _error_info(exc if settle is None else settle(exc))
            journal.append(wire.FRAME_ERROR, info)
            ended = True
            journal.close(sync=True)
            return _fail(info, EXIT_RAISED)
        journal.append(wire.FRAME_END, returned)
        ended = True
        journal.close(sync=True)  # the END frame on disk before result.msgpack names it done
    finally:
        if not ended:
            journal.close()
    _write_atomic(RESULT_FILE, returned)
    return EXIT_OK


def _drain(stream: Iterator[Any], interrupts: _Interrupts | None = None) -> int:
    """Journal every yield, then END; on a raise, ERROR frame + error.json. Returns the exit code.
    An Interrupted that arrives while the generator is paused at its yield is thrown in there."""
    journal = _Journal(FRAMES_FILE, _window())
    inside = False

    def body() -> bytes:
        nonlocal inside
        while True:
            try:
                inside = True
                value = next(stream)
                inside = False
            except StopIteration as stop:
                inside = False
                return wire.pack(stop.value)
            journal.append(wire.FRAME_VALUE, wire.pack(value))
            journal.wait_window()  # the generator stays paused at its yield meanwhile

    def settle(exc: BaseException) -> BaseException:
        if isinstance(exc, Interrupted) and not inside and hasattr(stream, "throw"):
            try:  # at its current yield: its finally and with blocks run
                stream.throw(exc)
            except BaseException as thrown:
                return thrown
        return exc

    return _journaled(journal, body, interrupts, settle)


class _Sends:
    """``sends.msgpack``: the answers to a two-way body's yields (one frame each, its seq the
    yield's index), appended by nymph; read on from where the last read stopped, through one fd
    kept open once the file exists. A wait looks again every 0.2 ms for its first 50 ms (a consumer
    in a loop answers within a few ms), then every 1 ms, after a second every 5 ms and after two
    every 50 ms (a person at a notebook costs nothing)."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._reader = wire.FrameReader()
        self._frames: Dict[int, wire.Frame] = {}

    def _read(self) -> None:
        if self._fd is None:
            try:
                self._fd = os.open(SENDS_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                return  # nothing sent yet
        while True:
            chunk = os.read(self._fd, 1 << 16)
            if not chunk:
                return
            for frame in self._reader.feed(chunk):
                self._frames[frame.seq] = frame

    def wait(self, index: int, timeout_s: float) -> wire.Frame | None:
        start = time.monotonic()
        while True:
            self._read()
            if index in self._frames:
                return self._frames.pop(index)
            waited = time.monotonic() - start
            if waited >= timeout_s:
                return None
            pause = 0.0002 if waited < 0.05 else 0.001 if waited < 1.0 else 0.005 if waited < 2.0 else 0.05
            time.sleep(min(pause, timeout_s - waited))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _drain_two_way(gen: Any, timeout_s: float, interrupts: _Interrupts | None = None) -> int:
    """:func:`_drain` for a two-way body: each yield's VALUE frame names its index (``meta.send``),
    and the body waits there for the answer nymph puts in ``sends.msgpack`` (twoway.py). An
    Interrupted that arrives while it waits is raised at that yield (twoway.drive)."""
    from dreamlake.lakeshore import twoway

    journal = _Journal(FRAMES_FILE)
    sends = _Sends()

    def emit(value: Any, index: int) -> None:
        journal.append(wire.FRAME_VALUE, wire.pack(value), send=index)

    try:
        return _journaled(
            journal,
            lambda: wire.pack(twoway.drive(gen, emit, lambda index: sends.wait(index, timeout_s), timeout_s)),
            interrupts,
        )
    finally:
        sends.close()


def _sends_timeout() -> float | None:
    """The seconds a two-way body waits at a yield (``LAKESHORE_SENDS``); None: not two-way."""
    value = envvars.number(SENDS_ENV, default=0.0)
    return value if value > 0 else None


def _mapped(f: Any) -> Any:
    """``args.msgpack`` as a read-only memory map (a view of it): decoding copies each argument
    out once, never the whole file first (a 1 GiB argument is not held twice more)."""
    import mmap

    if os.fstat(f.fileno()).st_size == 0:
        return b""
    return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))


def _unmap(data: Any) -> None:
    if isinstance(data, memoryview):
        owner: Any = data.obj
        try:
            data.release()
            owner.close()
        except (BufferError, AttributeError):  # a view still held (by a traceback): the GC closes it
            pass


def _load(blob: Any = None) -> tuple[Envelope, Callable[..., Any], list[Any], dict[str, Any]]:
    try:
        allow_pickled = envvars.flag("LAKESHORE_ALLOW_PICKLED")
        policy = envvars.choice("LAKESHORE_RUNTIME_POLICY") or "minor"  # strict | minor | off
    except ValueError as bad:
        raise _Refused(str(bad)) from bad
    try:
        if blob is not None:  # handed over in memory (a warm-forked entry: run_args)
            data = memoryview(blob)
        else:
            with open(ARGS_FILE, "rb") as f:
                data = _mapped(f)
    except OSError as exc:
        raise _Refused(
            f"cannot read {ARGS_FILE} in {os.getcwd()}: {exc.strerror}; run the entry with the "
            "invocation's workdir as cwd (or pass it as the argument)"
        ) from exc
    patterns = allow_modules_from_env()
    try:
        try:
            envelope = Envelope.from_bytes(data)
        finally:
            _unmap(data)
        ref = envelope.fn.get("kind") == "ref" and bool(patterns)
        if ref:  # before the import: a refused module's top-level code never runs
            _check_module(str(envelope.fn.get("module")), str(envelope.fn.get("qualname")), patterns)
        fn = resolve_fn(envelope.fn, allow_pickled=allow_pickled, runtime_policy=policy)
        if ref:  # and what the qualname led to: ``allowed_module:os.system`` is os's function
            owner = getattr(fn, "__module__", None) or type(fn).__module__
            _check_module(str(owner), str(envelope.fn.get("qualname")), patterns)
        args, kwargs = envelope.unpack_args()
    except (EnvelopeError, WireError, ModuleRefused) as exc:
        raise _Refused(str(exc)) from exc
    return envelope, fn, args, kwargs


def _check_module(module: str, qualname: str, patterns: List[str]) -> None:
    if not module_allowed(module, patterns):
        raise ModuleRefused(module_refusal(module, qualname, patterns))


def _ship_code_path() -> None:
    """Put the shipped code's directories (``LAKESHORE_CODE_PATH``) first on the import path."""
    dirs = [d for d in (envvars.string(CODE_PATH_ENV) or "").split(os.pathsep) if d]
    if not dirs:
        return
    sys.path[:0] = dirs
    for d in dirs:  # a pip environment nymph built (nymph.envcache): its .pth files count
        if os.path.exists(os.path.join(d, ".lakeshore-env")):
            import site

            site.addsitedir(d)
    rest = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([*dirs, rest] if rest else dirs)


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


# settings.TOKEN_FILE_ENV, spelled here: importing settings (dataclasses ...) would cost every task
TOKEN_FILE_ENV = "LAKESHORE_TOKEN_FILE"


def _token_file_absolute() -> None:
    """``LAKESHORE_TOKEN_FILE`` (the task's credential, nymph names it relative to the workdir)
    made absolute before the user's code runs, so a ``chdir`` or a child elsewhere still finds it."""
    path = envvars.string(TOKEN_FILE_ENV)
    if path and not os.path.isabs(path):
        os.environ[TOKEN_FILE_ENV] = os.path.abspath(path)


# The TLS files nymph copies into the workdir (nymph/tasktls.py), named relative to it like the token
TLS_FILE_ENVS = ("LAKESHORE_CA_FILE", "LAKESHORE_CLIENT_CERT", "LAKESHORE_CLIENT_KEY")


def _tls_files_absolute() -> None:
    """The control plane's CA (and client certificate) nymph handed the task, made absolute as
    ``LAKESHORE_TOKEN_FILE`` is, so the SDK's client finds them after a ``chdir`` too."""
    for name in TLS_FILE_ENVS:
        path = envvars.string(name)
        if path and not os.path.isabs(path):
            os.environ[name] = os.path.abspath(path)


def run(blob: Any = None) -> int:
    """Run the invocation in the current directory; returns the exit code. ``blob``: the Envelope's
    bytes when the caller has them (then ``args.msgpack`` is not read)."""
    _ship_code_path()
    _token_file_absolute()
    _tls_files_absolute()
    try:
        envelope, fn, args, kwargs = _load(blob)
    except _Refused as refused:
        cause = refused.__cause__ or refused
        info = _error_info(cause)
        info["message"] = str(refused)  # the same text, or the cause with what to do about it
        return _fail(info, EXIT_REFUSED)
    except BaseException as exc:  # the user's module raised while importing
        return _fail(_error_info(exc), EXIT_RAISED)
    interrupts = _Interrupts()
    if not envvars.is_set(CHECKPOINT_ENV):  # dls.checkpoint_dir(), as this task sees its workdir
        os.environ[CHECKPOINT_ENV] = os.path.join(interrupts.cwd, CHECKPOINT_DIR)
    with _run_context(envelope):
        try:
            try:
                result = settled(fn(*args, **kwargs))
                if _is_stream(fn, result):
                    two_way = _sends_timeout()
                    if two_way is not None and hasattr(result, "send"):
                        return _drain_two_way(result, two_way, interrupts)
                    return _drain(result, interrupts)
                _check_result_size(result)
            finally:
                interrupts.close()
            packed = wire.pack(result)
        except BaseException as exc:
            interrupts.close()
            return _fail(_error_info(exc), EXIT_RAISED)
    _write_atomic(RESULT_FILE, packed)
    return EXIT_OK


def _fail(info: Dict[str, Any], code: int) -> int:
    """Write error.json, say one line on stderr (nymph keeps stderr.log), return ``code``."""
    _write_error(info)
    invocation = envvars.string("LAKESHORE_INVOCATION_ID", None, "?")
    sys.stderr.write(
        f"lakeshore entry: invocation {invocation} exit {code}: {info['type']}: {info['message']}\n"
    )
    return code


def main(argv: list[str] | None = None) -> int:
    """CLI: ``entry [DIR]`` runs the invocation in DIR (default: the current directory)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        sys.stderr.write("usage: python3 -m dreamlake.lakeshore.daemon.entry [WORKDIR]\n")
        return EXIT_REFUSED
    if argv:
        try:
            os.chdir(argv[0])
        except OSError as exc:
            sys.stderr.write(f"lakeshore entry: cannot enter workdir {argv[0]!r}: {exc.strerror}\n")
            return EXIT_REFUSED
    if envvars.flag(CAPTURE_ENV):
        capture_output()
    return run()


def run_args(blob: bytes, captured: bool = False) -> int:
    """:func:`main` in the current directory with the Envelope's bytes given, not read from
    ``args.msgpack``: what the process runner's zygote runs in a forked child when nymph handed it
    the arguments over its socket (fewer files per invocation). ``captured``: fd 1 and fd 2 append
    to the workdir's logs already (the zygote's child opened them), so they are not opened again."""
    if envvars.flag(CAPTURE_ENV):
        capture_output(reopen=not captured)
    return run(blob)


if __name__ == "__main__":
    sys.exit(main())
