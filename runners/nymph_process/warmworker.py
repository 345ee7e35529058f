"""A warm worker of the process runner's warm mode: ``python warmworker.py FD``, run by path.

A long-lived interpreter that runs many invocations one after another, in itself: no fork, no new
process per call (see :mod:`nymph_process.warm` for who may use it and the trade-offs). For each
request on the UNIX socket ``FD`` it does, in this very process, what ``python -m
dreamlake.lakeshore.daemon.entry`` in the workdir would do: cwd the workdir, ``os.environ`` the
task's environment, the workdir first on ``sys.path``, the workdir's entry lock held (so the entry
never runs twice in one workdir, exactly as for a spawned or forked one), then the entry's
``main()``: the workdir contract is unchanged (``args.msgpack`` in; ``result.msgpack``,
``error.json``, ``frames.msgpack``, the output appended to ``stdout.log`` / ``stderr.log`` out),
so nymph's pump, outcome and ack paths are the cold path's. The function's module is imported by
the first call and stays in ``sys.modules``: later calls find it there (that is the point), with
whatever state it keeps. After a call: the cwd, ``sys.path``, fd 1 / fd 2 and ``sys.stdout`` /
``sys.stderr`` are put back; ``os.environ`` is replaced again by the next call; everything else the
call did (module globals, threads it started, ``sys.modules``) stays.

Protocol, one JSON document per line. Runner -> worker: ``{"id", "workdir", "env"}``. Worker ->
runner: ``{"ready": pid}`` once, then ``{"id", "code"}`` when a call ended (``code`` the entry's
exit code; :data:`ENTRY_LOCKED` when the workdir's entry already ran or runs elsewhere, nothing was
run). One call at a time. A call that kills the process (``os._exit``, a segfault, a signal: the
runner's stop ladder) is seen by the runner as the worker's exit status. The worker exits when the
socket reaches EOF (nymph closed it: recycled, shut down, or died); a call in flight at that moment
runs to its end first, so a call outlives a nymph killed mid-call as a spawned entry does.

Stdlib only besides the entry (and the zygote's helpers, loaded from the same directory), and
Python 3.9 syntax: it runs in whichever interpreter runs the entry.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))


def _zygote_helpers() -> Any:
    """The zygote's workdir helpers (the entry lock, safe opens), under a private module name."""
    spec = importlib.util.spec_from_file_location("_lakeshore_zygote", os.path.join(_HERE, "zygote.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Worker:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.z = _zygote_helpers()
        self.safe_path = bool(getattr(sys.flags, "safe_path", False))
        if not self.safe_path and sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
            del sys.path[0]  # this script's directory; a call puts its workdir there, as -m does
        self.fds = (os.dup(1), os.dup(2))  # where fd 1 / fd 2 go between calls
        self.streams = (sys.stdout, sys.stderr)

    def send(self, msg: dict) -> None:  # type: ignore[type-arg]
        try:
            self.sock.sendall(json.dumps(msg).encode() + b"\n")
        except OSError:
            pass  # nymph is gone: the next read sees EOF

    def serve(self) -> None:
        self.send({"ready": os.getpid()})
        while True:
            while b"\n" not in self.buf:
                data = self.sock.recv(1 << 16)
                if not data:
                    return  # nymph closed the socket (or died): no more calls
                self.buf += data
            line, self.buf = self.buf.split(b"\n", 1)
            req = json.loads(line)
            self.send({"id": req["id"], "code": self.call(req)})

    def call(self, req: dict) -> int:  # type: ignore[type-arg]
        """Run one invocation in its workdir, in this process; the entry's exit code."""
        from dreamlake.lakeshore.daemon import entry

        z = self.z
        saved_path = list(sys.path)
        lock = -1
        try:
            os.chdir(req["workdir"])
            lock = self._entry_lock()
            if lock < 0:
                return int(z.ENTRY_LOCKED)  # runs (or ran) elsewhere: never twice
            _set_environ(req["env"])
            if not self.safe_path:
                sys.path.insert(0, os.getcwd())
            sys.argv = [entry.__file__ or "entry"]
            return int(z._run(entry.main))
        except OSError as exc:
            sys.stderr.write(f"lakeshore warm worker: cannot set up workdir {req.get('workdir')!r}: {exc}\n")
            return int(z._CHILD_SETUP_FAILED)
        finally:
            self._restore_output()
            sys.path[:] = saved_path
            if lock >= 0:
                os.close(lock)  # releases the entry lock; the file keeps who ran it
            try:
                os.chdir("/")
            except OSError:
                pass

    def _entry_lock(self) -> int:
        """The cwd's entry lock, taken and recorded (as a forked child does); -1 when it is held or
        an entry already ran here."""
        return int(self.z._take_entry_lock())

    def _restore_output(self) -> None:
        """fd 1 / fd 2 and sys.stdout / sys.stderr back to the worker's own (the entry pointed them
        at the call's logs)."""
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):
                pass
        os.dup2(self.fds[0], 1)
        os.dup2(self.fds[1], 2)
        sys.stdout, sys.stderr = self.streams


def _set_environ(target: dict) -> None:  # type: ignore[type-arg]
    """``os.environ`` becomes ``target``, touching only what differs (``clear()`` is quadratic:
    it pops one item at a time from a fresh iterator)."""
    env = os.environ
    for key in [k for k in env if k not in target]:
        del env[key]
    for key, value in target.items():
        if env.get(key) != value:
            env[key] = value


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    import dreamlake.lakeshore.daemon.entry  # noqa: F401  (and so wire, envelope, msgpack)

    try:
        Worker(sock).serve()
    except (BrokenPipeError, ConnectionResetError):
        pass


if __name__ == "__main__":
    main()
