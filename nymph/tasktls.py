"""TLS for tasks: a task trusts the control plane nymph trusts, without being told (issue 31 item 9).

nymph reaches an HTTPS control plane with ``--ca-file`` / ``LAKESHORE_CA_FILE`` (and, behind a
proxy that asks for one, ``--client-cert`` / ``--client-key``). A task that submits nested calls
talks to the same control plane (``LAKESHORE_URL``), but the path nymph was given is nymph's: the
task's user may not read it (``/etc/nymph/ca.pem``, root's) and a container does not have it. So
nymph copies what it has into each workdir before the task starts, next to ``task.token``:

==================== ========================== ======================================
file (in the workdir) variable the task gets    from nymph's
==================== ========================== ======================================
``tls-ca.pem``        ``LAKESHORE_CA_FILE``       ``LAKESHORE_CA_FILE`` / ``--ca-file``
``tls-client.pem``    ``LAKESHORE_CLIENT_CERT``   ``LAKESHORE_CLIENT_CERT`` / ``--client-cert``
``tls-client.key``    ``LAKESHORE_CLIENT_KEY``    ``LAKESHORE_CLIENT_KEY`` / ``--client-key``
==================== ========================== ======================================

Each is written while the workdir is still nymph's (``O_EXCL | O_NOFOLLOW``), mode 0400, then handed
to the task's user with the token (:func:`nymph.workdir.create`), so only that task's user (and
root) reads it; the variables name the files relative to the workdir, and the entry makes them
absolute before the user's code runs, as it does ``LAKESHORE_TOKEN_FILE``. The SDK's client
(``dreamlake.lakeshore.tls.client_context``) reads them from there: ``dls`` calls inside a task
verify the control plane's certificate with nymph's CA, on every runner (the workdir is the
task's cwd in a container too).

The client certificate is the risk: its key is nymph's identity at the proxy, and every task on
this nymph gets a copy it can read (and exfiltrate) for as long as the certificate is valid; the
task credential (``task.token``) still limits what the control plane lets it do, but the proxy
sees nymph. Give nymph a client certificate meant for tasks too (short-lived, scoped at the proxy
to the control plane's routes), or none (the CA file alone is public). A file nymph cannot read
is skipped with one warning per path.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping

from dreamlake.lakeshore import tls

log = logging.getLogger(__name__)

#: (variable nymph reads and the task gets, file name in the workdir)
FILES = (
    (tls.ENV_CA, "tls-ca.pem"),
    (tls.ENV_CERT, "tls-client.pem"),
    (tls.ENV_KEY, "tls-client.key"),
)
MODE = 0o400
MAX_BYTES = 1 << 20  # a PEM bundle is a few KiB; a path to anything bigger is a mistake

_cache: dict[str, tuple[tuple[int, int], bytes]] = {}
_warned: set[str] = set()
_lock = threading.Lock()


def _read(path: str) -> bytes | None:
    """``path``'s bytes, re-read only when its size or mtime changed (a rotated CA); None when
    nymph cannot read it (warned once)."""
    try:
        st = os.stat(path)
        stamp = (st.st_size, st.st_mtime_ns)
        with _lock:
            hit = _cache.get(path)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        if st.st_size > MAX_BYTES:
            raise OSError(f"over {MAX_BYTES} bytes")
        with open(path, "rb") as fh:
            data = fh.read(MAX_BYTES + 1)
    except OSError as exc:
        if path not in _warned:
            _warned.add(path)
            log.warning("%s: cannot read it to hand it to tasks (%s); tasks do without it", path, exc)
        return None
    with _lock:
        _cache[path] = (stamp, data)
    return data


def workdir_files(environ: Mapping[str, str] | None = None) -> list[tuple[str, bytes, int]]:
    """The ``(name, bytes, mode)`` of each TLS file nymph has (``environ``: nymph's environment),
    to create in a new workdir."""
    env = os.environ if environ is None else environ
    out = []
    for var, name in FILES:
        path = env.get(var)
        if path:
            data = _read(path)
            if data is not None:
                out.append((name, data, MODE))
    return out


def task_env(delivered: list[tuple[str, bytes, int]]) -> dict[str, str]:
    """The variables that point a task at the files of :func:`workdir_files` (relative to its
    workdir); an empty string for each nymph did not deliver, so nymph's own path (passed on with
    its other ``LAKESHORE_*`` variables) never reaches the task."""
    names = {name for name, _, _ in delivered}
    return {var: (name if name in names else "") for var, name in FILES}
