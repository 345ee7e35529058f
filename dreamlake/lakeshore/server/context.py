"""What every route needs: the store (run off-loop), the group-commit writer, wake-ups, the poll
hub, auth and worker bindings, metrics, config, plugins and the live-queue watch behind submit's
"no worker" warning."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dreamlake.lakeshore import envvars
from dreamlake.lakeshore.errors import PlaneError, QuotaExceeded
from dreamlake.lakeshore.server import task_tokens
from dreamlake.lakeshore.server.auth import Authenticator
from dreamlake.lakeshore.server.authz import WorkerBindings
from dreamlake.lakeshore.server.config import ServerConfig
from dreamlake.lakeshore.server.http import HTTPError
from dreamlake.lakeshore.server.hub import StoreRunner, Wakeups
from dreamlake.lakeshore.server.idle import DaemonMemo
from dreamlake.lakeshore.server.liveness import QueueWatch
from dreamlake.lakeshore.server.metrics import Metrics
from dreamlake.lakeshore.server.outcomes import AcksInFlight
from dreamlake.lakeshore.server.polls import PollHub
from dreamlake.lakeshore.server.quotas import Quotas
from dreamlake.lakeshore.server.quotas import answer as quota_answer
from dreamlake.lakeshore.server.task_tokens import TaskTokens
from dreamlake.lakeshore.server.writer import GroupWriter
from dreamlake.lakeshore.store.api import Principal, Store, WriteRequest, WriteResult
from dreamlake.lakeshore.store.outage import Outages, classify

log = logging.getLogger(__name__)

T = TypeVar("T")


def store_dialect(store: Any) -> str:
    """``"sqlite"`` or ``"postgresql"``, from the store's database when it exposes one."""
    db = getattr(store, "db", None) or getattr(store, "database", None)
    dialect = getattr(db, "dialect", None) or getattr(store, "dialect", None)
    if isinstance(dialect, str):
        return dialect
    url = str(getattr(store, "url", "") or getattr(db, "url", ""))
    return "postgresql" if url.startswith("postgres") else "sqlite"


def answer_of(exc: PlaneError) -> Exception:
    """A store refusal with a 4xx status as that HTTP answer; anything else unchanged (a 500, or
    a store outage's 503: the app's guard answers it). A quota's refusal keeps its ``quota``,
    ``limit`` and ``Retry-After`` (server/quotas.py)."""
    if isinstance(exc, QuotaExceeded):
        return quota_answer(exc)
    if isinstance(exc.status, int) and 400 <= exc.status < 500:
        return HTTPError(exc.status, str(exc))
    return exc


@dataclass
class Context:
    store: Store
    config: ServerConfig
    fanout: Any = None
    payloads: Any = None
    dialect: str = "sqlite"
    metrics: Metrics = field(default_factory=Metrics)

    def __post_init__(self) -> None:
        threads = self.config.store_threads or (1 if self.dialect == "sqlite" else 8)
        self.runner = StoreRunner(threads)
        self.wake = Wakeups(self.store)
        self.polls = PollHub(
            self.wake.notifier,
            max_polls=self.config.max_polls,
            recheck_s=self.config.recheck_s,
            safety_recheck_s=self.config.poll_recheck_s,
        )
        self.polls.shared_store = self.dialect == "postgresql"
        shape_needs = getattr(self.store, "shape_needs", None)
        if shape_needs is not None:
            self.polls.needs_of = shape_needs
        self.daemons = DaemonMemo(self.polls)
        self.metrics.polls_waiting.set_function(lambda: self.polls.waiting)
        self.metrics.polls_active.set_function(lambda: self.polls.active)
        self.metrics.relay_listening.set_function(
            lambda: float(self.polls.relay is not None and self.polls.relay.listening)
        )
        self.auth = Authenticator(self._verify)
        self.acks = AcksInFlight()
        self.outages = Outages(hold_s=self.config.lease_s)
        self.writer = GroupWriter(
            self.store,
            outages=self.outages,
            observe=self.metrics.write_batch.observe,
            timed=lambda kind, s: self.metrics.child(self.metrics.write_seconds, kind).observe(s),
            handoff=self.polls.hand_off,
            inline_lock=self.store.inline_write_lock(),
        )
        self.workers = WorkerBindings(lambda worker, token: self.call(self.store.bind_worker, worker, token))
        self.queues = QueueWatch()
        self._task_tokens: TaskTokens | None = None
        self.quotas = Quotas(  # per-namespace limits (server/quotas.py)
            self.call, self.store, payload_window=lambda: getattr(self.payloads, "retention_s", None)
        )
        self.secret_sealer: Any = None  # server.secrets.Sealer, made on first use (server/secrets.py)

    @property
    def inline_threshold(self) -> int | None:
        """``INLINE_THRESHOLD_BYTES`` when a payload store (bucket or blob directory) takes what is
        larger; None without one: then everything stays inline (seed 003: ``bucketConfigured()``
        false keeps the control plane on the inline-bytes wire)."""
        config = getattr(self.payloads, "config", None)
        return None if config is None else int(config.inline_threshold_bytes)

    @property
    def max_payload_bytes(self) -> int:
        """``MAX_PAYLOAD_BYTES``: the largest upload the payload store presigns (its default
        without a payload store, where nothing is uploaded)."""
        config = getattr(self.payloads, "config", None)
        return envvars.DEFAULT_MAX_PAYLOAD_BYTES if config is None else int(config.max_payload_bytes)

    def check_inline(self, what: str, size: int, namespace: str, use: str) -> None:
        """413 (:func:`~.payloads.over_threshold`) when ``size`` bytes may not ride inline."""
        limit = self.inline_threshold
        if limit is not None and size > limit:
            from dreamlake.lakeshore.server.payloads import over_threshold  # only when refusing

            err = over_threshold(what, size, limit, namespace, use)
            raise HTTPError(413, err.message, inline_threshold_bytes=limit)

    def ref(
        self, value: object, what: str, namespace: str | None = None, *, legacy: bool = False
    ) -> dict[str, Any]:
        """A payload ref from a body, checked (400 otherwise; 501 without a payload store); with
        ``namespace``, its key must be one presigned there (404 otherwise; ``legacy``: or one
        minted before keys carried their namespace)."""
        from dreamlake.lakeshore.server.payloads import PayloadError, check_key_in, check_ref

        if self.payloads is None:
            raise HTTPError(
                501,
                f"{what}: this control plane has no payload store (set LAKESHORE_BLOBS_BUCKET or "
                "LAKESHORE_BLOBS_DIR), so payloads ride inline: send the bytes",
            )
        try:
            ref = check_ref(value, what)
            if namespace is not None:
                try:
                    check_key_in(ref["key"], namespace, legacy=legacy)
                except PayloadError as exc:
                    raise PayloadError(exc.status, f"{what}.key: {exc.message}") from None
            return ref
        except PayloadError as exc:
            raise HTTPError(exc.status, exc.message) from None

    @property
    def closing(self) -> bool:
        """The server is shutting down (:meth:`begin_shutdown`): long requests answer now."""
        return self.wake.closing

    def begin_shutdown(self) -> None:
        """The server stops accepting: answer the long requests in flight now instead of being
        cancelled with them (a traceback each, HTTP 500 to nymph). Waiting polls answer empty,
        awaits answer ``pending``, streams end without a final frame (the client resumes with
        ``since=``). Idempotent; run on the event loop."""
        if self.wake.closing:
            return
        log.info("shutting down: answering %d waiting long polls", self.polls.waiting)
        self.polls.drain()
        self.wake.close_waits()

    async def task_tokens(self) -> TaskTokens:
        """The signer of task tokens, under the key every replica shares (read once)."""
        if self._task_tokens is None:
            self._task_tokens = TaskTokens(await self.call(self.store.server_key, task_tokens.KEY_NAME))
        return self._task_tokens

    async def _verify(self, secret: str) -> Principal | None:
        if secret.startswith(task_tokens.PREFIX):
            return (await self.task_tokens()).verify(secret)
        return await self.call(self.store.verify_token, secret)

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a store method in the store thread; a PlaneError with a 4xx status becomes that answer."""
        try:
            return await self.runner(fn, *args, **kwargs)
        except PlaneError as exc:
            raise answer_of(exc) from None
        except Exception as exc:  # the store is down (503), or a bug (500: the guard logs it)
            outage = classify(exc)
            if outage is None:
                raise
            self.outages.failed(outage)
            raise outage from None

    async def write(self, request: WriteRequest) -> WriteResult:
        """Write through the group commit (answered once committed); a 4xx PlaneError becomes
        that answer, as in ``call``."""
        try:
            return await self.writer.write(request)
        except PlaneError as exc:
            raise answer_of(exc) from None

    async def write_many(
        self, requests: list[WriteRequest], settle: Callable[[list[Any]], None] | None = None
    ) -> list[WriteResult | PlaneError]:
        """Write ``requests`` in one group commit (``GroupWriter.write_many``): each one's result
        or its refusal, in order, once committed (``settle`` called with them first, at once)."""
        try:
            return await self.writer.write_many(requests, settle)
        except PlaneError as exc:
            raise answer_of(exc) from None

    async def queue_warning(self, queue: str) -> str | None:
        """The "no worker has polled queue ..." warning, or None when a live worker serves it."""
        return await self.queues.warning(queue, lambda window: self.call(self.store.live_queues, window))

    def close(self) -> None:
        self.runner.close()
