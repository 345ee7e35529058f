"""What the dashboard shows of placement (issue 29): each queue's fleet-wide limit, each worker's
capacity and what it has free, and why a queued call waits."""

from __future__ import annotations

import re

from tests.integration.conftest import ControlPlane
from tests.integration.ops_kit import login, ui_submit


def _row(page: str, attr: str, value: str) -> str:
    m = re.search(rf'<tr {attr}="{re.escape(value)}"[^>]*>(.*?)</tr>', page, re.S)
    assert m, page
    return m.group(1)


def test_the_overview_shows_a_queues_limit(sqlite_control_plane: ControlPlane) -> None:
    cp = sqlite_control_plane
    ui_submit(cp, cp.producer_token, "limited")
    ui_submit(cp, cp.producer_token, "free")
    cp.store.set_queue_limit("limited", 3)
    page = login(cp, cp.admin_token).get("/ui/parts/overview").text
    cells = re.findall(r"<td[^>]*>(.*?)</td>", _row(page, "data-queue", "limited"), re.S)
    assert re.sub(r"<[^>]+>", "", cells[3]) == "3"
    cells = re.findall(r"<td[^>]*>(.*?)</td>", _row(page, "data-queue", "free"), re.S)
    assert cells[3] == "-"


def test_the_overview_shows_a_workers_capacity_and_free_gpus(sqlite_control_plane: ControlPlane) -> None:
    from dreamlake.lakeshore.ids import new_ulid

    cp = sqlite_control_plane
    worker = new_ulid()
    gpus = [{"index": i, "model": "H100", "memory_mib": 81559} for i in range(4)]
    capacity = {"cpus": 16, "memory_mb": 65536, "gpus": gpus, "arch": "x86_64", "os": "linux"}
    body = {"worker_id": worker, "queues": ["gpu"], "capacity": capacity, "slots": 4}
    assert cp.call("/v1/daemon/register", body, cp.daemon_token)[0] == 200
    poll = {"worker_id": worker, "queues": ["gpu"], "timeout_s": 0, "offer": {"gpus": 3, "labels": {}}}
    assert cp.call("/v1/daemon/poll", poll, cp.daemon_token)[0] == 200
    row = _row(login(cp, cp.admin_token).get("/ui/parts/overview").text, "data-worker", worker)
    assert re.search(r'class="num gpus">3/4 H100<', row), row
    assert "16 CPUs / 64.0 GiB" in row
