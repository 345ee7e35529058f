"""The boundary to the Docker engine: the client, docker/requests errors translated, container primitives.

Everything the docker SDK or requests can raise is mapped here to the runner contract's exceptions
(:class:`~nymph.runner.RunnerUnavailable` when the engine cannot be reached, so nymph keeps
retrying; :class:`~nymph.runner.RunnerError` for a refusal that names the problem), always with
``raise ... from`` so the original error stays attached.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any, NamedTuple

import docker
import docker.errors
import requests.exceptions

from nymph.runner import RunnerError, RunnerUnavailable

log = logging.getLogger(__name__)

#: Seconds an API call may take before the client gives up (waits pass their own timeout).
API_TIMEOUT_S = 60

_HOW_TO_START = (
    "start the engine (scripts/services/docker.sh, or `dockerd --bridge=none --iptables=false &`) "
    "or point DOCKER_HOST / the runner's docker_host option at a running one"
)


def engine_location(docker_host: str | None) -> str:
    """Where the client will connect, for messages."""
    return docker_host or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def connect(docker_host: str | None, what: str) -> docker.DockerClient:
    """A client for ``docker_host`` (``DOCKER_HOST`` / the default socket when None); negotiates the API."""
    try:
        if docker_host:
            client = docker.DockerClient(base_url=docker_host, version="auto", timeout=API_TIMEOUT_S)
        else:
            client = docker.from_env(version="auto", timeout=API_TIMEOUT_S)
        client.ping()
    except (docker.errors.DockerException, requests.exceptions.RequestException, OSError) as exc:
        raise RunnerUnavailable(
            f"{what}: the Docker engine at {engine_location(docker_host)} is not reachable ({exc}); "
            f"{_HOW_TO_START}"
        ) from exc
    return client


def is_unreachable(exc: BaseException) -> bool:
    """True when ``exc`` says the engine could not be reached (as opposed to refusing a request)."""
    if isinstance(exc, requests.exceptions.ConnectionError | ConnectionError | FileNotFoundError):
        return True
    return isinstance(exc, docker.errors.DockerException) and not isinstance(exc, docker.errors.APIError)


@contextlib.contextmanager
def translated(what: str, docker_host: str | None = None) -> Iterator[None]:
    """Map docker/requests errors raised inside the block to RunnerUnavailable / RunnerError.

    ``docker.errors.NotFound`` is not caught: call sites decide what a missing object means.
    """
    try:
        yield
    except docker.errors.NotFound:
        raise
    except docker.errors.APIError as exc:
        raise RunnerError(f"{what}: the Docker engine refused: {explain(exc)}") from exc
    except (docker.errors.DockerException, requests.exceptions.RequestException, OSError) as exc:
        if is_unreachable(exc):
            raise RunnerUnavailable(
                f"{what}: lost the Docker engine at {engine_location(docker_host)} ({exc}); {_HOW_TO_START}"
            ) from exc
        raise RunnerError(f"{what}: {exc}") from exc


def explain(exc: docker.errors.APIError) -> str:
    """The engine's own message for an API error (its explanation, not the HTTP wrapper)."""
    detail: Any = getattr(exc, "explanation", None) or str(exc)
    if isinstance(detail, bytes):
        detail = detail.decode("utf-8", "replace")
    return str(detail).strip()


# --- container primitives the runner's lifecycle is made of ----------------------------------------


class Where(NamedTuple):
    """Who is asking (for messages) and which engine (``None``: DOCKER_HOST / the default socket)."""

    who: str
    docker_host: str | None


def state(client: docker.DockerClient, cid: str, where: Where) -> dict[str, Any] | None:
    """The container's ``State``, None when the container does not exist."""
    with translated(f"{where.who}: inspect", where.docker_host):
        try:
            info = client.api.inspect_container(cid)
        except docker.errors.NotFound:
            return None
    found: dict[str, Any] = info.get("State") or {}
    return found


def wait_exit(client: docker.DockerClient, cid: str, timeout: float | None, where: Where) -> bool:
    """Block on the engine until the container stops; False when ``timeout`` passed first."""
    try:
        client.api.wait(cid, timeout=timeout)
        return True
    except docker.errors.NotFound:
        return True
    except (requests.exceptions.RequestException, docker.errors.DockerException) as exc:
        # The SDK reports a read timeout as a ConnectionError: tell it apart from a lost engine.
        with translated(f"{where.who}: wait", where.docker_host):
            client.ping()
        if isinstance(exc, docker.errors.APIError):
            raise RunnerError(f"{where.who}: wait: {explain(exc)}") from exc
        return False


def send_signal(client: docker.DockerClient, cid: str, signal: str, where: Where) -> bool:
    """Send ``signal`` to the container's PID 1; False when it is not running (or gone)."""
    try:
        with translated(f"{where.who}: kill", where.docker_host):
            client.api.kill(cid, signal=signal)
    except docker.errors.NotFound:
        return False
    except RunnerUnavailable:
        raise
    except RunnerError as exc:
        if is_conflict(exc):
            return False  # not running
        # runsc answers a kill that races the sandbox's exit with a 500 ("sandbox is not running")
        found = state(client, cid, where)
        if found is None or not found.get("Running"):
            return False
        raise
    return True


def remove(client: docker.DockerClient, cid: str, where: Where) -> None:
    """Force-remove the container; a missing one (or a removal already in progress) is fine."""
    try:
        with translated(f"{where.who}: remove", where.docker_host):
            client.api.remove_container(cid, force=True)
    except docker.errors.NotFound:
        return
    except RunnerUnavailable:
        raise
    except RunnerError as exc:
        if not is_conflict(exc):
            raise


def is_conflict(exc: RunnerError) -> bool:
    """True when the engine refused with 409 Conflict (a name in use, a container not running)."""
    cause = exc.__cause__
    return isinstance(cause, docker.errors.APIError) and cause.status_code == 409
