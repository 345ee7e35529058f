"""Code archives end to end (issue 13): a new user's local package, never installed on the worker,
submitted with the SDK over real HTTP to ``lakeshore``'s control plane and run by a real nymph
(process runner) whose ``PYTHONPATH`` does not hold it.

Covers what the runner conformance suite cannot see from below the agent: the SDK's default
(``"auto"``) picking the package, nymph's cache fetching an archive once per sha256 (the second
call runs the very files the first unpacked), an edit picked up by the next submit with no restart,
two versions in flight on one nymph, and a tampered archive refused with the seed's message before
anything runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import dreamlake.lakeshore as dls
from dreamlake.lakeshore.dispatch import HttpDispatch
from dreamlake.lakeshore.server.payloads import PayloadConfig, PayloadStore
from tests import code_kit
from tests.conftest import ROOT
from tests.integration.conftest import ControlPlane, local_blobs, running_control_plane
from tests.integration.s3_fixture import S3Service
from tests.stack.nymph import Nymph
from tests.stack.producer import await_result, submit
from tests.stack.wait import until

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def user_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, str]]:
    """(where, name) of a fresh local package; the SDK's own default applies (no LAKESHORE_CODE)."""
    monkeypatch.delenv("LAKESHORE_CODE", raising=False)
    src, name = tmp_path / "src", code_kit.unique_name()
    yield src, name
    if str(src) in sys.path:
        sys.path.remove(str(src))


def _workdir_of(n: Nymph, inv: str) -> Path:
    return n.workdir / inv


def test_a_local_package_ships_with_the_call(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph], user_package: tuple[Path, str]
) -> None:
    cp = sqlite_control_plane
    src, name = user_package
    n = nymph_factory(cp.url, cp.daemon_token, "--concurrency", "2")
    plane = HttpDispatch(cp.url, cp.producer_token)
    q = dls.SyncQueue("default", plane)
    try:
        code_kit.write_package(src, name, "one")
        v1 = code_kit.load(src, name)
        first = q.result(v1.which.submit(_dispatch=plane), timeout=120)
        assert first["version"] == "one", (first, n.output()[-3000:])
        shipped = Path(first["file"])
        assert shipped.is_relative_to(n.workdir / ".code"), first  # nymph's cache, not the host
        assert shipped.parent.name == name and (shipped.parent / "helpers.py").is_file()
        assert not (shipped.parent / "data.bin").exists()  # .gitignore'd: never shipped
        unpacked = os.stat(shipped).st_ino

        again = q.result(v1.which.submit(_dispatch=plane), timeout=120)  # the cache hit
        assert again["file"] == first["file"] and os.stat(shipped).st_ino == unpacked
        assert [p.name for p in (n.workdir / ".code").iterdir()] == [shipped.parent.parent.name]

        # an edit while version one runs: both in flight at once, each runs its own
        old = v1.which.submit("release", _dispatch=plane)
        until(lambda: _workdir_of(n, old).is_dir() and plane.status(old)["state"] == "running", "v1 to run")
        code_kit.write_package(src, name, "second")
        new = code_kit.load(src, name).which.submit("release", _dispatch=plane)
        until(lambda: _workdir_of(n, new).is_dir() and plane.status(new)["state"] == "running", "v2 to run")
        for inv in (old, new):
            (_workdir_of(n, inv) / "release").touch()
        outs = [q.result(inv, timeout=120) for inv in (old, new)]
        assert [(o["version"], o["helper"]) for o in outs] == [
            ("one", "one-helper"),
            ("second", "second-helper"),
        ]
        assert outs[0]["file"] == first["file"] and outs[1]["file"] != first["file"]
    finally:
        plane.close()


def test_a_tampered_archive_is_refused_before_anything_runs(
    sqlite_control_plane: ControlPlane, nymph_factory: Callable[..., Nymph], user_package: tuple[Path, str]
) -> None:
    cp = sqlite_control_plane
    src, name = user_package
    n = nymph_factory(cp.url, cp.daemon_token)
    code_kit.write_package(src, name, "one")
    envelope = code_kit.load(src, name).which.thunk().to_envelope()
    record: dict[str, Any] = envelope.cfg["code"]
    good = record["sha256"]
    tampered = bytearray(record["inline"])
    tampered[len(tampered) // 2] ^= 0xFF  # one byte flipped on the way: the same size, other bytes
    record["inline"] = bytes(tampered)
    inv = submit(cp.url, cp.producer_token, envelope.to_bytes())
    out = await_result(cp.url, cp.producer_token, inv)
    assert out["state"] == "failed", (out, n.output()[-3000:])
    assert out["error"]["type"] == "CodeArchiveRefused"
    assert out["error"]["message"].startswith(
        f"code archive: payload corrupt: sha256 mismatch (expected {good}, got "
    )
    assert not (n.workdir / ".code" / good).exists()  # nothing unpacked
    assert not (n.workdir / inv).exists()  # refused before its workdir was made: nothing ran


def test_example_06_ships_its_local_package() -> None:
    """``examples/06_ship_code.py`` as a user runs it: its nymph's PYTHONPATH lacks examples/."""
    env = {k: v for k, v in os.environ.items() if k != "LAKESHORE_CODE"}  # the SDK's own default
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "runners")])
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "06_ship_code.py")],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == "mean 2.50, spread 3.00\nran from nymph's code cache: True\n"


# --- over the inline threshold: through the payload store (both tiers) ----------------------------


class Tier:
    """A control plane over one payload tier, and a way to rewrite a stored blob behind its back."""

    def __init__(self, cp: ControlPlane, tamper: Callable[[str, bytes], None], keys: Callable[[], list[str]]):
        self.cp, self.tamper, self.stored_keys = cp, tamper, keys


@pytest.fixture(params=["local", "s3"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    if request.param == "local":  # the embedded default: a blob directory next to the SQLite store
        root = tmp_path / "blobs"
        with running_control_plane(str(tmp_path / "l.db"), payloads=local_blobs(root)) as cp:
            yield Tier(
                cp,
                lambda key, data: (root / key).write_bytes(data),
                lambda: [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()],
            )
        return
    s3: S3Service = request.getfixturevalue("s3_service")
    with running_control_plane(
        str(tmp_path / "s.db"), payloads=PayloadStore(PayloadConfig.from_env(s3.env()))
    ) as cp:
        client = s3.client()
        yield Tier(
            cp,
            lambda key, data: client.put_object(Bucket=s3.bucket, Key=key, Body=data),
            lambda: [o["Key"] for o in client.list_objects_v2(Bucket=s3.bucket).get("Contents", [])],
        )


def test_an_archive_over_the_threshold_goes_by_ref_once_and_a_tampered_blob_is_refused(
    tier: Tier,
    nymph_factory: Callable[..., Nymph],
    user_package: tuple[Path, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cp = tier.cp
    src, name = user_package
    monkeypatch.setenv("INLINE_THRESHOLD_BYTES", "256")  # every archive goes by reference
    n = nymph_factory(cp.url, cp.daemon_token)
    plane = HttpDispatch(cp.url, cp.producer_token)
    q = dls.SyncQueue("default", plane)
    try:
        code_kit.write_package(src, name, "one")
        which = code_kit.load(src, name).which
        invs = [which.submit(_dispatch=plane) for _ in range(2)]
        outs = [q.result(inv, timeout=120) for inv in invs]
        assert [o["version"] for o in outs] == ["one", "one"], n.output()[-3000:]
        assert Path(outs[0]["file"]).is_relative_to(n.workdir / ".code")
        sha = Path(outs[0]["file"]).parent.parent.name
        stored = [k for k in tier.stored_keys() if k.endswith(f"/{sha}/code")]
        assert len(stored) == 1, tier.stored_keys()  # uploaded once for both calls

        code_kit.write_package(src, name, "second")  # a new archive, whose stored blob is rewritten
        envelope = code_kit.load(src, name).which.thunk().to_envelope(plane)
        record = envelope.cfg["code"]
        assert "inline" not in record and record["ref"]["sha256"] == record["sha256"]
        tier.tamper(record["ref"]["key"], b"\0" * record["size"])
        inv = plane.submit(envelope, "default", {"queue": "default"}, None)
        out = await_result(cp.url, cp.producer_token, inv)
        assert out["state"] == "failed", (out, n.output()[-3000:])
        assert out["error"]["type"] == "CodeArchiveRefused"
        assert out["error"]["message"].startswith(
            f"code archive: payload corrupt: sha256 mismatch (expected {record['sha256']}, got "
        ), out["error"]
        assert not (n.workdir / ".code" / record["sha256"]).exists()
    finally:
        plane.close()
