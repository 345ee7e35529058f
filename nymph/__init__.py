"""nymph: the node agent that runs lakeshore invocations on this machine.

Layout (one concern per module)::

    cli.py        the ``nymph`` console script (start, doctor, runners); resolves config once
    config.py     NymphConfig: flags over NYMPH_* environment over a TOML file
    client.py     the typed control-plane client; the one place that decides what is retryable
    identity.py   the worker id (a ULID kept in the state directory)
    agent.py      registration, the poll loop, dispatch of commands, shutdown and version pinning
    slots.py      concurrency slots and GPU assignment
    job.py        one invocation: gates, workdir, runner start, pump, wait, timeout/cancel, ack
    workdir.py    the workdir contract on nymph's side (create, args, outputs, cleanup)
    pump.py       tails the frame journal (and script logs) into the outbox as frames appear
    outbox.py     the durable outbox: acks and frames on disk until the control plane confirms
    heartbeat.py  lease renewal, cancel commands, lost invocations
    reconcile.py  re-attach to or report what a previous life left behind
    doctor.py     ``nymph doctor``: checks with what to fix
    runner.py     the Runner contract that runner plugins implement
"""

from __future__ import annotations
