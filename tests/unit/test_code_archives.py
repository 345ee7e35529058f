"""Code archives (issue 13): what the SDK packs for ``@dls.udf(code=...)``, and how nymph's cache
unpacks it (verified, atomic, safe against hostile archives, pruned)."""

from __future__ import annotations

import hashlib
import io
import os
import stat
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import dreamlake.lakeshore as dls
from dreamlake.lakeshore import codeship
from dreamlake.lakeshore.envelope import Envelope
from dreamlake.lakeshore.errors import TransportError
from nymph import observability as obs
from nymph.codecache import CodeArchiveError, CodeCache, shipped_modules
from tests import code_kit, nymph_fns


@pytest.fixture
def pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A fresh local package, imported as the producer's script would; the default code is "auto"."""
    monkeypatch.delenv("LAKESHORE_CODE", raising=False)
    name = code_kit.unique_name()
    code_kit.write_package(tmp_path / "src", name, "one")
    module = code_kit.load(tmp_path / "src", name)
    yield module
    import sys

    sys.path.remove(str(tmp_path / "src"))


def _names(record: dict[str, Any]) -> list[str]:
    return zipfile.ZipFile(io.BytesIO(record["inline"])).namelist()


def _record(pkg: Any) -> dict[str, Any]:
    record = pkg.which.thunk().to_envelope().cfg["code"]
    assert isinstance(record, dict)
    return record


# --- what the SDK ships ---------------------------------------------------------------------------


def test_auto_is_the_default_and_packs_the_local_top_level_package(pkg: Any) -> None:
    record = _record(pkg)
    name = pkg.__name__
    assert record["roots"] == [name]
    assert record["size"] == len(record["inline"])
    assert record["sha256"] == hashlib.sha256(record["inline"]).hexdigest()
    # sorted; __pycache__ and what .gitignore names (*.bin) dropped
    assert _names(record) == [f"{name}/.gitignore", f"{name}/__init__.py", f"{name}/helpers.py"]


def test_the_archive_is_deterministic_and_content_addressed(pkg: Any, tmp_path: Path) -> None:
    first = _record(pkg)
    init = Path(pkg.__file__)
    os.utime(init, (time.time() + 100, time.time() + 100))  # touched, not changed: the same bytes
    assert _record(pkg) == first
    with zipfile.ZipFile(io.BytesIO(first["inline"])) as zf:
        assert {i.date_time for i in zf.infolist()} == {codeship.FIXED_TIME}
    code_kit.write_package(tmp_path / "src", pkg.__name__, "two")
    edited = _record(code_kit.load(tmp_path / "src", pkg.__name__))
    assert edited["sha256"] != first["sha256"]  # an edit is picked up by the next call


def test_installed_stdlib_sdk_and_main_functions_ship_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LAKESHORE_CODE", raising=False)
    assert codeship.local_root("json.decoder") is None  # the standard library
    assert codeship.local_root("msgpack") is None  # an installed distribution (site-packages)
    assert codeship.local_root("dreamlake.lakeshore.wire") is None  # the worker's runtime
    assert codeship.local_root("__main__") is None  # pickled by value instead
    assert codeship.local_root("tests.nymph_fns") == Path(nymph_fns.__file__).resolve().parent


def test_code_none_and_the_env_default_ship_nothing(pkg: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert dls.udf(code=None)(pkg.which.__wrapped__).thunk().to_envelope().cfg == {}
    monkeypatch.setenv("LAKESHORE_CODE", "none")
    assert pkg.which.thunk().to_envelope().cfg == {}
    monkeypatch.setenv("LAKESHORE_CODE", "everything")
    with pytest.raises(ValueError, match="LAKESHORE_CODE='everything': use 'auto' or 'none'"):
        pkg.which.thunk().to_envelope()


def test_scope_and_process_default_with_udf_winning(pkg: Any, tmp_path: Path) -> None:
    other = tmp_path / "tools.py"
    other.write_text("X = 1\n")
    with dls.scope(code=None):
        assert pkg.which.thunk().to_envelope().cfg == {}
        pinned = dls.udf(code=[str(other)])(pkg.which.__wrapped__)  # the udf's own code= wins
        assert _names(pinned.thunk().to_envelope().cfg["code"]) == ["tools.py"]
    with dls.scope("scenes", code=[str(other), str(tmp_path / "src" / pkg.__name__)]) as prefix:
        thunk = pkg.which.thunk()
    assert prefix == "scenes" and thunk.prefix == "scenes"
    assert thunk.to_envelope().cfg["code"]["roots"] == ["tools.py", pkg.__name__]
    dls.set_default_code(None)
    try:
        assert pkg.which.thunk().to_envelope().cfg == {}
    finally:
        dls.set_default_code()
    assert _record(pkg)["roots"] == [pkg.__name__]


def test_bad_code_values_say_what_to_pass(pkg: Any, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="pass 'auto', None, or a list of paths"):
        dls.udf(code="src/mylib")(pkg.which.__wrapped__)
    with pytest.raises(ValueError, match="code=\\[\\] ships nothing"):
        dls.udf(code=[])(pkg.which.__wrapped__)
    missing = dls.udf(code=[str(tmp_path / "nope")])(pkg.which.__wrapped__)
    with pytest.raises(TransportError, match="neither a directory"):
        missing.thunk().to_envelope()
    (tmp_path / "a").mkdir()
    (tmp_path / "b" / "a").mkdir(parents=True)
    twice = dls.udf(code=[str(tmp_path / "a"), str(tmp_path / "b" / "a")])(pkg.which.__wrapped__)
    with pytest.raises(TransportError, match="share the name 'a'"):
        twice.thunk().to_envelope()
    with pytest.raises(ValueError, match="needs a prefix"), dls.scope():
        pass


def test_the_size_cap_refuses_with_what_to_exclude(pkg: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    (Path(pkg.__file__).parent / "weights.npy").write_bytes(os.urandom(64 * 1024))
    monkeypatch.setenv("LAKESHORE_CODE_MAX_BYTES", str(16 * 1024))
    with pytest.raises(TransportError, match="over the 16384-byte cap") as caught:
        pkg.which.thunk().to_envelope()
    assert ".gitignore" in str(caught.value) and "LAKESHORE_CODE_MAX_BYTES" in str(caught.value)


def test_over_the_inline_threshold_goes_through_the_payload_store(
    pkg: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INLINE_THRESHOLD_BYTES", "100")
    stored: list[tuple[bytes, str]] = []

    def store(data: bytes, digest: str, plane: Any) -> dict[str, Any]:
        stored.append((data, digest))
        return {"ref": {"key": f"payloads/x/{digest}/code", "sha256": digest}, "namespace": "default"}

    monkeypatch.setattr(codeship, "_store_archive", store)
    first = _record(pkg)
    assert "inline" not in first and first["namespace"] == "default"
    assert first["ref"] == {"key": f"payloads/x/{first['sha256']}/code", "sha256": first["sha256"]}
    assert _record(pkg) == first
    assert len(stored) == 1  # uploaded once per content per process


def test_the_record_survives_the_envelope_round_trip_beside_unknown_cfg_keys(pkg: Any) -> None:
    envelope = pkg.which.thunk().to_envelope()
    envelope.cfg["newer"] = {"kept": True}
    back = Envelope.from_bytes(envelope.to_bytes())
    assert back.cfg == envelope.cfg
    assert Envelope.header(envelope.to_bytes())["cfg"]["code"]["sha256"] == envelope.cfg["code"]["sha256"]


# --- nymph's cache --------------------------------------------------------------------------------


def _zip(entries: dict[str, bytes], modes: dict[str, int] | None = None) -> dict[str, Any]:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in entries.items():
            info = zipfile.ZipInfo(name)
            if modes and name in modes:
                info.external_attr = modes[name] << 16
            zf.writestr(info, data)
    data = buf.getvalue()
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "roots": ["m"], "inline": data}


def test_cache_unpacks_once_read_only_and_refuses_a_tampered_archive(tmp_path: Path) -> None:
    cache = CodeCache(tmp_path / "cache")
    record = _zip({"m/__init__.py": b"X = 1\n"})
    path = cache.acquire(record)
    assert (path / "m" / "__init__.py").read_bytes() == b"X = 1\n"
    assert stat.S_IMODE((path / "m" / "__init__.py").stat().st_mode) == 0o444
    assert stat.S_IMODE((path / "m").stat().st_mode) & 0o022 == 0  # no task user's, ever
    assert cache.compiled(record["sha256"], 60)  # nymph's to write while it adds the bytecode, then:
    assert stat.S_IMODE((path / "m").stat().st_mode) == 0o555
    hits = obs.REGISTRY.get_sample_value("nymph_code_archives_total", {"result": "hit"}) or 0
    assert cache.acquire(record) == path and cache.fetches == 1  # the cache hit: not unpacked again
    assert obs.REGISTRY.get_sample_value("nymph_code_archives_total", {"result": "hit"}) == hits + 1
    tampered = dict(record, inline=record["inline"].replace(b"X = 1", b"X = 2"))
    with pytest.raises(CodeArchiveError) as caught:
        cache.acquire(tampered)
    assert str(caught.value) == (
        f"code archive: payload corrupt: sha256 mismatch (expected {record['sha256']}, "
        f"got {hashlib.sha256(tampered['inline']).hexdigest()})"
    )


@pytest.mark.parametrize(
    ("entries", "modes", "why"),
    [
        ({"../evil.py": b"x"}, None, "'..' segment"),
        ({"m/../../evil.py": b"x"}, None, "'..' segment"),
        ({"/etc/evil.py": b"x"}, None, "not a relative path"),
        ({"m/link": b"/etc/passwd"}, {"m/link": stat.S_IFLNK | 0o777}, "is a symbolic link"),
        ({"m/fifo": b""}, {"m/fifo": stat.S_IFIFO | 0o644}, "not a regular file"),
    ],
)
def test_cache_refuses_zip_slip_links_and_devices(
    tmp_path: Path, entries: dict[str, bytes], modes: dict[str, int] | None, why: str
) -> None:
    cache = CodeCache(tmp_path / "cache")
    record = _zip(entries, modes)
    with pytest.raises(CodeArchiveError, match=why):
        cache.acquire(record)
    assert not (tmp_path / "evil.py").exists()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []  # nothing half-unpacked left


def test_cache_refuses_what_is_not_a_zip_and_a_record_without_bytes(tmp_path: Path) -> None:
    cache = CodeCache(tmp_path / "cache")
    junk = b"not a zip"
    with pytest.raises(CodeArchiveError, match="not a zip"):
        cache.acquire({"sha256": hashlib.sha256(junk).hexdigest(), "inline": junk})
    with pytest.raises(CodeArchiveError, match="neither 'inline' bytes nor a 'ref'"):
        cache.acquire({"sha256": "0" * 64})
    with pytest.raises(CodeArchiveError, match="64 lowercase hex"):
        cache.acquire({"sha256": "../../etc", "inline": junk})


def test_concurrent_acquires_of_one_archive_unpack_it_once(tmp_path: Path) -> None:
    cache = CodeCache(tmp_path / "cache")
    record = _zip({f"m/f{i}.py": b"x" * 1000 for i in range(200)})
    paths: list[Path] = []
    threads = [threading.Thread(target=lambda: paths.append(cache.acquire(record))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(paths)) == 1 and cache.fetches == 1
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [record["sha256"]]


def test_prune_drops_old_and_least_recent_but_never_what_a_task_holds(tmp_path: Path) -> None:
    cache = CodeCache(tmp_path / "cache", max_bytes=10**9, max_age_s=3600)
    records = [_zip({"m/__init__.py": bytes([i]) * 4000}) for i in range(3)]
    for i, record in enumerate(records):
        path = cache.acquire(record)
        assert cache.compiled(record["sha256"], 60)  # an archive whose bytecode is being written stays
        os.utime(path, (time.time() - 100 + i, time.time() - 100 + i))
        if i != 0:
            cache.release(record["sha256"])
    cache.max_bytes = 10_000  # 12000 bytes cached: the oldest not held (records[1]) goes, not records[0]
    removed = cache.prune()
    assert removed == [records[1]["sha256"]]
    cache.release(records[0]["sha256"])
    assert cache.prune(now=time.time() + 7200) == [records[0]["sha256"], records[2]["sha256"]]
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_restarted_nymph_holds_the_archive_its_reattached_task_runs_from(tmp_path: Path) -> None:
    first = CodeCache(tmp_path / "cache", max_bytes=0)
    record = _zip({"m/__init__.py": b"x" * 100})
    first.release(first.acquire(record).name)
    second = CodeCache(tmp_path / "cache", max_bytes=0)  # the next life: nothing held in memory
    assert second.hold(record["sha256"]) and not second.hold("f" * 64)
    assert second.prune() == []  # over max_bytes, but a running task holds it
    second.release(record["sha256"])
    assert second.prune() == [record["sha256"]]


def test_shipped_modules_lists_what_the_archive_makes_importable(tmp_path: Path) -> None:
    record = _zip(
        {
            "pkg/__init__.py": b"",
            "pkg/sub/__init__.py": b"",
            "pkg/sub/mod.py": b"Z = 3\n",
            "pkg/fast.cpython-311-x86_64-linux-gnu.so": b"",
            "pkg/data.json": b"{}",
            "pkg/__pycache__/hidden.py": b"",  # importable as pkg.__pycache__.hidden: listed
            "old.pyc": b"",  # a sourceless module
            "tool.py": b"",
        }
    )
    cache = CodeCache(tmp_path / "cache")
    path = cache.acquire(record)
    assert cache.compiled(record["sha256"], 60)
    assert (path / "pkg" / "sub" / "__pycache__").is_dir()  # the bytecode nymph wrote is no module
    assert shipped_modules(path) == [
        "old",
        "pkg",
        "pkg.__pycache__.hidden",
        "pkg.fast",
        "pkg.sub",
        "pkg.sub.mod",
        "tool",
    ]


def test_the_cache_holds_the_bytecode_a_task_imports_instead_of_compiling(tmp_path: Path) -> None:
    """The sealed copy is no task's to write, so nymph writes its bytecode after the unpack: a task imports
    it (even with PYTHONDONTWRITEBYTECODE), its tracebacks name the cached path, and a file that
    does not compile is still there, to fail at its import as before."""
    import importlib.util
    import subprocess
    import sys

    record = _zip(
        {
            "m/__init__.py": b"X = 1\n",
            "m/bad.py": b"raise ValueError('at import')\n",
            "m/broken.py": b"def (\n",
        }
    )
    cache = CodeCache(tmp_path / "cache")
    path = cache.acquire(record)
    assert cache.compiled(record["sha256"], 60)  # written in the background, then sealed again
    pyc = Path(importlib.util.cache_from_source(str(path / "m" / "__init__.py")))
    assert pyc.is_file() and stat.S_IMODE(pyc.stat().st_mode) == 0o444
    assert stat.S_IMODE(pyc.parent.stat().st_mode) == 0o555
    assert not Path(importlib.util.cache_from_source(str(path / "m" / "broken.py"))).exists()
    assert (path / "m" / "broken.py").read_bytes() == b"def (\n"
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(path), "PYTHONDONTWRITEBYTECODE": "1"}
    run = subprocess.run(
        [sys.executable, "-v", "-c", "import m; assert m.X == 1; import m.bad"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert f"code object from '{pyc}'" in run.stderr  # imported from the bytecode, not compiled
    assert f'File "{path / "m" / "bad.py"}"' in run.stderr  # the final path, not the staging one
    assert "ValueError: at import" in run.stderr
    assert shipped_modules(path) == ["m", "m.bad", "m.broken"]


def test_a_compile_cut_off_is_done_again_at_the_next_hit_and_sealed(tmp_path: Path) -> None:
    """nymph killed while it wrote an archive's bytecode leaves the copy writable by nymph and
    part-compiled: the next task that uses it has it compiled again and sealed."""
    import importlib.util

    record = _zip({"m/__init__.py": b"X = 1\n", "m/sub.py": b"Y = 2\n"})
    first = CodeCache(tmp_path / "cache")
    path = first.acquire(record)
    assert first.compiled(record["sha256"], 60)
    pyc = Path(importlib.util.cache_from_source(str(path / "m" / "sub.py")))
    for here, _dirs, _files in os.walk(path):
        os.chmod(here, 0o755)
    pyc.unlink()  # as a kill -9 between two files leaves it
    restarted = CodeCache(tmp_path / "cache")
    assert restarted.acquire(record) == path
    assert restarted.compiled(record["sha256"], 60)
    assert pyc.is_file()
    assert stat.S_IMODE(path.stat().st_mode) == 0o555
    assert stat.S_IMODE(pyc.parent.stat().st_mode) == 0o555
    assert restarted.fetches == 0  # a hit: not unpacked again


def test_a_hit_during_the_compile_starts_no_second_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While an archive's bytecode is written its top directory is nymph's to write (not sealed):
    a task using the archive meanwhile does not take that for a compile cut off."""
    from nymph import codecache

    writing, done = threading.Event(), threading.Event()
    calls: list[Path] = []

    def slow_precompile(root: Path) -> None:
        calls.append(root)
        os.chmod(root, 0o755)
        writing.set()
        done.wait(30)
        os.chmod(root, 0o555)

    monkeypatch.setattr(codecache, "_precompile", slow_precompile)
    record = _zip({"m/__init__.py": b"X = 1\n"})
    cache = CodeCache(tmp_path / "cache")
    path = cache.acquire(record)
    assert writing.wait(30)
    assert cache.acquire(record) == path  # a hit while the copy is writable: the compile runs already
    assert not cache.compiled(record["sha256"], 0.1)
    done.set()
    assert cache.compiled(record["sha256"], 30)
    assert cache.acquire(record) == path
    assert calls == [path]


def test_an_archive_over_the_precompile_limit_is_sealed_without_bytecode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    from nymph import codecache

    monkeypatch.setattr(codecache, "PRECOMPILE_MAX_BYTES", 10)
    record = _zip({"m/__init__.py": b"X = 'more than ten bytes of source'\n"})
    cache = CodeCache(tmp_path / "cache")
    path = cache.acquire(record)
    assert cache.compiled(record["sha256"], 60)
    assert not Path(importlib.util.cache_from_source(str(path / "m" / "__init__.py"))).exists()
    assert stat.S_IMODE((path / "m").stat().st_mode) == 0o555


def test_prune_removes_a_copy_aside_first(tmp_path: Path) -> None:
    """A removal renames the copy to a staging name before it deletes it: one cut off never leaves a
    partial tree under the sha256, which the next acquire would take for a hit."""
    record = _zip({"m/__init__.py": b"X = 1\n"})
    cache = CodeCache(tmp_path / "cache", max_age_s=10)
    path = cache.acquire(record)
    assert cache.compiled(record["sha256"], 60)
    cache.release(record["sha256"])
    os.utime(path, (time.time() - 100, time.time() - 100))
    renamed: list[tuple[str, str]] = []
    real_rename = os.rename

    def rename(src: Any, dst: Any) -> None:
        renamed.append((Path(src).name, Path(dst).name))
        real_rename(src, dst)

    import unittest.mock

    with unittest.mock.patch("nymph.codecache.os.rename", rename):
        assert cache.prune() == [record["sha256"]]
    assert [src for src, _ in renamed] == [record["sha256"]]
    assert renamed[0][1].startswith(".staging-")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == []


def _entry(workdir: Path, envelope: Envelope, code_dir: Path) -> dict[str, Any]:
    """Run the entry on ``envelope`` with ``code_dir`` shipped; error.json (or the result)."""
    import json
    import subprocess
    import sys

    from dreamlake.lakeshore import wire
    from tests.conftest import ROOT

    workdir.mkdir()
    (workdir / "args.msgpack").write_bytes(envelope.to_bytes())
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT), "LAKESHORE_CODE_PATH": str(code_dir)}
    subprocess.run(
        [sys.executable, "-m", "dreamlake.lakeshore.daemon.entry", str(workdir)], env=env, timeout=60
    )
    if (workdir / "error.json").exists():
        return dict(json.loads((workdir / "error.json").read_text()))
    return {"result": wire.unpack((workdir / "result.msgpack").read_bytes())}


def test_an_edit_runs_on_the_next_submit_and_one_that_moved_the_function_says_reload(
    pkg: Any, tmp_path: Path
) -> None:
    cache = CodeCache(tmp_path / "cache")
    fresh = pkg.which.thunk().to_envelope()
    assert _entry(tmp_path / "w1", fresh, cache.acquire(fresh.cfg["code"]))["result"]["version"] == "one"
    # edited on disk, never re-imported by the submitter: the shipped (new) code runs
    code_kit.write_package(tmp_path / "src", pkg.__name__, "edited")
    edited = pkg.which.thunk().to_envelope()
    assert _entry(tmp_path / "w2", edited, cache.acquire(edited.cfg["code"]))["result"]["version"] == "edited"
    # an edit that moved the function: the loaded function no longer matches its file
    init = Path(pkg.__file__)
    init.write_text("# a new first line\n" + init.read_text())
    moved = pkg.which.thunk().to_envelope()
    err = _entry(tmp_path / "w3", moved, cache.acquire(moved.cfg["code"]))
    assert err.get("type") == "StaleSource" and "Reload the module" in err["message"], err


def test_without_pathspec_plain_gitignore_patterns_still_apply() -> None:
    """Inside a task whose image has only the entry bundle (no pathspec), children still ship code."""
    plain = codeship._PlainIgnore(["# data", "*.bin", "build/", "!keep.bin", "docs/*.md"])
    assert plain.match_file("weights.bin") and plain.match_file("sub/weights.bin")
    assert plain.match_file("build/") and not plain.match_file("build")  # a directory pattern
    assert plain.match_file("docs/a.md") and not plain.match_file("a.md")
    assert not plain.match_file("mod.py")


def test_a_main_function_ships_the_local_packages_its_body_names(pkg: Any, tmp_path: Path) -> None:
    """A script's own function travels pickled; the local package it calls must come along."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    script = tmp_path / "script.py"
    script.write_text(
        "import json, sys\n"
        "import dreamlake.lakeshore as dls\n"
        f"import {pkg.__name__} as mylib\n"
        "from json import dumps\n"
        "@dls.udf\n"
        "def f():\n"
        "    return mylib.helpers.tag(), dumps(1)\n"
        "@dls.udf\n"
        "def alone():\n"
        "    return 1\n"
        "print(json.dumps([(t.to_envelope().cfg.get('code') or {}).get('roots') for t in (f.thunk(), alone.thunk())]))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path / "src")])}
    env.pop("LAKESHORE_CODE", None)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [[pkg.__name__], None]  # json (the stdlib) never ships
