"""The in-sandbox program every runner starts: ``python3 -m dreamlake.lakeshore.daemon.entry [DIR]``.

It runs one invocation per the workdir contract (docs/architecture.md). With the workdir as cwd (or
``DIR``), it reads ``args.msgpack`` (the Envelope; a caller that holds its bytes may hand them
over instead, :func:`run_args`), resolves the function through the worker-side gates, calls it and leaves:

- ``result.msgpack``: ``wire.pack(return value)``, exit 0 (for a generator: its return value),
  after ``result.digest`` (the blake2b digest and size of those bytes, which nymph checks);
- ``error.json``: ``{"type", "message", "traceback"}``, exit 1 when the function raised, exit 2 when a
  gate refused or the Envelope was bad;
- ``frames.msgpack`` for a generator result: one VALUE frame per yield, appended and flushed one by
  one, then END (body ``wire.pack(return value)``) or ERROR.

The rooms beside this module, each one idea of the entry's: what it leaves when the function ends
(``result.msgpack`` / ``error.json`` written atomically, a result too big refused:
:mod:`~dreamlake.lakeshore.daemon.entry_outputs`), a generator's journal with its backpressure
window and a two-way body's sends (:mod:`~dreamlake.lakeshore.daemon.entry_streams`), the task's
fd 1/2 appended to the workdir's logs (:mod:`~dreamlake.lakeshore.daemon.entry_capture`), the
first SIGTERM raised as ``Interrupted`` with nymph's reason
(:mod:`~dreamlake.lakeshore.daemon.entry_interrupts`), and ``--allow-module``
(:mod:`~dreamlake.lakeshore.daemon.entry_allow`). Their public names are importable from here.

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

from dreamlake.lakeshore import envvars, wire
from dreamlake.lakeshore.daemon.entry_allow import (
    ALLOW_MODULE_FLAG,
    ALLOW_MODULES_ENV,
    ModuleRefused,
    _check_module,
    allow_modules_from_env,
    module_allowed,
    module_refusal,
)
from dreamlake.lakeshore.daemon.entry_capture import CAPTURE_ENV, STDERR_FILE, STDOUT_FILE, capture_output
from dreamlake.lakeshore.daemon.entry_interrupts import STOP_REASON_FILE, _Interrupts
from dreamlake.lakeshore.daemon.entry_outputs import (
    ERROR_FILE,
    EXIT_OK,
    EXIT_RAISED,
    EXIT_REFUSED,
    RESULT_DIGEST_FILE,
    RESULT_FILE,
    RESULT_MAX_ENV,
    ResultTooLarge,
    _check_result_size,
    _fail,
    _write_result,
    error_info,
)
from dreamlake.lakeshore.daemon.entry_streams import (
    DELIVERED_FILE,
    FRAMES_FILE,
    SENDS_ENV,
    SENDS_FILE,
    WINDOW_ENV,
    _drain,
    _drain_two_way,
    _is_stream,
    _sends_timeout,
    settled,
)
from dreamlake.lakeshore.envelope import Envelope, resolve_fn
from dreamlake.lakeshore.errors import EnvelopeError, WireError

TYPE_CHECKING = False  # no typing at runtime: start-up is what a noop invocation costs
if TYPE_CHECKING:
    from typing import Any, Callable, ContextManager

# the names other code imports from here: their homes are the entry_* modules beside this one
__all__ = [
    "ALLOW_MODULES_ENV",
    "ALLOW_MODULE_FLAG",
    "ARGS_FILE",
    "CAPTURE_ENV",
    "CHECKPOINT_DIR",
    "CHECKPOINT_ENV",
    "CODE_PATH_ENV",
    "DELIVERED_FILE",
    "ERROR_FILE",
    "EXIT_OK",
    "EXIT_RAISED",
    "EXIT_REFUSED",
    "FRAMES_FILE",
    "RESULT_DIGEST_FILE",
    "RESULT_FILE",
    "RESULT_MAX_ENV",
    "SENDS_ENV",
    "SENDS_FILE",
    "STDERR_FILE",
    "STDOUT_FILE",
    "STOP_REASON_FILE",
    "TOKEN_FILE_ENV",
    "WINDOW_ENV",
    "ModuleRefused",
    "ResultTooLarge",
    "allow_modules_from_env",
    "capture_output",
    "main",
    "module_allowed",
    "module_refusal",
    "run",
    "run_args",
    "settled",
]

ARGS_FILE = "args.msgpack"
CODE_PATH_ENV = "LAKESHORE_CODE_PATH"
CHECKPOINT_ENV = "LAKESHORE_CHECKPOINT_DIR"  # dls.checkpoint_dir(): carried to the next attempt
CHECKPOINT_DIR = "checkpoint"


class _Refused(Exception):
    """A gate refused or the Envelope was bad: exit 2."""


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
        info = error_info(cause)
        info["message"] = str(refused)  # the same text, or the cause with what to do about it
        return _fail(info, EXIT_REFUSED)
    except BaseException as exc:  # the user's module raised while importing
        return _fail(error_info(exc), EXIT_RAISED)
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
            return _fail(error_info(exc), EXIT_RAISED)
    _write_result(packed)
    return EXIT_OK


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


def run_args(blob: bytes | None = None, captured: bool = False) -> int:
    """:func:`main` in the current directory, with the Envelope's bytes given (``blob``; None: read
    from ``args.msgpack``, as :func:`main` does): what the process runner's zygote runs in a forked
    child. ``captured``: fd 1 and fd 2 append to the workdir's logs already (the zygote's child
    opened them), so they are not opened again."""
    if envvars.flag(CAPTURE_ENV):
        capture_output(reopen=not captured)
    return run(blob)


if __name__ == "__main__":
    sys.exit(main())
