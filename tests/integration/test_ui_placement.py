"""What the dashboard shows of placement (issue 29): each queue's fleet-wide limit, each worker's
capacity and what it has free, and why a queued call waits."""

from __future__ import annotations

import re

from tests.integration.conftest import ControlPlane
from tests.integration.test_ui import _login, _submit


def _row(page: str, attr: str, value: str) -> str:
    m = re.search(rf'<tr {attr}="{re.escape(value)}"[^>]*>(.*?)</tr>', page, re.S)
    assert m, page
    return m.group(1)


def test_the_overview_shows_a_queues_limit(sqlite_control_plane: ControlPlane) -> None:
    cp = sqlite_control_plane
    _submit(cp, cp.producer_token, "limited")
    _submit(cp, cp.producer_token, "free")
    cp.store.set_queue_limit("limited", 3)
    page = _login(cp, cp.admin_token).get("/ui/parts/overview").text
    cells = re.findall(r"<td[^>]*>(.*?)</td>", _row(page, "data-queue", "limited"), re.S)
    assert re.sub(r"<[^>]+>", "", cells[3]) == "3"
    cells = re.findall(r"<td[^>]*>(.*?)</td>", _row(page, "data-queue", "free"), re.S)
    assert cells[3] == "-"
