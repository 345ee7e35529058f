"""TLS between the control plane and its clients (the SDK, the CLI, nymph).

``lakeshore server --tls-cert FILE --tls-key FILE`` serves HTTPS. A client trusts the system's CAs
and, with ``--ca-file`` / ``LAKESHORE_CA_FILE``, the CA (or self-signed certificate) named there;
``LAKESHORE_CLIENT_CERT`` / ``LAKESHORE_CLIENT_KEY`` (``--client-cert`` / ``--client-key``) present a
client certificate to a proxy that asks for one. :func:`client_context` builds the one
``ssl.SSLContext`` a client's connections share (httpx and the keep-alive fast path alike); a
server whose certificate the client cannot verify is refused with :func:`untrusted`'s message,
which says what to pass. Plain HTTP is for loopback only (docs/security.md).
"""

from __future__ import annotations

import ipaddress
import os
import ssl
from collections.abc import Mapping
from typing import Any

from dreamlake.lakeshore import envvars

ENV_CA = "LAKESHORE_CA_FILE"
ENV_CERT = "LAKESHORE_CLIENT_CERT"
ENV_KEY = "LAKESHORE_CLIENT_KEY"


def client_context(
    ca_file: str | None = None,
    client_cert: str | None = None,
    client_key: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> ssl.SSLContext:
    """The client side's SSL context: the system's CAs plus ``ca_file`` (else ``$LAKESHORE_CA_FILE``),
    with the client certificate ``client_cert`` / ``client_key`` (else their variables) when given.
    A file that cannot be read raises ValueError naming it."""
    ca_file = ca_file or envvars.string(ENV_CA, env)
    client_cert = client_cert or envvars.string(ENV_CERT, env)
    client_key = client_key or envvars.string(ENV_KEY, env)
    ctx = ssl.create_default_context()
    if ca_file:
        try:
            ctx.load_verify_locations(cafile=ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot read the CA file {ca_file} ({ENV_CA} / --ca-file): {exc}") from None
    if client_cert:
        try:
            ctx.load_cert_chain(client_cert, client_key)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"cannot read the client certificate {client_cert} ({ENV_CERT}/{ENV_KEY}): {exc}"
            ) from None
    return ctx


def untrusted(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a failed verification of the server's certificate."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def untrusted_message(url: str, exc: BaseException) -> str:
    return (
        f"the control plane at {url} presented a TLS certificate this client does not trust ({exc}): "
        f"pass --ca-file FILE or set {ENV_CA}=FILE to the CA certificate that signed it (for a "
        "self-signed certificate: the certificate itself)"
    )


def loopback(host: str) -> bool:
    """Whether ``host`` (a listen address) is reachable from this machine only."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def server_options(cert: str | None, key: str | None) -> dict[str, Any]:
    """uvicorn's ``ssl_certfile`` / ``ssl_keyfile`` of ``--tls-cert`` / ``--tls-key`` (both or
    neither: ValueError otherwise, or when one cannot be read)."""
    if not cert and not key:
        return {}
    if not (cert and key):
        raise ValueError("--tls-cert and --tls-key go together: give the certificate and its private key")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the TLS certificate {cert} with the key {key}: {exc}") from None
    return {"ssl_certfile": cert, "ssl_keyfile": key}


def cli_options() -> list[Any]:
    """``--ca-file``, ``--client-cert`` and ``--client-key`` for a click command (``lakeshore``'s
    operator commands, ``nymph start``): each sets its ``LAKESHORE_*`` variable for this process,
    which every client it makes reads (:func:`client_context`)."""
    import click

    def setter(name: str) -> Any:
        def callback(ctx: Any, param: Any, value: str | None) -> None:
            if value:
                os.environ[name] = value

        return callback

    path = click.Path(exists=True, dir_okay=False)
    return [
        click.option(
            "--ca-file",
            type=path,
            expose_value=False,
            callback=setter(ENV_CA),
            help=f"Trust the control plane's TLS certificate signed by this CA (PEM; {ENV_CA}).",
        ),
        click.option(
            "--client-cert",
            type=path,
            expose_value=False,
            callback=setter(ENV_CERT),
            help=f"Present this client certificate (PEM) to a TLS proxy that asks for one ({ENV_CERT}).",
        ),
        click.option(
            "--client-key",
            type=path,
            expose_value=False,
            callback=setter(ENV_KEY),
            help=f"The private key of --client-cert ({ENV_KEY}).",
        ),
    ]
