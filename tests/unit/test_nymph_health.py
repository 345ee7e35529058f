"""nymph's readiness on a full disk and its one line per control-plane outage (issue 12, items 1, 6)."""

from __future__ import annotations

import errno
import logging
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest

from dreamlake.lakeshore.errors import Unavailable
from nymph.client import ControlPlaneClient
from nymph.errors import is_disk_full
from nymph.health import DiskHealth, free_bytes
from nymph.sdnotify import SdNotify


def test_disk_health_pauses_below_the_floor_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="nymph.health")
    disk = DiskHealth([tmp_path, tmp_path], free_bytes(tmp_path) * 4 + 2**30, SdNotify())
    assert disk.check() is False and disk.check() is False
    assert not disk.ok.is_set() and disk.problem and str(tmp_path) in disk.problem
    disk.min_free_bytes = 0
    assert disk.check() is True and disk.ok.is_set() and disk.problem is None
    lines = [r.getMessage() for r in caplog.records]
    assert sum("disk full:" in m for m in lines) == 1
    assert sum("disk space is back" in m for m in lines) == 1


def test_a_write_that_met_enospc_pauses_claims_until_the_next_check(tmp_path: Path) -> None:
    disk = DiskHealth([tmp_path], 0, SdNotify())
    exc = OSError(errno.ENOSPC, "No space left on device")
    assert is_disk_full(exc) and not is_disk_full(OSError(errno.EACCES, "denied"))
    wrapped = RuntimeError("while writing")
    wrapped.__cause__ = exc
    assert is_disk_full(wrapped)
    disk.full(exc)
    assert not disk.ok.is_set() and "No space left on device" in (disk.problem or "")
    assert disk.check() is True  # tmp_path has room: claims resume by themselves


class Plane:
    """A control plane at the transport seam that can be down, and whose answers can be held."""

    def __init__(self) -> None:
        self.down = threading.Event()
        self.hold = threading.Event()
        self.held = threading.Event()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/poll") and self.hold.is_set():
            self.held.set()
            while self.hold.is_set():
                time.sleep(0.01)
        if self.down.is_set():
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(
            200, content=msgpack.packb({}), headers={"content-type": "application/x-msgpack"}
        )


def test_an_outage_is_one_went_away_line_and_one_reconnected_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="nymph.client")
    plane = Plane()
    client = ControlPlaneClient("http://cp", "tok", transport=httpx.MockTransport(plane))
    client.heartbeat({})
    # a long poll in flight when the plane goes away, answered (empty) after the outage began
    plane.hold.set()
    answers: list[Any] = []
    poll = threading.Thread(target=lambda: answers.append(client.poll({}, timeout_s=1)))
    poll.start()
    assert plane.held.wait(5)
    plane.down.set()
    for _ in range(5):
        with pytest.raises(Unavailable):
            client.heartbeat({})
    plane.down.clear()
    plane.hold.clear()
    poll.join(5)
    assert answers == [{}]
    assert client.link.up is False  # that answer was to a request sent before the outage
    client.heartbeat({})
    assert client.link.up is True
    lines = [r.getMessage() for r in caplog.records]
    assert sum("control plane went away" in m for m in lines) == 1, lines
    assert sum("reconnected to the control plane" in m for m in lines) == 1, lines


def test_a_server_that_asks_to_wait_is_not_an_outage() -> None:
    def busy(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            503,
            content=msgpack.packb({"error": "too many polls"}),
            headers={"content-type": "application/x-msgpack", "retry-after": "1"},
        )

    client = ControlPlaneClient("http://cp", "tok", transport=httpx.MockTransport(busy))
    with pytest.raises(Unavailable):
        client.poll({}, timeout_s=1)
    assert client.link.up is True  # poll admission control: the server is there


def test_doctor_names_a_directory_below_the_free_space_floor(tmp_path: Path) -> None:
    from nymph.doctor import _directory

    tmp_path.chmod(0o700)
    ok = _directory("workdir", tmp_path, "traversable", min_free_mb=0)
    assert ok.ok and "MiB free" in ok.detail
    short = _directory("workdir", tmp_path, "traversable", min_free_mb=2**40)
    assert not short.ok and "below --min-free-mb" in short.detail
