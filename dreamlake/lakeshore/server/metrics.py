"""Prometheus metrics of one app, in a registry of its own (several apps may share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


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

        self.poll_passes = Counter(
            "lakeshore_poll_passes",
            "Store transactions run by long polls (Store.poll), by what started them: "
            "first (the poll's opening pass), woken (new work), worker (a command for the worker), "
            "recheck (the safety re-check)",
            ["reason"],
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

    def render(self) -> bytes:
        return generate_latest(self.registry)
