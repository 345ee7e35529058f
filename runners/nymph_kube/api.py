"""The boundary to the Kubernetes API: the client, its errors translated, pod primitives as plain dicts.

Everything the official ``kubernetes`` client (or urllib3 under it) can raise is mapped here to the
runner contract's exceptions, always with ``raise ... from`` so the original error stays attached:

- the API cannot be reached (connection refused, DNS, TLS, timeout) or answers 5xx / 429:
  :class:`~nymph.runner.RunnerUnavailable` (transient: nymph keeps the claim and retries);
- 401 / 403 (a wrong kubeconfig or missing RBAC) and every other 4xx: :class:`~nymph.runner.RunnerError`
  naming the call, the namespace and the API's own message;
- 404 is returned to the call site as ``None`` / ``False``: what a missing pod means is its decision;
  so is 409 AlreadyExists on a create (``None``): the name is taken, maybe by an earlier create of
  the same pod whose answer was lost.

Reads use ``_preload_content=False`` and parse the JSON, so the runner works on plain dicts
(``pod["status"]["phase"]``) rather than the generated model classes.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import urllib3.exceptions
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from nymph.runner import RunnerError, RunnerUnavailable

#: Seconds one API call may take (connect, read).
API_TIMEOUT_S = 30.0


def connect(kubeconfig: str | None, context: str | None, what: str) -> tuple[k8s.CoreV1Api, str]:
    """A CoreV1Api and where it points: in-cluster config inside a pod (no kubeconfig given), else the kubeconfig.

    ``kubeconfig`` None means ``$KUBECONFIG`` / ``~/.kube/config`` when not in a cluster.
    """
    configuration = k8s.Configuration()
    loader: Any = k8s_config  # the client's loaders are untyped
    try:
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            loader.load_incluster_config(client_configuration=configuration)
        else:
            loader.load_kube_config(
                config_file=kubeconfig, context=context, client_configuration=configuration
            )
    except (ConfigException, OSError, TypeError, ValueError) as exc:
        where = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        raise RunnerUnavailable(
            f"{what}: no usable Kubernetes configuration ({exc}); run nymph in a pod with a service "
            f"account, or point the runner's kubeconfig option (or KUBECONFIG) at a kubeconfig "
            f"(tried {where})"
        ) from exc
    configuration.retries = 1  # urllib3: one retry on a dropped connection, then our own backoff
    return k8s.CoreV1Api(k8s.ApiClient(configuration)), str(configuration.host)


@contextlib.contextmanager
def translated(what: str, host: str) -> Iterator[None]:
    """Map kubernetes/urllib3 errors raised inside the block; a 404 ApiException passes through."""
    try:
        yield
    except ApiException as exc:
        if exc.status == 404:
            raise
        status = exc.status or 0
        message = explain(exc)
        if status in (429,) or status >= 500 or status == 0:
            raise RunnerUnavailable(
                f"{what}: the Kubernetes API at {host} answered {status}: {message}"
            ) from exc
        if status in (401, 403):
            raise RunnerError(
                f"{what}: the Kubernetes API at {host} refused ({status}): {message}; check the "
                f"credentials and that the service account may create/get/list/watch/delete pods here"
            ) from exc
        raise RunnerError(f"{what}: the Kubernetes API refused ({status}): {message}") from exc
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise RunnerUnavailable(f"{what}: the Kubernetes API at {host} is not reachable ({exc})") from exc


def explain(exc: ApiException) -> str:
    """The API's own message (the Status object's ``message``), else the reason."""
    body: Any = exc.body
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if isinstance(body, str) and body:
        try:
            parsed = json.loads(body)
        except ValueError:
            return body.strip()[:500]
        if isinstance(parsed, dict) and parsed.get("message"):
            return str(parsed["message"])
    return str(exc.reason or "no message")


def _unless_404(exc: ApiException) -> None:
    """Re-raise ``exc`` (for :func:`translated` to map) unless it is a 404."""
    if exc.status != 404:
        raise exc


def _reason(exc: ApiException) -> str | None:
    """The ``reason`` of the API's Status object (``AlreadyExists``, ``Conflict``...), if any."""
    body: Any = exc.body
    try:
        parsed = json.loads(body) if body else None
    except (TypeError, ValueError):
        return None
    return str(parsed.get("reason")) if isinstance(parsed, dict) and parsed.get("reason") else None


def _json(response: Any) -> dict[str, Any]:
    data = json.loads(response.data or b"{}")
    if not isinstance(data, dict):
        raise RunnerError(f"the Kubernetes API answered a non-object: {data!r:.200}")
    return data


class Pods:
    """Pod primitives in one namespace, each translated; 404 comes back as None / False."""

    def __init__(self, core: k8s.CoreV1Api, host: str, namespace: str, who: str) -> None:
        self.core: Any = core  # called with plain dicts and _preload_content=False: no model types
        self.host = host
        self.namespace = namespace
        self.who = who

    def create(self, manifest: dict[str, Any]) -> dict[str, Any] | None:
        """The created pod; None when a pod of that name exists already (409 AlreadyExists)."""
        name = manifest["metadata"]["name"]
        with translated(f"{self.who}: create pod {self.namespace}/{name}", self.host):
            try:
                return _json(
                    self.core.create_namespaced_pod(
                        self.namespace, manifest, _preload_content=False, _request_timeout=API_TIMEOUT_S
                    )
                )
            except ApiException as exc:  # 404: the namespace does not exist
                if exc.status == 409 and _reason(exc) == "AlreadyExists":
                    return None
                _unless_404(exc)
                raise RunnerError(
                    f"{self.who}: create pod {name}: namespace {self.namespace!r} not found ({explain(exc)})"
                ) from exc

    def close(self) -> None:
        """Close the API client's connection pool."""
        self.core.api_client.close()

    def get(self, name: str) -> dict[str, Any] | None:
        with translated(f"{self.who}: read pod {self.namespace}/{name}", self.host):
            try:
                return _json(
                    self.core.read_namespaced_pod(
                        name, self.namespace, _preload_content=False, _request_timeout=API_TIMEOUT_S
                    )
                )
            except ApiException as exc:
                _unless_404(exc)
                return None

    def delete(self, name: str, grace_s: int | None = None) -> bool:
        """Delete the pod (the kubelet sends SIGTERM, waits ``grace_s``, then SIGKILL); False when gone."""
        body = k8s.V1DeleteOptions(grace_period_seconds=grace_s, propagation_policy="Background")
        with translated(f"{self.who}: delete pod {self.namespace}/{name}", self.host):
            try:
                self.core.delete_namespaced_pod(
                    name,
                    self.namespace,
                    body=body,
                    grace_period_seconds=grace_s,
                    _preload_content=False,
                    _request_timeout=API_TIMEOUT_S,
                )
            except ApiException as exc:
                _unless_404(exc)
                return False
        return True

    def list(self, selector: str, limit: int | None = None) -> list[dict[str, Any]]:
        what = f"{self.who}: list pods in {self.namespace}"
        kwargs: dict[str, Any] = {"label_selector": selector}
        if limit is not None:
            kwargs["limit"] = limit
        with translated(what, self.host):
            try:
                found = _json(
                    self.core.list_namespaced_pod(
                        self.namespace, _preload_content=False, _request_timeout=API_TIMEOUT_S, **kwargs
                    )
                )
            except ApiException as exc:
                _unless_404(exc)
                raise RunnerError(f"{what}: namespace not found ({explain(exc)})") from exc
        items = found.get("items") or []
        return [i for i in items if isinstance(i, dict)]

    def log(self, name: str, container: str, limit_bytes: int | None = None) -> bytes | None:
        """The container's output (stdout and stderr interleaved, as the kubelet keeps it)."""
        with translated(f"{self.who}: read log of pod {self.namespace}/{name}", self.host):
            try:
                response = self.core.read_namespaced_pod_log(
                    name, self.namespace, container=container, limit_bytes=limit_bytes,
                    _preload_content=False, _request_timeout=API_TIMEOUT_S,
                )  # fmt: skip
            except ApiException as exc:
                _unless_404(exc)
                return None
        data: bytes = response.data or b""
        return data
