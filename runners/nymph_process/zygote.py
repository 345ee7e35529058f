"""The process runner's warm-fork server ("zygote"): ``python zygote.py FD``, run by path.

A long-lived, single-threaded interpreter that has already imported the entry (and so ``wire``,
``envelope``, msgpack) but no user code. For each request on the UNIX socket ``FD`` it forks a child
that becomes exactly what ``python -m dreamlake.lakeshore.daemon.entry`` in the workdir would be:
its own session (``setsid``, so the runner's ``killpg`` ladder works), cwd the workdir,
``os.environ`` replaced by the task's environment, stdin ``/dev/null``, stdout/stderr appended to
``stdout.log`` / ``stderr.log``, signal handlers and mask reset, ``sys.path[0]`` the workdir; it runs
the entry's ``main()``, then the interpreter's exit steps (non-daemon threads joined, atexit
handlers, streams flushed) and ``os._exit``. User code is imported in the child only, so nothing a
task does to ``sys.path``, ``sys.modules`` or ``os.environ`` reaches the next one: a code archive the
call shipped (``LAKESHORE_CODE_PATH`` in the task's environment) goes first on the child's
``sys.path`` in the entry, so each child imports its own version of the user's code fresh.

Before anything else the child joins the task's cgroup (``cgroup``: a ``cgroup.procs`` path, when
the runner has task cgroups), so every process the task starts is in it; last before the entry it
becomes the task's user (``user``: ``setgroups``, ``setgid``, ``setuid``, and ``HOME``, ``USER``,
``LOGNAME``, ``SHELL`` in its environment), when the zygote runs as root. Files it opens in the
workdir (the lock, the logs) are opened without following links or blocking on FIFOs, and only
when they are regular files of the task's user or of the zygote's own.

Protocol, one JSON document per line. Runner -> zygote: ``{"id", "workdir", "env" or "env_update",
"cgroup", "user"}`` (``env``: the task's whole environment; ``env_update``: what it adds to or
changes in the zygote's own, the per-task variables, so a request does not carry the rest). Never
the task's arguments: every child inherits the zygote's heap, freed memory included, so the child
reads them from ``args.msgpack`` in its workdir once it is the task's user, and the zygote drops
each request as soon as the child is forked (nymph keeps a zygote to one namespace's tasks:
:mod:`nymph_process.forking`). Zygote ->
runner: ``{"ready": pid}`` once; ``{"id", "pid", "ticks"}`` (``ticks``: the child's start time in
clock ticks after boot, from ``/proc``, so the runner can record it even if the child is already
gone) or ``{"id", "error"}``; ``{"exit": pid, "code"}`` when a child ends (only the zygote, its
parent, can reap it; ``code`` is negative for a signal, as ``Popen.returncode``). The zygote exits
when the socket reaches EOF (nymph is gone); its running children carry on, reparented.

A child runs the entry only once it holds the workdir's entry lock (``flock`` on ``.entry.lock``,
held until it exits) and has written ``{"pid", "ticks"}`` there; it exits with
:data:`ENTRY_LOCKED` without running anything when the lock is taken. The runner takes the same
lock before it spawns the entry itself, so a child whose fork answer never reached nymph (a
timeout, a dying zygote) can never run the invocation a second time next to a fallback spawn.

Start-up is paid once, here: besides the entry the zygote imports :data:`PRELOAD` (standard
library modules nearly every user module imports, ``typing`` first: a child that imports them itself
pays more for that than for the rest of a noop call), then moves every object it made into the
garbage collector's permanent generation (``gc.freeze()``), so a child's collections neither walk
nor touch, and so copy, the pages it shares with the zygote. Nothing of the user's is preloaded: each
child imports the user's code fresh, and what it does to a preloaded module stays in the child.

Stdlib only besides the entry, and Python 3.9 syntax: it runs in whichever interpreter runs the entry.
"""

from __future__ import annotations

import _signal
import errno
import fcntl
import functools
import gc
import importlib
import json
import os
import select
import signal
import socket
import stat
import sys

_CHILD_SETUP_FAILED = 127
ENTRY_LOCK = ".entry.lock"  # in the workdir; see the module docstring
ENTRY_LOCKED = 75  # EX_TEMPFAIL: another process holds the entry lock; nothing was run
# standard library modules imported once here rather than by every child (see the module docstring);
# the entry's own lazy imports (mmap for the arguments, io for the logs, traceback and json for an
# error, the built-in SHA-256 its source-hash gate reads every ref function's source with: a shared
# library each child would otherwise load, ``_sha256`` up to Python 3.11, ``_sha2`` after) among them
PRELOAD = (
    "_sha256",
    "_sha2",
    "typing",
    "collections.abc",
    "contextlib",
    "dataclasses",
    "enum",
    "functools",
    "io",
    "json",
    "logging",
    "mmap",
    "re",
    "traceback",
)


def _ticks(pid: int) -> int | None:
    try:  # os.read, not open(): no file object per fork (and per child: the entry lock)
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        try:
            stat = os.read(fd, 4096)  # a few hundred bytes: comm is at most 16
        finally:
            os.close(fd)
        return int(stat[stat.rindex(b")") + 2 :].split(None, 20)[19])  # field 22 (starttime)
    except (OSError, ValueError, IndexError):
        return None


class Zygote:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.safe_path = bool(getattr(sys.flags, "safe_path", False))
        if not self.safe_path and sys.path:
            del sys.path[0]  # this script's directory; a child puts its workdir there, as -m does
        self.handlers = {int(sig): _signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGCHLD)}
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C to nymph's terminal is nymph's to handle
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w)

    def send(self, msg: dict) -> None:  # type: ignore[type-arg]
        self.sock.sendall(json.dumps(msg).encode() + b"\n")

    def serve(self) -> None:
        self.send({"ready": os.getpid()})
        sock_fd = self.sock.fileno()
        while True:
            readable = select.select([sock_fd, self.wake_r], [], [])[0]
            if self.wake_r in readable:
                try:
                    while os.read(self.wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
            self.reap()
            if sock_fd in readable:
                data = self.sock.recv(1 << 16)
                if not data:
                    return  # nymph is gone
                self.buf += data
                del data  # no request outlives its handling (the next child would inherit it)
                while b"\n" in self.buf:
                    line, self.buf = self.buf.split(b"\n", 1)
                    req = json.loads(line)
                    del line
                    self.handle(req)
                    del req

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})

    def handle(self, req: dict) -> None:  # type: ignore[type-arg]
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        try:
            pid = os.fork()
        except OSError as exc:
            self.send({"id": req["id"], "error": f"fork: {exc}"})
            return
        if pid == 0:
            code = _CHILD_SETUP_FAILED
            try:
                code = self.child(req)
            finally:
                os._exit(code)
        self.send({"id": req["id"], "pid": pid, "ticks": _ticks(pid)})

    def child(self, req: dict) -> int:  # type: ignore[type-arg]
        """In the forked child: become the entry in the workdir; returns only if setup failed."""
        cgroup = req.get("cgroup")
        # first of all: nothing the task starts can be outside its cgroup (and, one a line after
        # it, the cgroup v1 ones its limits live in: nymph.limits)
        for procs in cgroup.split("\n") if cgroup else ():
            try:
                fd = os.open(procs, os.O_WRONLY | os.O_CLOEXEC)
                try:
                    os.write(fd, str(os.getpid()).encode())
                finally:
                    os.close(fd)
            except OSError as exc:
                sys.stderr.write(f"lakeshore zygote: cannot join cgroup {procs!r}: {exc}\n")
                return _CHILD_SETUP_FAILED
        os.setsid()
        # the C functions, not the signal module's wrappers: those map every value through an
        # enum, which in a fresh child touches (and so copies) pages of the zygote's for nothing
        _signal.set_wakeup_fd(-1)
        for sig, handler in self.handlers.items():
            _signal.signal(sig, handler)
        _signal.pthread_sigmask(_signal.SIG_SETMASK, ())
        os.close(self.sock.detach())
        self.buf = b""  # requests nymph sent after this one: not this task's
        os.close(self.wake_r)
        os.close(self.wake_w)
        workdir = req["workdir"]
        user = req.get("user") or None
        try:
            os.chdir(workdir)
            owner = os.stat(".").st_uid
            if _take_entry_lock(owner) < 0:  # held (the fd stays open) for the child's life
                return ENTRY_LOCKED  # the runner (or another child) runs this entry: never twice
            null = os.open(os.devnull, os.O_RDONLY)
            append = os.O_WRONLY | os.O_CREAT | os.O_APPEND
            out = _open_in_workdir("stdout.log", append, 0o644, owner)
            err = _open_in_workdir("stderr.log", append, 0o644, owner)
        except OSError as exc:
            sys.stderr.write(f"lakeshore zygote: cannot set up workdir {workdir!r}: {exc}\n")
            return _CHILD_SETUP_FAILED
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        if user is not None:
            try:
                _become(user)
            except (OSError, KeyError, TypeError) as exc:
                sys.stderr.write(f"lakeshore zygote: cannot become user {user.get('name')!r}: {exc}\n")
                return _CHILD_SETUP_FAILED
        if "env" in req:
            os.environ.clear()
            os.environ.update(req["env"])
        else:  # the zygote's environment (the task's, less its per-task variables) plus those
            os.environ.update(req["env_update"])
        if user is not None:
            os.environ.update(
                HOME=str(user["home"]),
                USER=str(user["name"]),
                LOGNAME=str(user["name"]),
                SHELL=str(user["shell"]),
            )
        if not self.safe_path:
            sys.path.insert(0, os.getcwd())
        from dreamlake.lakeshore.daemon import entry

        sys.argv = [entry.__file__ or "entry"]
        sys.modules["__main__"] = entry
        main: object = entry.main
        run_args = getattr(entry, "run_args", None)
        code = getattr(run_args, "__code__", None)
        params = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount] if code is not None else ()
        if run_args is not None and "captured" in params:
            # fds 1 and 2 append to the workdir's logs already (above): an entry that can be told
            # so does not open them again; it reads args.msgpack as the task's user
            main = functools.partial(run_args, None, captured=True)
        _exit(_run(main))
        return _CHILD_SETUP_FAILED  # not reached


def _open_in_workdir(name: str, flags: int, mode: int, owner: int | None = None) -> int:
    """``os.open(name)`` in the cwd (the task's workdir) that follows no link and blocks on no FIFO,
    for a regular file of the workdir's owner (``owner``, when the caller looked already) or one of
    the zygote's own with a single link."""
    fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY, mode)
    st = os.fstat(fd)
    me = os.geteuid()
    if owner is None:
        owner = os.stat(".").st_uid
    if not stat.S_ISREG(st.st_mode) or not (
        (st.st_uid == me and (st.st_nlink == 1 or owner == me)) or st.st_uid == owner
    ):
        os.close(fd)
        raise OSError(errno.EPERM, f"{name} is not a regular file of the task's; not used")
    os.set_blocking(fd, True)
    return fd


def _become(user: dict) -> None:  # type: ignore[type-arg]
    """Drop to the task's user (as ``runuser`` would: supplementary groups, then gid, then uid)."""
    uid, gid = int(user["uid"]), int(user["gid"])
    if (uid, gid) == (os.geteuid(), os.getegid()):
        return
    os.setgroups([int(g) for g in user.get("groups") or [gid]])
    os.setgid(gid)
    os.setuid(uid)


def _take_entry_lock(owner: int | None = None) -> int:
    """Take the cwd's entry lock and record who holds it: its fd (close-on-exec; the lock is held
    until it is closed or this process exits), or -1 when another process holds it or an entry
    already ran here. ``owner``: the workdir's owner, when the caller looked already."""
    fd = _open_in_workdir(ENTRY_LOCK, os.O_RDWR | os.O_CREAT, 0o600, owner)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return -1
    if os.fstat(fd).st_size:  # an entry already ran here (and ended): not again
        os.close(fd)
        return -1
    pid = os.getpid()
    ticks = _ticks(pid)  # the JSON the runner reads (_entry_holder), written without the json module
    os.write(fd, b'{"pid": %d, "ticks": %s}' % (pid, b"null" if ticks is None else b"%d" % ticks))
    return fd


def _run(main: object) -> int:
    try:
        code = main()  # type: ignore[operator]
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        import traceback

        traceback.print_exc()
        return 1
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stderr.write(f"{code}\n")
    return 1


def _exit(code: int) -> None:
    """What the interpreter does on exit, then ``os._exit`` (never back into the zygote's loop)."""
    threading = sys.modules.get("threading")
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        try:
            shutdown()  # join non-daemon threads
        except BaseException:
            pass
    try:
        import atexit

        atexit._run_exitfuncs()
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except BaseException:
            pass
    os._exit(code & 0xFF)


def preload() -> None:
    """Import :data:`PRELOAD` (a module this interpreter lacks is skipped), then freeze the heap."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    gc.collect()
    gc.freeze()  # a child's collections leave the zygote's objects (and their pages) alone


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    import dreamlake.lakeshore.daemon.entry  # noqa: F401  (and so wire, envelope, msgpack)

    preload()
    try:
        Zygote(sock).serve()
    except (BrokenPipeError, ConnectionResetError):
        pass


if __name__ == "__main__":
    main()
