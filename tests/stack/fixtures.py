"""The test stack's pytest plugin (``pytest_plugins`` of ``tests/conftest.py``).

- ``nymph_factory``: ``make(server_url, token, *flags, base=None)`` starts a :class:`Nymph`; every
  one is stopped at teardown (its process group killed), its log printed when it exited badly;
- ``server``: a started :class:`Server` over a fresh data directory, stopped at teardown.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.stack.nymph import Nymph
from tests.stack.server import Server


@pytest.fixture
def nymph_factory(tmp_path: Path) -> Iterator[Callable[..., Nymph]]:
    started: list[Nymph] = []

    def make(server: str, token: str, *extra: str, base: Path | None = None) -> Nymph:
        n = Nymph(server, token, base or tmp_path, *extra)
        started.append(n)
        return n.start()

    try:
        yield make
    finally:
        for n in started:
            n.stop()
        for n in started:
            if n.proc is not None and n.proc.returncode not in (0, None):
                print(n.output()[-5000:])


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path / "cp").start()
    try:
        yield s
    finally:
        s.stop()
