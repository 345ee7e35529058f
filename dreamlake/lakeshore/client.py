"""The control-plane client: one transport, one token, one retry rule, one error tree.

Every client of the control plane's HTTP routes speaks through :class:`PlaneClient`: nymph
(``nymph.client.ControlPlaneClient``, the typed ``/v1/daemon/*`` wrapper) and the SDK's HTTP plane
(``dispatch.http.HttpDispatch``). It owns

* the transport: one ``httpx.Client`` (``transport=`` is injectable: tests fake the control plane
  with ``httpx.MockTransport``), the bearer token, msgpack bodies both ways, JSON for the routes
  that speak JSON (``as_json=True``);
* the error tree: every httpx failure and every 4xx/5xx answer becomes a class of
  :mod:`dreamlake.lakeshore.errors`, raised ``from`` the httpx exception where there is one::

      failure                                    raised                    retried
      connection error, timeout, other httpx     Unavailable (status None) yes
      5xx but 501/505, an undecodable 2xx answer Unavailable               yes
      429 (waits out its Retry-After)            Unavailable               yes
      429 naming a quota (``quota`` in the body) QuotaExceeded             no
      401                                        Unauthorized              no
      403                                        Forbidden                 no
      404                                        NotFound                  no
      409                                        Conflict                  no
      another 4xx, 501, 505, a bad URL           BadRequest                no

* the retry rule: :func:`is_retryable` (``Unavailable`` and nothing else) and :func:`retrying`,
  the tenacity policy built on it: exponential backoff with jitter, never sooner than the
  server's ``Retry-After``.

A :class:`PlaneClient` retries its own requests ``attempts`` times, or for ``window_s`` seconds
from the first try, which runs before any policy is built (the SDK's plane retries for
``DEFAULT_RETRY_WINDOW_S``, long enough to outlast a server restart); nymph keeps
``attempts=1`` and retries in its agent and outbox, whose loops stop with the agent. Nothing
here imports the server or the store.
"""

from __future__ import annotations

import contextlib
import email.utils
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import msgpack
import tenacity

from dreamlake.lakeshore import envvars, tls
from dreamlake.lakeshore.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    LakeshoreError,
    NotFound,
    PlaneError,
    QuotaExceeded,
    Unauthorized,
    Unavailable,
)
from dreamlake.lakeshore.keepalive import KeepAlive, KeepAliveError, Reply, usable

__all__ = ["DEFAULT_RETRY_WINDOW_S", "MSGPACK", "PlaneClient", "error_for", "is_retryable", "retrying"]

_IN_TASK_HINT = (
    "This task runs under nymph: is the control plane reachable from its sandbox? The docker and "
    "gvisor runners give a task no network by default (network none): start nymph with "
    "--runner-opt network=host (or allow a network with allowed_networks and set run_config "
    "network), and --task-url when tasks reach the control plane at another address "
    "(docs/nymph.md, 'Tasks that submit tasks')"
)

log = logging.getLogger(__name__)

MSGPACK = "application/x-msgpack"
CONNECT_TIMEOUT_S = 5.0
RETRY_AFTER_CAP_S = 60.0  # a Retry-After longer than this is waited for this long, then retried
#: How long the SDK's plane keeps retrying a transient failure: a restart of ``lakeshore server``
#: takes a few seconds, a rolling upgrade of replicas longer. ``LAKESHORE_RETRY_WINDOW`` (seconds)
#: or ``HttpDispatch(retry_window=...)`` change it.
DEFAULT_RETRY_WINDOW_S = 60.0
RETRY_WINDOW_ENV = "LAKESHORE_RETRY_WINDOW"
WINDOW_MAX_WAIT_S = 2.0  # within a window, never wait longer than this between tries

_TOKEN_HINT = (
    "Pass a valid token of the right kind (producer to submit and stream, daemon for workers and "
    "nymph): `lakeshore token create --kind producer|daemon --name NAME`"
)


def is_retryable(exc: BaseException) -> bool:
    """The one retry rule: :class:`Unavailable` (connection, timeout, 5xx, 429) and nothing else."""
    return isinstance(exc, Unavailable)


# 5xx answers that no retry changes: 501 Not Implemented (e.g. presign on a control plane without
# a payload store) and 505 HTTP Version Not Supported. Retrying them would only spend the window.
PERMANENT_5XX = frozenset({501, 505})


def error_for(
    status: int, message: str, *, retry_after: float | None = None, quota: Any = None, limit: Any = None
) -> PlaneError:
    """The error class of an HTTP ``status`` (>= 400), carrying ``message`` and the status; a 429
    whose answer names a ``quota`` (server/quotas.py) is a :class:`QuotaExceeded`."""
    if status == 429 and isinstance(quota, str):
        return QuotaExceeded(
            message, status, retry_after, quota=quota, limit=limit if isinstance(limit, int) else None
        )
    if status == 401:
        return Unauthorized(message, status)
    if status == 403:
        return Forbidden(message, status)
    if status == 404:
        return NotFound(message, status)
    if status == 409:
        return Conflict(message, status)
    if status == 429 or (status >= 500 and status not in PERMANENT_5XX):
        return Unavailable(message, status, retry_after)
    return BadRequest(message, status)


class _WaitRetryAfter(tenacity.wait.wait_base):
    """``base``'s wait, stretched to the ``Retry-After`` of the failure being retried (capped)."""

    def __init__(self, base: tenacity.wait.wait_base) -> None:
        self.base = base

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        wait = float(self.base(retry_state))
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        after = getattr(exc, "retry_after", None)
        return max(wait, min(float(after), RETRY_AFTER_CAP_S)) if after else wait


def retrying(
    *,
    attempts: int | None = None,
    stop: tenacity.stop.stop_base | None = None,
    initial_s: float = 0.1,
    max_s: float = 5.0,
    jitter_s: float = 0.2,
    also: tuple[type[BaseException], ...] = (),
    sleep: Callable[[float], None] = time.sleep,
    before_sleep: Callable[[tenacity.RetryCallState], None] | None = None,
) -> tenacity.Retrying:
    """The tenacity policy for control-plane calls: retry what :func:`is_retryable` accepts (and the
    ``also`` classes), waiting ``initial_s * 2**n`` (at most ``max_s``) plus up to ``jitter_s``, and
    at least a ``Retry-After``; stop after ``attempts`` or at ``stop``; re-raise the last failure."""
    if stop is None:
        stop = tenacity.stop_after_attempt(max(1, attempts or 1))
    elif attempts is not None:
        stop = stop | tenacity.stop_after_attempt(max(1, attempts))
    kwargs: dict[str, Any] = {} if before_sleep is None else {"before_sleep": before_sleep}
    return tenacity.Retrying(
        retry=tenacity.retry_if_exception(lambda exc: is_retryable(exc) or isinstance(exc, also)),
        wait=_WaitRetryAfter(
            tenacity.wait_exponential(multiplier=initial_s, max=max_s) + tenacity.wait_random(0, jitter_s)
        ),
        stop=stop,
        sleep=sleep,
        reraise=True,
        **kwargs,
    )


class PlaneClient:
    """A control plane at ``url`` (``http://host:8470``), authenticated with a bearer ``token``.

    Thread-safe (``httpx.Client`` is). ``timeout_s`` is the default read timeout of a request;
    ``attempts`` how many times :meth:`request` tries a request that fails retryably, ``window_s``
    (when given) for how long it keeps trying: the first of the two to run out stops it.
    """

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout_s: float = 30.0,
        attempts: int | None = 1,
        window_s: float | None = None,
        transport: httpx.BaseTransport | None = None,
        ca_file: str | None = None,
        client_cert: str | None = None,
        client_key: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        # TLS (tls.py): the system's CAs plus --ca-file / LAKESHORE_CA_FILE, an optional client cert
        self._ssl = (
            tls.client_context(ca_file, client_cert, client_key) if self.url.startswith("https") else None
        )
        verify: Any = self._ssl if self._ssl is not None else True
        self.attempts = None if attempts is None else max(1, attempts)
        self.window_s = None if window_s is None else max(0.0, float(window_s))
        self._warned_unreachable = False  # a retried unreachable plane is logged once
        self._transport = transport
        self._bare: httpx.Client | None = None
        self._bare_lock = threading.Lock()
        headers = {"Authorization": f"Bearer {token}", "Accept": MSGPACK}
        self._timeout_s = timeout_s
        self._http = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=_timeout(timeout_s),
            transport=transport,
            verify=verify,
        )
        # ordinary requests over keep-alive http.client connections where they can (keepalive.py)
        self._fast: KeepAlive | None = None
        if transport is None and usable(self.url):
            self._fast = KeepAlive(
                self.url, headers, connect_timeout_s=CONNECT_TIMEOUT_S, ssl_context=self._ssl
            )

    def close(self) -> None:
        if self._fast is not None:
            self._fast.close()
        self._http.close()
        if self._bare is not None:
            self._bare.close()

    def bare(self) -> httpx.Client:
        """An HTTP client without the bearer token (presigned URLs: never send the token to S3),
        on the same transport, made once and kept (an ``httpx.Client`` costs an SSL context)."""
        with self._bare_lock:
            if self._bare is None:
                self._bare = httpx.Client(
                    transport=self._transport, timeout=_timeout(60.0), verify=self._ssl or True
                )
            return self._bare

    @property
    def transport(self) -> httpx.BaseTransport | None:
        """The injected transport (None: httpx's own), for requests made without the token: the
        presigned payload URLs of ``dreamlake.lakeshore.blobs``."""
        return self._transport

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"

    # -- requests -----------------------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        as_json: bool = False,
        params: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        attempts: int | None = None,
        within_s: float | None = None,
    ) -> Any:
        """Send ``body`` (msgpack, or JSON with ``as_json``; none when ``None``) and return the
        decoded answer, retrying a retryable failure up to ``attempts`` (default: the client's)
        within the client's window, or ``within_s`` when that is shorter (a caller's deadline)."""
        request: dict[str, Any] = {"params": params}
        if as_json:
            request["headers"] = {"Accept": "application/json"}
            if body is not None:
                request["json"] = body
        elif body is not None:
            request["content"] = msgpack.packb(body, use_bin_type=True)
            request["headers"] = {"Content-Type": MSGPACK}
        if timeout_s is not None:
            request["timeout_s"] = timeout_s
        tries = self.attempts if attempts is None else attempts
        if tries is not None and tries <= 1:  # one try (nymph's every call): no policy to build and run
            return self._once(method, path, request)
        # The first try runs before any policy: building and running tenacity's cost more Python
        # than the request's own (a quarter of an ``f.call()``'s client side). A failure the policy
        # would retry becomes the policy's first try, with the window's time it took spent.
        started = time.monotonic()
        try:
            return self._once(method, path, request)
        except Exception as exc:
            if not is_retryable(exc):
                raise
            first = [exc]
        spent_s = time.monotonic() - started
        policy = self.policy(attempts, spent_s=spent_s, within_s=within_s)
        if getattr(first[0], "unreachable", False) and not self._warned_unreachable:
            self._warned_unreachable = True  # once per client: a caller is not left silent for the window
            window = self.window_s if within_s is None else min(within_s, self.window_s or within_s)
            left = "" if window is None else f" for up to {max(0.0, window - spent_s):.0f} s"
            log.warning("%s; retrying%s", first[0], left)
        reached = [False]  # whether any try may have been received (not a refused connection)

        def attempt() -> Any:
            try:
                if first:
                    raise first.pop()
                return self._once(method, path, request)
            except Exception as exc:
                reached[0] = reached[0] or not getattr(exc, "unsent", False)
                raise

        try:
            return policy(attempt)
        except Unavailable as exc:
            exc.maybe_received = reached[0]  # False: no try reached the plane (nothing stored)
            raise

    def policy(
        self, attempts: int | None = None, *, spent_s: float = 0.0, within_s: float | None = None
    ) -> tenacity.Retrying:
        """This client's retry policy: ``attempts`` (default: the client's) and its window (or
        ``within_s``, when shorter), less ``spent_s`` of it already spent."""
        attempts = self.attempts if attempts is None else attempts
        window = self.window_s if within_s is None else min(within_s, self.window_s or within_s)
        if window is None:
            return retrying(attempts=attempts)
        return retrying(
            attempts=attempts,
            stop=tenacity.stop_after_delay(max(0.0, window - spent_s)),
            max_s=WINDOW_MAX_WAIT_S,
        )

    def _once(self, method: str, path: str, request: dict[str, Any]) -> Any:
        if self._fast is not None and "json" not in request:
            try:
                resp: httpx.Response | Reply = self._fast.request(
                    method,
                    path,
                    content=request.get("content"),
                    headers=request.get("headers"),
                    params=request.get("params"),
                    read_timeout_s=request.get("timeout_s") or self._timeout_s,
                )
            except KeepAliveError as exc:
                raise self._unreachable(f"{method} {path}", exc) from exc
        else:
            with self._translated(f"{method} {path}"):
                resp = self._http.request(method, path, **_httpx_request(request))
        if resp.status_code >= 400:  # a refusal: its error tree reads an httpx.Response
            raise self._refusal(resp.response() if isinstance(resp, Reply) else resp, f"{method} {path}")
        if not resp.content:
            return {}
        try:
            return _decode(resp)
        except ValueError as exc:
            what = f"{method} {path}"
            raise Unavailable(
                f"{what}: undecodable answer (HTTP {resp.status_code}, "
                f"{resp.headers.get('content-type', 'no content type')}): {resp.text[:80]!r}",
                resp.status_code,
            ) from exc

    def put_file(
        self, path: str, fh: Any, size: int, *, params: dict[str, Any] | None = None, timeout_s: float = 120.0
    ) -> Any:
        """``PUT path`` with the token and ``size`` raw bytes read from ``fh`` (streamed, not held
        in memory); the decoded answer. Never retried here (the file would have to be read again)."""
        what = f"PUT {path}"

        def body() -> Iterator[bytes]:
            left = size
            while left > 0:
                piece = fh.read(min(left, 1 << 20))
                if not piece:
                    return
                left -= len(piece)
                yield piece

        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        with self._translated(what):
            resp = self._http.put(
                path, content=body(), params=params, headers=headers, timeout=_timeout(timeout_s)
            )
        if resp.status_code >= 400:
            raise self._refusal(resp, what)
        return _decode(resp) if resp.content else {}

    @contextlib.contextmanager
    def stream(
        self, path: str, *, params: dict[str, Any] | None = None, timeout_s: float | None = None
    ) -> Iterator[httpx.Response]:
        """``GET path`` as a stream: the response, its status already checked. Failures while it is
        read (a dropped connection) are translated too: :class:`Unavailable`. Never retried here."""
        what = f"GET {path}"
        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else _timeout(timeout_s)
        with (
            self._translated(what),
            self._http.stream("GET", path, params=params, timeout=timeout) as resp,
        ):
            if resp.status_code >= 400:
                resp.read()
                raise self._refusal(resp, what)
            yield resp

    def download(self, url: str, *, timeout_s: float = 60.0, limit: int = 100 * 2**20) -> bytes:
        """GET an absolute (presigned) ``url`` without the token: the signature is the credential.
        More than ``limit`` bytes is a :class:`BadRequest`."""
        what = f"GET {url.split('?')[0]}"
        with (
            httpx.Client(
                transport=self._transport, timeout=_timeout(timeout_s), verify=self._ssl or True
            ) as bare,
            self._translated(what),
            bare.stream("GET", url) as resp,
        ):
            if resp.status_code != 200:
                resp.read()
                raise error_for(
                    resp.status_code, f"{what} failed with HTTP {resp.status_code}: {_reason(resp)}"
                )
            data = bytearray()
            for part in resp.iter_bytes():
                data += part
                if len(data) > limit:
                    raise BadRequest(f"{what}: payload over {limit} bytes")
            return bytes(data)

    def healthz(self) -> dict[str, Any]:
        """``GET /healthz`` (JSON, 5 s, tried once); an answer that is not a JSON object is ``{}``."""
        what = "GET /healthz"
        with self._translated(what):
            resp = self._http.get("/healthz", timeout=CONNECT_TIMEOUT_S)
        if resp.status_code != 200:
            raise self._refusal(resp, what)
        try:
            out = resp.json()
        except ValueError:
            out = {}
        return out if isinstance(out, dict) else {}

    # -- errors -------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _translated(self, what: str) -> Iterator[None]:
        """httpx's exceptions raised inside, as :mod:`errors` classes (``from`` the original)."""
        try:
            yield
        except httpx.TransportError as exc:
            raise self._unreachable(what, exc) from exc
        except httpx.HTTPError as exc:  # a malformed answer (bad encoding, redirect loop): try again
            raise Unavailable(f"{what}: {type(exc).__name__}: {exc}") from exc
        except httpx.InvalidURL as exc:  # e.g. a path built from a bad name: never retried
            raise BadRequest(f"{what}: invalid URL: {exc}") from exc

    def _unreachable(self, what: str, exc: BaseException) -> LakeshoreError:
        if tls.untrusted(exc):  # not a transient failure: retrying cannot help, the message says what to do
            return BadRequest(f"{what}: {tls.untrusted_message(self.url, exc)}")
        err = Unavailable(
            f"cannot reach the control plane at {self.url} ({what}): {type(exc).__name__}: {exc}. "
            + (
                _IN_TASK_HINT
                if envvars.is_set("LAKESHORE_INVOCATION_ID")
                else "Is `lakeshore server` running there?"
            )
        )
        err.unreachable = True
        # a connection refused or a name not resolved: nothing of the request was sent
        cause = exc.__cause__ if isinstance(exc, KeepAliveError) else exc
        err.unsent = isinstance(exc, httpx.ConnectError) or isinstance(
            cause, (ConnectionRefusedError, socket.gaierror)
        )
        return err

    def _refusal(self, resp: httpx.Response, what: str) -> PlaneError:
        status = resp.status_code
        reason = _reason(resp)
        if status in (401, 403):
            message = (
                f"the control plane at {self.url} refused the token for {what} (HTTP {status}): "
                f"{reason}. {_TOKEN_HINT}"
            )
        else:
            message = f"{what} failed with HTTP {status}: {reason}"
        quota = _answer(resp) if status == 429 else {}
        return error_for(
            status,
            message,
            retry_after=_retry_after(resp),
            quota=quota.get("quota"),
            limit=quota.get("limit"),
        )


def _httpx_request(request: dict[str, Any]) -> dict[str, Any]:
    """``request``'s fields as ``httpx.Client.request`` keywords."""
    out = {k: v for k, v in request.items() if k != "timeout_s"}
    if request.get("timeout_s") is not None:
        out["timeout"] = _timeout(request["timeout_s"])
    return out


def _timeout(read_s: float) -> httpx.Timeout:
    return httpx.Timeout(read_s, connect=CONNECT_TIMEOUT_S)


def _decode(resp: httpx.Response | Reply) -> Any:
    """A body by its content type: JSON, or msgpack (also when untyped). ValueError otherwise."""
    ctype = resp.headers.get("content-type", "")
    if "json" in ctype:
        return resp.json()
    if ctype and "msgpack" not in ctype:
        raise ValueError(f"a {ctype} body")
    try:
        return msgpack.unpackb(resp.content, raw=False)
    except msgpack.UnpackException as exc:  # msgpack's other failures are ValueErrors already
        raise ValueError(str(exc)) from exc


def _answer(resp: httpx.Response) -> dict[str, Any]:
    """An error answer's fields (``{}`` when it is not a decodable map)."""
    try:
        detail = _decode(resp) if resp.content else {}
    except ValueError:
        return {}
    return detail if isinstance(detail, dict) else {}


def _reason(resp: httpx.Response) -> str:
    """Why the server refused: its ``error`` text, else the start of its body, else the phrase."""
    if not resp.content:
        return resp.reason_phrase
    try:
        detail = _decode(resp)
    except ValueError:
        return resp.text[:300]
    if isinstance(detail, dict) and "error" in detail:
        return str(detail["error"])
    return str(detail)[:300]


def _retry_after(resp: httpx.Response) -> float | None:
    """``Retry-After`` in seconds (delta-seconds or an HTTP date), ``None`` when absent or bad."""
    value = resp.headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())
