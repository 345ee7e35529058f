"""Wakes callbacks when files in watched directories are written: one thread, one inotify instance.

New frames are noticed without polling: a :class:`Watcher` (one thread, one inotify instance via
ctypes, for every pump, :mod:`nymph.pump`) wakes the outbox on each write in a watched workdir, with a safety tick
each second. Where inotify is unavailable (or a watch cannot be added, or ``inotify=False`` for a
filesystem written from other hosts), the watcher polls those workdirs every ``poll_s``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import select
import struct
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def _libc() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:  # pragma: no cover - no libc
        return None


_LIBC = _libc()

# what a pump needs to hear of: bytes written to a file (``write``, ``truncate``, ``splice``: a task's
# output, the entry's journal; the same from a container or a Slurm step through a bind mount), a
# file created, or one renamed into place. Not IN_CLOSE_WRITE: closing adds no bytes, and every
# task's exit closes its logs (and its entry lock), which woke the sender for nothing on every call.
_IN_MODIFY = 0x002
_IN_MOVED_TO = 0x080
_IN_CREATE = 0x100
_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)
TICK_S = 1.0  # with inotify: a safety re-check of every watched workdir


class _Watch:
    def __init__(
        self, path: Path, callback: Callable[[], None], wd: int | None, names: frozenset[bytes] | None
    ) -> None:
        self.path = path
        self.callback = callback
        self.wd = wd  # None: polled
        self.names = names  # the files whose events fire it; None: any

    def hears(self, name: bytes) -> bool:
        """Whether an event on ``name`` (empty: the directory itself, as ``IN_IGNORED``) fires it."""
        return self.names is None or not name or name in self.names


class Watcher:
    """Wakes callbacks when files in watched directories are written (inotify, else polling)."""

    def __init__(self, *, inotify: bool = True, poll_s: float = 0.05) -> None:
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self._watches: dict[int, _Watch] = {}  # id -> watch
        self._by_wd: dict[int, _Watch] = {}
        self._fd = self._init_inotify() if inotify else -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)

    @staticmethod
    def _init_inotify() -> int:
        init = getattr(_LIBC, "inotify_init1", None)
        if init is None:
            log.info("no inotify here: stream journals are polled")
            return -1
        fd = int(init(_IN_NONBLOCK | _IN_CLOEXEC))
        if fd < 0:
            log.warning(
                "inotify_init1 failed (%s): stream journals are polled", os.strerror(ctypes.get_errno())
            )
        return fd

    @property
    def inotify(self) -> bool:
        return self._fd >= 0

    def add(self, path: Path, callback: Callable[[], None], names: Iterable[str] | None = None) -> _Watch:
        """Call ``callback`` (on the watcher's thread) when a file in ``path`` is written, created or
        renamed into place, or only one of ``names`` when they are given (a task's own files, such as
        its entry lock or a temporary result, then wake nobody); and once a tick (:data:`TICK_S`)
        whatever happened, in case an event was missed."""
        wd: int | None = None
        if self._fd >= 0:
            mask = _IN_MODIFY | _IN_MOVED_TO | _IN_CREATE
            got = int(_LIBC.inotify_add_watch(self._fd, os.fsencode(path), mask))
            if got >= 0:
                wd = got
            else:
                log.warning("cannot watch %s with inotify (%s); polling it every %gs",
                            path, os.strerror(ctypes.get_errno()), self._poll_s)  # fmt: skip
        watch = _Watch(
            path, callback, wd, None if names is None else frozenset(os.fsencode(n) for n in names)
        )
        with self._lock:
            self._watches[id(watch)] = watch
            if wd is not None:
                self._by_wd[wd] = watch
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="nymph-watcher", daemon=True)
                self._thread.start()
        if wd is None:  # a polled watch changes the loop's timeout; an inotify one needs no wake-up
            self._poke()
        return watch

    def remove(self, watch: _Watch) -> None:
        with self._lock:
            self._watches.pop(id(watch), None)
            if watch.wd is not None and self._by_wd.get(watch.wd) is watch:
                del self._by_wd[watch.wd]
                _LIBC.inotify_rm_watch(self._fd, watch.wd)  # EINVAL once the directory is gone: fine

    def close(self) -> None:
        self._stop.set()
        self._poke()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for fd in (self._fd, self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._fd = -1

    def _poke(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _run(self) -> None:
        next_tick = time.monotonic() + TICK_S
        waiting = select.poll()  # not select: a busy nymph's descriptors pass 1023, which it refuses
        for fd in [self._wake_r] + ([self._fd] if self._fd >= 0 else []):
            waiting.register(fd, select.POLLIN)
        while not self._stop.is_set():
            with self._lock:
                polled = [w for w in self._watches.values() if w.wd is None]
            timeout = self._poll_s if polled else max(0.0, next_tick - time.monotonic())
            try:
                events = waiting.poll(timeout * 1000)
            except (OSError, ValueError):
                return
            if any(ev & select.POLLNVAL for _, ev in events):
                return  # closed under it (stop): as select's EBADF was
            ready = [fd for fd, _ in events]
            fired: dict[int, _Watch] = {}
            if self._wake_r in ready:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            if self._fd >= 0 and self._fd in ready:
                fired.update(self._read_events())
            for w in polled:
                fired[id(w)] = w
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + TICK_S
                with self._lock:
                    fired.update(self._watches)
            callbacks = {id(w.callback): w.callback for w in fired.values()}
            for callback in callbacks.values():
                try:
                    callback()
                except Exception:
                    log.exception("watcher: a wake-up callback failed")

    def _read_events(self) -> dict[int, _Watch]:
        fired: dict[int, _Watch] = {}
        while True:
            try:
                buf = os.read(self._fd, 64 * 1024)
            except BlockingIOError:
                return fired
            except OSError as exc:
                log.warning("reading inotify events failed: %s", exc)
                return fired
            pos = 0
            with self._lock:
                while pos + _EVENT.size <= len(buf):
                    wd, _mask, _cookie, length = _EVENT.unpack_from(buf, pos)
                    name = buf[pos + _EVENT.size : pos + _EVENT.size + length].rstrip(b"\0")
                    pos += _EVENT.size + length
                    watch = self._by_wd.get(wd)
                    if watch is not None and watch.hears(name):
                        fired[id(watch)] = watch
