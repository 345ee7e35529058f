"""nymph/tasktls.py: what nymph hands a task so it trusts the control plane nymph trusts. The CA
(and a client certificate, when nymph has one) is copied into the new workdir, 0400 and owned by
the task's user; the task's variables name those copies, never nymph's own paths."""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

import pytest

from dreamlake.lakeshore.ids import new_ulid
from nymph import tasktls
from nymph import workdir as wd


def _pki(tmp_path: Path) -> dict[str, str]:
    private = tmp_path / "pki"
    private.mkdir(mode=0o700)
    paths = {}
    for var, name, body in (
        ("LAKESHORE_CA_FILE", "ca.pem", b"-----BEGIN CERTIFICATE-----\nca\n"),
        ("LAKESHORE_CLIENT_CERT", "client.pem", b"-----BEGIN CERTIFICATE-----\nclient\n"),
        ("LAKESHORE_CLIENT_KEY", "client.key", b"-----BEGIN PRIVATE KEY-----\nkey\n"),
    ):
        (private / name).write_bytes(body)
        os.chmod(private / name, 0o600)
        paths[var] = str(private / name)
    return paths


def test_nymphs_tls_files_become_workdir_files_and_the_variables_name_them(tmp_path: Path) -> None:
    env = _pki(tmp_path)
    files = tasktls.workdir_files(env)
    assert [(name, mode) for name, _, mode in files] == [
        ("tls-ca.pem", 0o400),
        ("tls-client.pem", 0o400),
        ("tls-client.key", 0o400),
    ]
    assert files[0][1] == b"-----BEGIN CERTIFICATE-----\nca\n"
    assert tasktls.task_env(files) == {
        "LAKESHORE_CA_FILE": "tls-ca.pem",
        "LAKESHORE_CLIENT_CERT": "tls-client.pem",
        "LAKESHORE_CLIENT_KEY": "tls-client.key",
    }
    # a nymph with a CA and no client certificate: the task's client variables are emptied, so
    # nymph's own paths (passed on with its LAKESHORE_* variables) never reach it
    only_ca = tasktls.workdir_files({"LAKESHORE_CA_FILE": env["LAKESHORE_CA_FILE"]})
    assert tasktls.task_env(only_ca) == {
        "LAKESHORE_CA_FILE": "tls-ca.pem",
        "LAKESHORE_CLIENT_CERT": "",
        "LAKESHORE_CLIENT_KEY": "",
    }
    assert tasktls.workdir_files({}) == []


def test_a_rotated_ca_is_read_again_and_an_unreadable_one_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    env = _pki(tmp_path)
    ca = Path(env["LAKESHORE_CA_FILE"])
    assert tasktls.workdir_files(env)[0][1].endswith(b"ca\n")
    ca.write_bytes(b"-----BEGIN CERTIFICATE-----\nrotated CA\n")
    assert tasktls.workdir_files(env)[0][1].endswith(b"rotated CA\n")
    missing = {"LAKESHORE_CA_FILE": str(tmp_path / "nope.pem")}
    assert tasktls.workdir_files(missing) == [] and tasktls.workdir_files(missing) == []
    assert sum("cannot read it to hand it to tasks" in r.message for r in caplog.records) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="handing files to another user needs root")
def test_the_copies_are_the_task_users_alone(tmp_path: Path) -> None:
    user = pwd.getpwnam("nobody")
    files = tasktls.workdir_files(_pki(tmp_path))
    root = tmp_path / "work"
    root.mkdir()
    path = wd.create(root, new_ulid(), b"\x90", {"attempt": 1}, "nobody", token="t", extra=files)
    for name in ("tls-ca.pem", "tls-client.pem", "tls-client.key", wd.TOKEN):
        st = os.lstat(path / name)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (user.pw_uid, 0o400), name
    assert os.lstat(path).st_uid == user.pw_uid and stat.S_IMODE(os.lstat(path).st_mode) == 0o700
