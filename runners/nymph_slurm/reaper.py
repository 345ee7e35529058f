"""The batch step's first process: run a command, and take every process it left down with it.

``python -c "$(this file)" CMD [ARGS...]`` (the slurm runner's batch script execs it): it becomes a
child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``), so a descendant whose parent died (a
double-forked, ``setsid()`` daemon) is reparented to it instead of to init. That keeps every such
process inside the job as Slurm's process tracking sees it: ``proctrack/linuxproc`` and
``proctrack/pgid`` follow parentage and process groups, so without this a daemon would survive
``scancel`` (``proctrack/cgroup`` holds it either way). It runs CMD, waits for it while ignoring
SIGTERM (Slurm signals every tracked process itself, CMD included), and once CMD ended it SIGKILLs
whatever is left below it, reaps it, and ends the way CMD did: the same exit code, or the same
signal (so ``ExitCode`` in ``scontrol show job`` is unchanged).

Stdlib only, Python 3.6 syntax, no import of nymph: it runs with the task's interpreter on the
compute node. Linux only (``/proc``, ``prctl``).
"""

import ctypes
import os
import signal
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def children() -> "list[int]":
    """Pids whose parent is this process (zombies included: they are reaped below)."""
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
            ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == me:
            found.append(int(entry))
    return found


def reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main() -> None:
    command = sys.argv[1:]
    if not command:
        sys.stderr.write("nymph reaper: no command\n")
        sys.exit(2)
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    child = os.fork()
    if child == 0:
        try:
            os.execvp(command[0], command)
        except OSError as exc:
            sys.stderr.write(f"nymph reaper: cannot run {command[0]!r}: {exc}\n")
        os._exit(127)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        pid, status = os.waitpid(-1, 0)  # orphans reparented here are reaped too
        if pid == child:
            break
    while True:  # what CMD left: killed, and what they leave in turn comes here next
        left = children()
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        reap()
        time.sleep(0.01)
    sys.stdout.flush()
    sys.stderr.flush()
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        if number not in (signal.SIGKILL, signal.SIGSTOP):  # those cannot be handled, nor reset
            signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
        os._exit(128 + number)  # not reached: the signal ends this process as it ended CMD
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main()
