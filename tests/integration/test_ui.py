"""The ``/ui`` dashboard over HTTP, from the attacker's side: sessions, cookie flags, CSRF, Origin,
token kinds and namespace scoping. (``test_ui_browser.py`` drives it in a real browser.)"""

from __future__ import annotations

import re

import msgpack
import pytest

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.ids import new_ulid
from dreamlake.lakeshore.server.ui import csrf_token, frame_view
from tests.integration.conftest import ControlPlane
from tests.integration.ops_kit import login, ui_submit


def _csrf(page: str) -> str:
    m = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert m, page
    return m.group(1)


def test_without_a_session_every_page_sends_to_login(sqlite_control_plane: ControlPlane) -> None:
    client = sqlite_control_plane.client()
    inv = new_ulid()
    for path in ("/ui", "/ui/invocations", f"/ui/invocations/{inv}"):
        r = client.get(path)
        assert r.status_code == 303 and r.headers["location"] == "/ui/login", path
    r = client.get("/ui/parts/overview", headers={"HX-Request": "true"})
    assert r.status_code == 401 and r.headers["hx-redirect"] == "/ui/login"
    r = client.post(f"/ui/invocations/{inv}/cancel", data={"csrf": "x"})
    assert r.status_code == 303 and r.headers["location"] == "/ui/login"
    client.cookies.set("lakeshore_session", "lsk_forged", path="/ui")
    assert client.get("/ui").status_code == 303
    r = client.get("/ui/login")
    assert r.status_code == 200 and 'name="token"' in r.text


def test_login_sets_a_strict_httponly_cookie_and_refuses_other_kinds(
    sqlite_control_plane: ControlPlane,
) -> None:
    cp = sqlite_control_plane
    client = cp.client()
    r = client.post("/ui/login", data={"token": cp.producer_token})
    cookie = r.headers["set-cookie"]
    assert r.status_code == 303
    assert (
        cookie.startswith("lakeshore_session=lss_") and cp.producer_token not in cookie
    )  # an id, not the token
    flags = {part.strip().lower() for part in cookie.split(";")[1:]}
    assert {"httponly", "path=/ui", "samesite=strict"} <= flags and "secure" not in flags
    r = client.post("/ui/login", data={"token": cp.producer_token}, headers={"X-Forwarded-Proto": "https"})
    assert "secure" in r.headers["set-cookie"].lower()
    for token, status, text in (
        ("lsk_unknown", 401, "unknown token"),
        (cp.daemon_token, 403, "a daemon token cannot open the dashboard"),
        (cp.store.create_token("metrics", "scraper"), 403, "a metrics token cannot open the dashboard"),
    ):
        r = cp.client().post("/ui/login", data={"token": token})
        assert r.status_code == status and text in r.text and "set-cookie" not in r.headers


def test_cancel_needs_the_sessions_csrf_token_and_a_same_site_origin(control_plane: ControlPlane) -> None:
    cp = control_plane
    inv = ui_submit(cp, cp.producer_token)
    client = login(cp, cp.admin_token)
    page = client.get(f"/ui/invocations/{inv}")
    assert page.status_code == 200 and 'id="cancel"' in page.text
    good = _csrf(page.text)
    assert good == csrf_token(client.cookies["lakeshore_session"])
    url = f"/ui/invocations/{inv}/cancel"
    for data, headers in (
        ({}, {}),
        ({"csrf": "0" * 64}, {}),
        (
            {"csrf": csrf_token(login(cp, cp.producer_token).cookies["lakeshore_session"])},
            {},
        ),  # another session's
        ({"csrf": good}, {"Origin": "https://evil.example"}),
    ):
        r = client.post(url, data=data, headers=headers)
        assert r.status_code == 403, (data, headers)
    assert cp.store.get(inv).state == "queued"  # type: ignore[union-attr]
    r = client.post(url, data={"csrf": good}, headers={"Origin": cp.url})
    assert r.status_code == 303 and r.headers["location"] == f"/ui/invocations/{inv}"
    assert cp.store.get(inv).state == "cancelled"  # type: ignore[union-attr]
    page = client.get(f"/ui/invocations/{inv}")
    assert 'data-state="cancelled"' in page.text and 'id="cancel"' not in page.text
    assert "hx-trigger" not in page.text.split('id="live"')[1].split(">")[0]  # finished: no polling


def test_a_namespace_session_sees_only_its_namespace(sqlite_control_plane: ControlPlane) -> None:
    cp = sqlite_control_plane
    theirs = ui_submit(cp, cp.producer_token, "secret-queue")
    token_a = cp.store.create_token("namespace", "team-a", "team-a")
    mine = ui_submit(cp, cp.store.create_token("producer", "prod-a", "team-a"), "a-queue")
    client = login(cp, token_a)
    overview = client.get("/ui").text
    assert 'data-queue="a-queue"' in overview and "secret-queue" not in overview
    listing = client.get("/ui/invocations").text
    assert mine in listing and theirs not in listing
    r = client.get(f"/ui/invocations/{theirs}")
    assert r.status_code == 404 and "unknown invocation" in r.text
    csrf = _csrf(client.get(f"/ui/invocations/{mine}").text)
    r = client.post(f"/ui/invocations/{theirs}/cancel", data={"csrf": csrf})
    assert r.status_code == 404 and cp.store.get(theirs).state == "queued"  # type: ignore[union-attr]
    r = client.get("/ui/invocations", params={"state": "bogus"})
    assert r.status_code == 400 and "unknown state" in r.text


def test_filters_and_the_live_parts(sqlite_control_plane: ControlPlane) -> None:
    cp = sqlite_control_plane
    a = ui_submit(cp, cp.producer_token, "qa")
    b = ui_submit(cp, cp.producer_token, "qb")
    client = login(cp, cp.admin_token)
    page = client.get("/ui/invocations", params={"queue": "qa"}).text
    assert a in page and b not in page and 'hx-get="/ui/parts/invocations?queue=qa"' in page
    part = client.get("/ui/parts/invocations", params={"queue": "qb", "since": "10m"}).text
    assert b in part and a not in part and "<html" not in part
    assert client.get("/ui/invocations", params={"since": "3w"}).status_code == 400
    part = client.get("/ui/parts/overview").text
    assert 'data-queue="qa"' in part and "no worker" in part  # queued, nobody serves it
    detail = client.get(f"/ui/parts/invocations/{a}").text
    assert 'hx-trigger="every 1s"' in detail and "waiting for a worker" in detail


def test_logout_needs_csrf_and_clears_the_cookie(sqlite_control_plane: ControlPlane) -> None:
    cp = sqlite_control_plane
    client = login(cp, cp.admin_token)
    assert client.post("/ui/logout", data={}).status_code == 403
    r = client.post("/ui/logout", data={"csrf": _csrf(client.get("/ui").text)})
    assert r.status_code == 303 and 'lakeshore_session=""' in r.headers["set-cookie"]
    assert client.get("/ui").status_code == 303


def test_the_output_panel_shows_stdout_and_stderr_apart_from_the_stream(
    sqlite_control_plane: ControlPlane,
) -> None:
    """LOG frames go to the Output panel (escaped, stderr marked), the others to the stream table."""
    cp = sqlite_control_plane
    inv = ui_submit(cp, cp.producer_token)
    worker = new_ulid()
    body = {"worker_id": worker, "hostname": "h", "runner": "process", "queues": ["q"], "slots": 1}
    assert cp.daemon("/v1/daemon/register", body)[0] == 200
    assert cp.daemon("/v1/daemon/poll", {"worker_id": worker, "queues": ["q"], "timeout_s": 0})[0] == 200
    client = login(cp, cp.admin_token)
    assert 'id="output-empty"' in client.get(f"/ui/parts/invocations/{inv}").text
    frames = [
        wire.encode_frame(wire.FRAME_LOG, 0, b"step 1 <b>bold</b>\n", {"stream": "stdout", "ts": 1.0}),
        wire.encode_frame(wire.FRAME_VALUE, 1, wire.pack({"left": 2})),
        wire.encode_frame(wire.FRAME_LOG, 2, b"a warning\n", {"stream": "stderr", "ts": 2.0}),
    ]
    chunk = {"invocation_id": inv, "attempt": 1, "worker_id": worker, "frames": frames}
    assert cp.daemon("/v1/daemon/result-chunks", chunk)[0] == 200
    part = client.get(f"/ui/parts/invocations/{inv}").text
    output = part.split('id="output"')[1].split("</pre>")[0]
    assert '<span class="log" data-seq="0">step 1 &lt;b&gt;bold&lt;/b&gt;\n</span>' in output
    assert '<span class="stderr" data-seq="2">a warning\n</span>' in output
    table = part.split('id="frames"')[1]
    assert 'data-seq="1" data-kind="value"' in table and 'data-kind="log"' not in table
    assert 'data-kind="stderr"' not in table


@pytest.mark.parametrize(
    "frame,kind,preview",
    [
        (wire.encode_frame(wire.FRAME_VALUE, 3, wire.pack({"left": 2})), "value", "{'left': 2}"),
        (
            wire.encode_frame(wire.FRAME_LOG, 4, b"oops\n", {"stream": "stderr", "ts": 1.0}),
            "stderr",
            "oops\n",
        ),
        (
            wire.encode_frame(wire.FRAME_ERROR, 5, {"type": "ValueError", "message": "bad"}),
            "error",
            "ValueError: bad",
        ),
        (
            wire.encode_frame(wire.FRAME_VALUE, 6, msgpack.packb([msgpack.ExtType(3, b"\x00" * 64)])),
            "value",
            "['<ext 3: 64 bytes>']",
        ),
        (b"\xc1garbage", "invalid", "undecodable frame"),
    ],
)
def test_frames_are_previewed_without_the_wire_codecs(frame: bytes, kind: str, preview: str) -> None:
    view = frame_view(frame)
    assert view["kind"] == kind and view["preview"].startswith(preview)


def test_the_dashboard_shows_a_deregistered_worker_as_stopped_and_the_charts_data(
    sqlite_control_plane: ControlPlane,
) -> None:
    cp = sqlite_control_plane
    worker = new_ulid()
    assert cp.daemon("/v1/daemon/register", {"worker_id": worker, "queues": ["q"]})[0] == 200
    client = login(cp, cp.admin_token)
    assert re.search(rf'data-worker="{worker}">.*?badge ok', client.get("/ui/parts/overview").text, re.S)
    assert cp.daemon("/v1/daemon/deregister", {"worker_id": worker})[0] == 200
    assert re.search(rf'data-worker="{worker}">.*?badge stopped', client.get("/ui/parts/overview").text, re.S)
    # the charts come as data for the vendored script (no inline script on the page)
    ui_submit(cp, cp.producer_token, "q")
    page = client.get("/ui").text
    assert 'id="chart-depth" data-chart="' in page and 'src="/ui/static/uPlot.iife.min.js"' in page
    assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", page)  # every script is a file
    charts = client.get("/ui/parts/charts").text
    assert "Queue depth" in charts and "Throughput" in charts
