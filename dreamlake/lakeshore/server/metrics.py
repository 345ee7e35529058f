"""Prometheus metrics of one app, in a registry of its own (several apps may share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.submits = Counter(
            "lakeshore_submits", "Invocations submitted", ["duplicate"], registry=self.registry
        )
        self.claims = Counter(
            "lakeshore_claims", "Commands handed to daemons by poll", ["kind"], registry=self.registry
        )
        self.acks = Counter("lakeshore_acks", "Acks received", ["state", "outcome"], registry=self.registry)
        self.chunks = Counter(
            "lakeshore_result_chunks", "Frames journaled", ["duplicate"], registry=self.registry
        )
        self.expired = Counter(
            "lakeshore_leases_expired", "Invocations whose lease lapsed", registry=self.registry
        )
        self.poll_wait = Histogram(
            "lakeshore_poll_wait_seconds",
            "Time a daemon poll waited before answering",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120),
            registry=self.registry,
        )
        self.write_batch = Histogram(
            "lakeshore_write_batch_size",
            "Writes (submits, acks, frames, heartbeats) committed per group-commit transaction",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
