"""The ops surface as an operator reaches it: the ``lakeshore`` CLI against a control plane, the web UI's login."""

from __future__ import annotations

from typing import Any

import httpx
from click.testing import CliRunner, Result

from dreamlake.lakeshore.cli import main
from dreamlake.lakeshore.ids import new_ulid
from tests.integration.conftest import ControlPlane, submit_body


def run(cp: ControlPlane, *args: str, token: str | None = None, env: dict[str, Any] | None = None) -> Result:
    environment = {
        "LAKESHORE_URL": cp.url,
        "LAKESHORE_TOKEN": token or cp.admin_token,
        "LAKESHORE_CONFIG": "/nonexistent/config.toml",
        **(env or {}),
    }
    return CliRunner().invoke(main, list(args), env=environment, catch_exceptions=False)


def login(cp: ControlPlane, token: str) -> httpx.Client:
    client = cp.client()
    r = client.post("/ui/login", data={"token": token})
    assert r.status_code == 303 and r.headers["location"] == "/ui", r.text
    return client


def ui_submit(cp: ControlPlane, token: str, queue: str = "q") -> str:
    inv = new_ulid()
    status, out = cp.call("/v1/producer/submit", submit_body(inv, queue), token)
    assert status == 200, out
    return inv
