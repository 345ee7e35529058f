"""Prometheus metrics of one app, in a registry of its own (several apps may share a process).

Counters and histograms count what this replica did. The gauges (queue depth, oldest queued age,
live workers, invocations by state) describe the store, shared by every replica: ``GET /metrics``
reads them from the store just before rendering (:meth:`Metrics.observe_store`), so any replica
answers the same and an autoscaler (KEDA: packaging/keda/scaledobject.yaml) can scale on
``lakeshore_queue_depth{state="queued"}``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.store.api import QueueStats

FRAME_KIND_NAMES = {
    wire.FRAME_VALUE: "value",
    wire.FRAME_END: "end",
    wire.FRAME_ERROR: "error",
    wire.FRAME_LOG: "log",
}


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.submits = Counter(
            "lakeshore_submits", "Invocations submitted", ["duplicate"], registry=self.registry
        )
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}  # see child()
        self.claims = Counter(
            "lakeshore_claims", "Commands handed to daemons by poll", ["kind"], registry=self.registry
        )
        self.acks = Counter("lakeshore_acks", "Acks received", ["state", "outcome"], registry=self.registry)
        self.chunks = Counter(
            "lakeshore_result_chunks", "Frames journaled", ["duplicate"], registry=self.registry
        )
        self.frames = Counter(
            "lakeshore_frames_appended",
            "Frames journaled (not counting repeats), by kind: value, end, error, log (an "
            "invocation's stdout/stderr); topic posts as owner=topic. rate() gives frames per second",
            ["kind", "owner"],
            registry=self.registry,
        )
        self.claim_latency = Histogram(
            "lakeshore_claim_latency_seconds",
            "Time from submit to the first claim by a worker (first attempts only: a retry's wait "
            "would include the attempts before it)",
            ["queue"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600),
            registry=self.registry,
        )
        self.expired = Counter(
            "lakeshore_leases_expired", "Invocations whose lease lapsed", registry=self.registry
        )
        self.gc_deleted = Counter(
            "lakeshore_gc_deleted",
            "Expired rows and objects the retention sweep deleted",
            ["kind"],  # invocations, frames, attempts, exec_jobs, payloads
            registry=self.registry,
        )
        self.gc_runs = Counter(
            "lakeshore_gc_runs", "Retention sweeps run", ["outcome"], registry=self.registry
        )
        self.poll_wait = Histogram(
            "lakeshore_poll_wait_seconds",
            "Time a daemon poll waited before answering",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120),
            registry=self.registry,
        )
        self.gc_pause = Histogram(
            "lakeshore_gc_pause_seconds",
            "Pauses of the garbage collector, which stops every thread of the server "
            "(server/gctune.py), by generation",
            ["generation"],
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1),
            registry=self.registry,
        )
        self.write_batch = Histogram(
            "lakeshore_write_batch_size",
            "Writes (submits, acks, frames, heartbeats) committed per group-commit transaction",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=self.registry,
        )
        self.write_seconds = Histogram(
            "lakeshore_write_seconds",
            "Time from a write reaching the group commit to its answer (queued behind other "
            "transactions, then its own commit), by kind of write",
            ["kind"],
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1, 5),
            registry=self.registry,
        )

        self.poll_passes = Counter(
            "lakeshore_poll_passes",
            "Store transactions run by long polls (Store.poll), by what started them: "
            "first (the poll's opening pass), woken (new work), handed (new work, the pass in its "
            "submit's transaction), worker (a command for the worker), "
            "recheck (the safety re-check)",
            ["reason"],
            registry=self.registry,
        )
        self.idle_answers = Counter(
            "lakeshore_idle_answers",
            "Daemon requests answered without a store transaction (server/idle.py): renewal (a "
            "poll renewal that skipped its opening pass), heartbeat (an idle daemon's, its poll waiting)",
            ["kind"],
            registry=self.registry,
        )
        self.polls_refused = Counter(
            "lakeshore_polls_refused",
            "Long polls answered 503 because --max-polls were being served",
            registry=self.registry,
        )
        self.polls_waiting = Gauge(
            "lakeshore_polls_waiting", "Long polls waiting for work now", registry=self.registry
        )
        self.polls_active = Gauge(
            "lakeshore_polls_active", "Long polls being served now (waiting or not)", registry=self.registry
        )
        self.relay_listening = Gauge(
            "lakeshore_relay_listening",
            "1 while PostgreSQL LISTEN carries other replicas' wake-ups to this one",
            registry=self.registry,
        )

        self.queue_depth = Gauge(
            "lakeshore_queue_depth",
            "Invocations of a queue that are queued or running",
            ["queue", "state"],
            registry=self.registry,
        )
        self.oldest_queued = Gauge(
            "lakeshore_queue_oldest_queued_seconds",
            "Age of the oldest queued invocation of a queue (0 when none is queued)",
            ["queue"],
            registry=self.registry,
        )
        self.queue_workers = Gauge(
            "lakeshore_queue_workers_live",
            "Live workers (seen within the live window) serving a queue",
            ["queue"],
            registry=self.registry,
        )
        self.workers_live = Gauge(
            "lakeshore_workers_live", "Workers seen within the live window", registry=self.registry
        )
        self.invocations = Gauge(
            "lakeshore_invocations",
            "Invocations in the store by queue and state (terminal states: outcomes)",
            ["queue", "state"],
            registry=self.registry,
        )

    def observe_store(
        self, queues: Iterable[QueueStats], workers_live: int, now: float | None = None
    ) -> None:
        """Set the store gauges from one reading; queues gone from the reading drop out."""
        now = time.time() if now is None else now
        for gauge in (self.queue_depth, self.oldest_queued, self.queue_workers, self.invocations):
            gauge.clear()
        for q in queues:
            for state in ("queued", "running"):
                self.queue_depth.labels(queue=q.name, state=state).set(q.counts.get(state, 0))
            age = max(0.0, now - q.oldest_queued_at) if q.oldest_queued_at is not None else 0.0
            self.oldest_queued.labels(queue=q.name).set(age)
            self.queue_workers.labels(queue=q.name).set(q.workers_live)
            for state, n in q.counts.items():
                self.invocations.labels(queue=q.name, state=state).set(n)
        self.workers_live.set(workers_live)

    def child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)`` (the values in the order of its label names), made once:
        ``labels()`` checks, hashes and locks its values on every call, and a warm call made
        eight of them (the hot routes' counters and histograms use this)."""
        key = (id(metric), values)
        got = self._children.get(key)
        if got is None:
            got = self._children[key] = metric.labels(*values)
        return got

    def submitted(self, duplicate: bool, n: int = 1) -> None:
        """Count ``n`` submits."""
        self.child(self.submits, "true" if duplicate else "false").inc(n)

    def frames_appended(self, kinds: Iterable[int], owner: str = "invocation") -> None:
        """Count journaled frames by their kind (ints on the wire, named here)."""
        counts: dict[str, int] = {}
        for kind in kinds:
            name = FRAME_KIND_NAMES.get(kind, str(kind))
            counts[name] = counts.get(name, 0) + 1
        for name, n in counts.items():
            self.child(self.frames, name, owner).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
