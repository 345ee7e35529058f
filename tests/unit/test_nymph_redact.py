"""nymph.errors.redact and the log filter built on it: a credential in the control plane's URL
(``--server https://user:pass@host``), a token query parameter, a presigned URL's signature or a
lakeshore token written into an error never reaches nymph's log or ``nymph doctor``'s output."""

from __future__ import annotations

import io
import json
import logging
import socket
from collections.abc import Iterator

import pytest

from dreamlake.lakeshore.errors import Unavailable
from nymph import observability
from nymph.client import ControlPlaneClient
from nymph.config import NymphConfig
from nymph.doctor import _server
from nymph.errors import redact


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("https://alice:s3cret@cp.example:8470/v1", "https://***@cp.example:8470/v1"),
        ("http://ghp_token123@cp:8470", "http://***@cp:8470"),
        ("https://cp/x?token=abc&n=1&access_token=zz#frag", "https://cp/x?token=***&n=1&access_token=***#frag"),
        (
            "GET https://s3/b/k?X-Amz-Credential=AK%2F2026&X-Amz-Signature=dead&X-Amz-Date=1 failed",
            "GET https://s3/b/k?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Date=1 failed",
        ),
        ("https://cp/v1/blobs/k?expires=1&size=2&sig=abcdef", "https://cp/v1/blobs/k?expires=1&size=2&sig=***"),
        ("refused lsk_AbCdEf123456 (Authorization: Bearer xyz.abc.def)", "refused lsk_*** (Authorization: Bearer ***)"),
        ("cannot reach http://127.0.0.1:8470/v1/daemon/poll: refused", "cannot reach http://127.0.0.1:8470/v1/daemon/poll: refused"),
    ],
)  # fmt: skip
def test_redact_masks_credentials_and_keeps_the_rest(text: str, expected: str) -> None:
    assert redact(text) == expected


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    saved, level = list(root.handlers), root.level
    stream = io.StringIO()
    try:
        yield stream
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved:
            root.addHandler(h)
        root.setLevel(level)


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_nymphs_log_never_carries_a_credential(captured: io.StringIO, fmt: str) -> None:
    observability.configure_logging(fmt, "INFO", stream=captured)
    log = logging.getLogger("nymph.test")
    log.warning("registered with %s", "https://op:hunter2@cp.example:8470")
    try:
        raise Unavailable("GET https://cp/v1/blobs/k?sig=deadbeef failed; token lsk_SECRETSECRET")
    except Unavailable:
        log.exception("fetch failed")
    out = captured.getvalue()
    assert "hunter2" not in out and "deadbeef" not in out and "SECRETSECRET" not in out
    assert "https://***@cp.example:8470" in out and "sig=***" in out and "lsk_***" in out
    if fmt == "json":
        assert all(json.loads(line) for line in out.splitlines())


def test_doctor_names_the_unreachable_server_without_its_password() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://op:hunter2@127.0.0.1:{port}"
    cfg = NymphConfig(server=url, token="lsk_doctortoken")
    check = _server(cfg, ControlPlaneClient(url, cfg.token, timeout_s=2.0))
    assert not check.ok and "hunter2" not in check.detail
    assert f"http://***@127.0.0.1:{port}" in check.detail
