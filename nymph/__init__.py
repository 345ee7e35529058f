"""nymph: the node agent that runs lakeshore invocations on this machine.

Layout (one concern per module)::

    cli.py        the ``nymph`` console script (start, doctor, runners); resolves config once
    __main__.py   ``python -m nymph``: the console script
    config.py     NymphConfig: flags over NYMPH_* environment over a TOML file; paths made absolute
    errors.py     the exception hierarchy (drawn in its docstring); redact() for URLs and messages
    client.py     the typed control-plane client; the one place that decides what is retryable,
                  and the one "control plane went away" / "reconnected" line of an outage
    identity.py   the worker id (a ULID kept in the state directory)

    agent.py      the agent: registration, the threads, shutdown; wires the pieces below
    poller.py     the long-poll loop (claims only while a slot is free) and the retry policy
    jobs.py       the one table of jobs (invocations and exec jobs) and the commands about them
    health.py     readiness: the runner's health and free disk space (no claims while either is
                  short) and the outbox watchdog
    recovery.py   when to reconcile a previous life's work, and its leases meanwhile
    upgrade.py    version pinning: drain, then exit 75 or install the pinned version and re-exec
    heartbeat.py  lease renewal; its answers carry cancel commands, lost ids and the pin
    sdnotify.py   systemd notifications (ready, status, watchdog, stopping)

    lifecycle.py  the one supervised job lifecycle: claimed, prepared, started, running, settled
    job.py        one invocation: gates, GPUs, workdir, pump, ack (a lifecycle specialisation)
    execjob.py    one namespace exec job: payload, command, result (a lifecycle specialisation)
    slots.py      concurrency slots and GPU assignment
    gpus.py       the host's GPUs (NVML or nvidia-smi) and the pool they are assigned from
    workdir.py    the workdir contract on nymph's side (create, args, outputs, cleanup)
    refs.py       arguments, results and frames by reference (seed 003 argsRef / resultRef)
    pump.py       tails the frame journal (and script logs) into the outbox as frames appear
    outbox.py     the durable outbox: acks and frames on disk until the control plane confirms
    reconcile.py  re-attach to or report what a previous life left behind
    prune.py      removes kept failed workdirs by age and total size, and ``*.old-*`` directories
    codecache.py  code archives calls ship: fetched once per sha256, verified, unpacked read-only,
                  pruned by age and size
    envcache.py   pip environments calls ask for: resolved and built once per lock with uv, as the
                  task user, sealed read-only, pruned by age and size
    cachedir.py   what the two caches share: sealed directories, removal, pruning
    callenv.py    an invocation's environment beyond its code: pip, secrets, variables, mounts
    taskenv.py    what a task's environment is made of, the same on every runner (never nymph's)
    tasktls.py    the control plane's CA (and client certificate) copied into each workdir for the task

    runner.py     the Runner contract that runner plugins implement
    plugins.py    loading runner plugins (entry-point group ``nymph.runners``) and validating them
    runnerkit.py  helpers runners share (image allow-list, log tails, the entry's interpreter)
    resources.py  ``run_config.resources`` sizes, read one way for every runner
    taskuser.py   who tasks run as: never root; a user of its own from the task user pool on the
                  process runner (task_users(cfg) is the one accessor), else the task user
    uidreap.py    kills what a pool user left running outside a task cgroup before the next lease
    uidsweep.py   removes what a pool user left in /tmp, /dev/shm & co. and its SysV IPC objects
    limits.py     memory.max / pids.max in each process-runner task's cgroup, and OOM kills
    doctor.py     ``nymph doctor``: checks with what to fix
    observability.py  logs (text or JSON lines, the job's id on each), metrics, /healthz
"""

from __future__ import annotations
