"""sd_notify against a real AF_UNIX datagram socket (a path one and an abstract one)."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from nymph.sdnotify import SdNotify


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    try:
        yield str(path), sock
    finally:
        sock.close()


def test_messages_reach_the_socket(listener: tuple[str, socket.socket]) -> None:
    path, sock = listener
    sd = SdNotify({"NOTIFY_SOCKET": path})
    assert sd.enabled
    assert sd.ready(status="polling queue gpu")
    assert sock.recv(4096) == b"READY=1\nSTATUS=polling queue gpu"
    assert sd.watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1"
    assert sd.status("2 running\n1 queued")
    assert sock.recv(4096) == b"STATUS=2 running 1 queued"
    assert sd.stopping()
    assert sock.recv(4096) == b"STOPPING=1"


def test_abstract_namespace_socket() -> None:
    name = f"nymph-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(5)
    try:
        assert SdNotify({"NOTIFY_SOCKET": "@" + name}).ready()
        assert sock.recv(4096) == b"READY=1"
    finally:
        sock.close()


def test_socket_is_read_at_construction(
    listener: tuple[str, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, sock = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    sd = SdNotify()
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert sd.watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1"


def test_unset_environment_hides_the_socket_from_children(
    listener: tuple[str, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, sock = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    sd = SdNotify(unset_environment=True)
    assert "NOTIFY_SOCKET" not in os.environ and "WATCHDOG_USEC" not in os.environ
    assert sd.ready()
    assert sock.recv(4096) == b"READY=1"
    assert sd.watchdog_interval() == 30.0


def test_without_systemd_everything_is_a_no_op() -> None:
    sd = SdNotify({})
    assert not sd.enabled
    assert not sd.ready()
    assert not sd.watchdog()
    assert sd.watchdog_interval() is None


def test_a_vanished_socket_is_not_fatal(tmp_path: Path) -> None:
    assert not SdNotify({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")}).ready()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 30.0),
        ({"WATCHDOG_USEC": "500000", "WATCHDOG_PID": str(os.getpid())}, 0.5),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),  # someone else's watchdog
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    assert SdNotify({"NOTIFY_SOCKET": "/run/systemd/notify", **env}).watchdog_interval() == expected
