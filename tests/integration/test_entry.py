"""The in-sandbox entry run as a real subprocess in a workdir, and the self-contained entry bundle."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest

from dreamlake.lakeshore import wire
from dreamlake.lakeshore.daemon import entry
from dreamlake.lakeshore.daemon.bundle import RUNTIME_FILES, SDK_FILES, build_bundle, bundle_path
from dreamlake.lakeshore.envelope import Envelope, fn_for
from tests import fixtures_fns as ff
from tests.conftest import ROOT, require

SYSTEM_PYTHON = "/usr/bin/python3"


def _workdir(tmp_path: Path, fn: Any, *args: Any, transport: str = "auto", **kwargs: Any) -> Path:
    workdir = tmp_path / "inv"
    workdir.mkdir(mode=0o700)
    envelope = Envelope.create(fn_for(fn, transport=transport), args, kwargs)
    (workdir / "args.msgpack").write_bytes(envelope.to_bytes())
    return workdir


def _run(
    workdir: Path,
    *,
    python: str = sys.executable,
    pythonpath: str = str(ROOT),
    env: dict[str, str] | None = None,
    argv: tuple[str, ...] = (),
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": pythonpath, **(env or {})}
    return subprocess.run(
        [python, "-s", "-m", "dreamlake.lakeshore.daemon.entry", *argv],
        cwd=cwd or workdir,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _result(workdir: Path) -> Any:
    return wire.unpack((workdir / "result.msgpack").read_bytes())


def _error(workdir: Path) -> dict[str, str]:
    info: dict[str, str] = json.loads((workdir / "error.json").read_text())
    return info


def _frames(workdir: Path) -> list[wire.Frame]:
    return wire.FrameReader().feed((workdir / "frames.msgpack").read_bytes())


def test_plain_result(tmp_path: Path) -> None:
    workdir = _workdir(tmp_path, ff.add, 2, b=3)
    proc = _run(workdir)
    assert proc.returncode == 0, proc.stderr
    assert _result(workdir) == 5
    assert sorted(p.name for p in workdir.iterdir()) == ["args.msgpack", "result.digest", "result.msgpack"]
    _assert_digest_checks(workdir)


def _assert_digest_checks(workdir: Path) -> None:
    """result.digest is the blake2b of result.msgpack's exact bytes, and nymph checks it: the same
    bytes pass, one byte changed inside the value is damage."""
    import hashlib

    from nymph import workdir as wd
    from nymph.runner import ExitStatus

    data = (workdir / "result.msgpack").read_bytes()
    kind, hexdigest, size = (workdir / "result.digest").read_bytes().split()
    assert (kind, hexdigest, int(size)) == (
        b"blake2b-256",
        hashlib.blake2b(data, digest_size=32).hexdigest().encode(),
        len(data),
    )
    assert wd.read_outcome(workdir, ExitStatus(0)).state == "succeeded"
    (workdir / "result.msgpack").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    out = wd.read_outcome(workdir, ExitStatus(0))
    assert out.error is not None and out.error["type"] == "DamagedOutput", out
    (workdir / "result.msgpack").write_bytes(data)


def test_generator_frames_then_end(tmp_path: Path) -> None:
    workdir = _workdir(tmp_path, ff.count, 3)
    proc = _run(workdir)
    assert proc.returncode == 0, proc.stderr
    frames = _frames(workdir)
    assert [(f.kind, f.seq) for f in frames] == [(1, 0), (1, 1), (1, 2), (2, 3)]
    assert [wire.unpack(f.body) for f in frames[:3]] == [0, 1, 4]  # type: ignore[arg-type]
    assert wire.unpack(frames[3].body) == "done"  # type: ignore[arg-type]
    assert all(isinstance(f.meta, dict) and isinstance(f.meta["ts"], float) for f in frames)
    assert _result(workdir) == "done"
    _assert_digest_checks(workdir)  # a generator's return value comes with its digest too


def test_an_async_def_runs_to_completion(tmp_path: Path) -> None:
    workdir = _workdir(tmp_path, ff.async_add, 2, b=3)
    proc = _run(workdir)
    assert proc.returncode == 0, proc.stderr
    assert _result(workdir) == 5


def test_an_async_def_that_raises_is_a_failure(tmp_path: Path) -> None:
    workdir = _workdir(tmp_path, ff.async_boom)
    proc = _run(workdir)
    assert proc.returncode == 1
    assert _error(workdir)["type"] == "ValueError" and _error(workdir)["message"] == "async kaboom"


def test_an_async_generator_streams_like_a_generator(tmp_path: Path) -> None:
    workdir = _workdir(tmp_path, ff.async_count, 3)
    proc = _run(workdir)
    assert proc.returncode == 0, proc.stderr
    frames = _frames(workdir)
    assert [(f.kind, f.seq) for f in frames] == [(1, 0), (1, 1), (1, 2), (2, 3)]
    assert [wire.unpack(f.body) for f in frames[:3]] == [0, 1, 4]  # type: ignore[arg-type]
    assert _result(workdir) is None


def test_frames_are_on_disk_while_the_body_still_runs(tmp_path: Path) -> None:
    flag = tmp_path / "go"
    workdir = _workdir(tmp_path, ff.yield_then_wait, str(flag))
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-s", "-m", "dreamlake.lakeshore.daemon.entry"]
    with subprocess.Popen(cmd, cwd=workdir, env=env) as proc:
        try:
            reader, seen = wire.FrameReader(), []
            journal = workdir / "frames.msgpack"
            for _ in range(3000):  # up to ~30 s for the first frame to land
                if journal.exists():
                    seen = reader.feed(journal.read_bytes())
                    if seen:
                        break
                time.sleep(0.01)
            assert [(f.kind, f.seq) for f in seen] == [(wire.FRAME_VALUE, 0)]
            assert proc.poll() is None  # the body is still running, waiting for the flag
            flag.touch()
            assert proc.wait(timeout=60) == 0
        finally:
            proc.kill()
    assert [wire.unpack(f.body) for f in _frames(workdir)[:2]] == ["first", "second"]  # type: ignore[arg-type]


def test_iterator_returned_by_a_plain_function_is_streamed(tmp_path: Path) -> None:
    workdir = _workdir(tmp_path, ff.returns_iterator, 2)
    assert _run(workdir).returncode == 0
    assert [f.kind for f in _frames(workdir)] == [wire.FRAME_VALUE, wire.FRAME_VALUE, wire.FRAME_END]


def test_raise_writes_error_json_and_exits_1(tmp_path: Path) -> None:
    workdir = _workdir(tmp_path, ff.boom, "no good")
    proc = _run(workdir)
    assert proc.returncode == 1
    info = _error(workdir)
    assert (info["type"], info["message"]) == ("ValueError", "no good")
    assert "fixtures_fns.py" in info["traceback"] and "in boom" in info["traceback"]
    assert not (workdir / "result.msgpack").exists()


def test_generator_raise_writes_error_frame_and_error_json(tmp_path: Path) -> None:
    workdir = _workdir(tmp_path, ff.gen_boom, 2)
    proc = _run(workdir)
    assert proc.returncode == 1
    frames = _frames(workdir)
    assert [(f.kind, f.seq) for f in frames] == [(1, 0), (1, 1), (3, 2)]
    body = frames[-1].body
    assert isinstance(body, dict)
    assert (body["type"], body["message"]) == ("RuntimeError", "mid-stream failure")
    assert _error(workdir)["type"] == "RuntimeError"
    assert not (workdir / "result.msgpack").exists()


def test_unpackable_result_is_a_failure_with_the_fix(tmp_path: Path) -> None:
    workdir = _workdir(tmp_path, ff.make_closure, 2)  # returns a function: not a wire value
    proc = _run(workdir)
    assert proc.returncode == 1
    info = _error(workdir)
    assert info["type"] == "TypeError"
    assert "function" in info["message"]


def test_pickled_refused_without_allow_pickled(tmp_path: Path) -> None:
    workdir = _workdir(tmp_path, ff.make_closure(3), 5)
    proc = _run(workdir)
    assert proc.returncode == 2
    info = _error(workdir)
    assert info["type"] == "PickleRefused"
    assert "--allow-pickled" in info["message"]
    assert "PickleRefused" in proc.stderr


def test_pickled_allowed_with_allow_pickled(tmp_path: Path) -> None:
    workdir = _workdir(tmp_path, ff.make_closure(3), 5)
    proc = _run(workdir, env={"LAKESHORE_ALLOW_PICKLED": "1"})
    assert proc.returncode == 0, proc.stderr
    assert _result(workdir) == 15


def _ref_workdir(tmp_path: Path, module: str, qualname: str, *args: Any) -> Path:
    workdir = tmp_path / "inv"
    workdir.mkdir(mode=0o700)
    fn = {"kind": "ref", "module": module, "qualname": qualname}
    (workdir / "args.msgpack").write_bytes(Envelope.create(fn, args).to_bytes())
    return workdir


@pytest.mark.parametrize(
    ("module", "qualname", "args"),
    [
        ("builtins", "exec", ("open('owned.txt', 'w')",)),  # a module outside the patterns
        ("tests.fixtures_fns", "os.system", ("touch owned.txt",)),  # allowed module, os's function
    ],
)
def test_allow_modules_refuses_what_the_patterns_do_not_match(
    tmp_path: Path, module: str, qualname: str, args: tuple[Any, ...]
) -> None:
    workdir = _ref_workdir(tmp_path, module, qualname, *args)
    proc = _run(workdir, env={entry.ALLOW_MODULES_ENV: "tests.*,mypkg"})
    assert proc.returncode == 2, proc.stderr
    info = _error(workdir)
    assert info["type"] == "ModuleRefused" and "--allow-module" in info["message"], info
    assert not (workdir / "owned.txt").exists()


def test_allow_modules_runs_a_matching_function(tmp_path: Path) -> None:
    workdir = _workdir(tmp_path, ff.add, 1, 2, transport="ref")
    proc = _run(workdir, env={entry.ALLOW_MODULES_ENV: "tests.*"})
    assert proc.returncode == 0, proc.stderr
    assert _result(workdir) == 3


def test_allow_module_wildcards_never_reach_the_standard_library() -> None:
    assert entry.module_allowed("mypkg.tasks", ["mypkg.*"])
    assert not entry.module_allowed("mypkg", ["mypkg.*"]) and entry.module_allowed("mypkg", ["mypkg"])
    for module in ("builtins", "subprocess", "os", "importlib.util"):
        assert not entry.module_allowed(module, ["*"]), module
    assert entry.module_allowed("subprocess", ["subprocess"])  # named exactly: the operator's choice


def test_gate_errors_exit_2(tmp_path: Path) -> None:
    workdir = _workdir(tmp_path, ff.add, 1)
    proc = _run(workdir, env={"LAKESHORE_RUNTIME_POLICY": "lax"})
    assert proc.returncode == 2
    info = _error(workdir)
    assert info["type"] == "ValueError"
    assert "LAKESHORE_RUNTIME_POLICY='lax'" in info["message"]

    stale = {**fn_for(ff.add), "src_hash": "sha256:" + "0" * 16}
    (workdir / "args.msgpack").write_bytes(Envelope.create(stale, [1]).to_bytes())
    assert _run(workdir).returncode == 2
    assert _error(workdir)["type"] == "StaleSource"


@pytest.mark.parametrize("content", [b"\x93garbage", None], ids=["garbage", "missing"])
def test_bad_or_missing_envelope_exits_2(tmp_path: Path, content: bytes | None) -> None:
    workdir = tmp_path / "inv"
    workdir.mkdir()
    if content is not None:
        (workdir / "args.msgpack").write_bytes(content)
    proc = _run(workdir)
    assert proc.returncode == 2
    info = _error(workdir)
    assert info["type"] == ("EnvelopeError" if content else "FileNotFoundError")
    if content is None:
        assert "workdir" in info["message"]


def test_explicit_workdir_argument_and_invocation_env(tmp_path: Path) -> None:
    workdir = _workdir(tmp_path, ff.cwd)
    proc = _run(workdir, argv=(str(workdir),), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _result(workdir) == str(workdir)

    (workdir / "args.msgpack").write_bytes(
        Envelope.create(fn_for(ff.env_value), ["LAKESHORE_INVOCATION_ID"]).to_bytes()
    )
    assert _run(workdir, env={"LAKESHORE_INVOCATION_ID": "01TEST"}).returncode == 0
    assert _result(workdir) == "01TEST"


def test_outputs_replace_atomically(tmp_path: Path) -> None:
    workdir = _workdir(tmp_path, ff.add, 40, b=2)
    (workdir / "result.msgpack").write_bytes(b"old")
    with open(workdir / "result.msgpack", "rb") as reader:
        assert _run(workdir).returncode == 0
        assert reader.read() == b"old"  # the open file is the old inode: the new one was renamed in
    assert _result(workdir) == 42
    assert not [p for p in workdir.iterdir() if p.name.startswith(".")]


def test_run_context_uses_the_sdk_hook_only_when_already_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    import contextlib
    import types

    envelope = Envelope.create(fn_for(ff.add), [1])
    monkeypatch.delitem(sys.modules, "dreamlake.lakeshore.decorator", raising=False)
    with entry._run_context(envelope) as value:
        assert value is None
    assert "dreamlake.lakeshore.decorator" not in sys.modules  # the entry never imports the SDK itself

    seen: list[str] = []

    @contextlib.contextmanager
    def invocation_context(env: Envelope) -> Any:
        seen.append(env.id)
        yield "ctx"

    fake = types.ModuleType("dreamlake.lakeshore.decorator")
    fake.invocation_context = invocation_context  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "dreamlake.lakeshore.decorator", fake)
    with entry._run_context(envelope) as value:
        assert value == "ctx"
    assert seen == [envelope.id]


def test_entry_start_up_stays_lean(tmp_path: Path) -> None:
    code = (
        "import sys, dreamlake.lakeshore.daemon.entry; "
        "print(sorted(m for m in ('cloudpickle', 'httpx', 'sqlalchemy', 'starlette', 'numpy', "
        "'dreamlake.lakeshore.decorator', 'dreamlake.lakeshore.server') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- the bundle ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bundle(tmp_path_factory.mktemp("bundle") / "lakeshore-entry.zip")


def _system_python_without_msgpack() -> bool:
    if not os.path.exists(SYSTEM_PYTHON):
        return False
    probe = subprocess.run([SYSTEM_PYTHON, "-s", "-c", "import msgpack"], capture_output=True, env={})
    return probe.returncode != 0


def test_bundle_carries_pure_python_only_and_parses_on_3_9(bundle: Path) -> None:
    with zipfile.ZipFile(bundle) as zf:
        names = set(zf.namelist())
        assert set(RUNTIME_FILES) | set(SDK_FILES) <= names
        assert {"msgpack/fallback.py", "cloudpickle/cloudpickle.py"} <= names
        assert not [n for n in names if n.endswith((".so", ".pyd"))]
        for name in sorted(n for n in names if n.endswith(".py")):
            ast.parse(zf.read(name), filename=name, feature_version=(3, 9))


def test_bundle_runs_ref_and_pickled_on_a_bare_python(bundle: Path, tmp_path: Path) -> None:
    require(_system_python_without_msgpack(), f"{SYSTEM_PYTHON} without msgpack (a bare runtime)")
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "bare_mod.py").write_text("def shout(s, times=1):\n    return (s.upper() + '!') * times\n")
    sys.path.insert(0, str(mods))
    try:
        import bare_mod

        workdir = _workdir(tmp_path, bare_mod.shout, "hi", times=2)
    finally:
        sys.path.remove(str(mods))
        sys.modules.pop("bare_mod", None)
    pythonpath = f"{bundle}{os.pathsep}{mods}"
    proc = _run(workdir, python=SYSTEM_PYTHON, pythonpath=pythonpath)
    assert proc.returncode == 0, proc.stderr
    assert _result(workdir) == "HI!HI!"

    lam = lambda x: (x, x * 3)  # noqa: E731
    (workdir / "args.msgpack").write_bytes(Envelope.create(fn_for(lam), [7]).to_bytes())
    proc = _run(workdir, python=SYSTEM_PYTHON, pythonpath=str(bundle), env={"LAKESHORE_ALLOW_PICKLED": "1"})
    assert proc.returncode == 0, proc.stderr
    assert _result(workdir) == (7, 21)


def _oldest_python() -> str | None:
    """A Python 3.9 from pyenv, when this machine has one (the oldest version the bundle supports)."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = sorted(root.glob("3.9.*/bin/python3.9"))
    return str(found[-1]) if found else None


def test_bundle_runs_on_python_3_9(bundle: Path, tmp_path: Path) -> None:
    python = _oldest_python()
    require(python is not None, "a Python 3.9 under $PYENV_ROOT/versions (the oldest the bundle supports)")
    assert python is not None
    probe = subprocess.run([python, "-s", "-c", "import msgpack"], capture_output=True, env={})
    assert probe.returncode != 0, f"{python} has msgpack installed: not a bare runtime"
    workdir = _workdir(tmp_path, ff.count, 2)
    proc = _run(workdir, python=python, pythonpath=f"{bundle}{os.pathsep}{ROOT}")
    assert proc.returncode == 0, proc.stderr
    assert [f.kind for f in _frames(workdir)] == [wire.FRAME_VALUE, wire.FRAME_VALUE, wire.FRAME_END]
    assert _result(workdir) == "done"


def test_bundle_wins_over_an_installed_copy_and_the_rest_stays_importable(bundle: Path) -> None:
    code = (
        "import dreamlake.lakeshore.wire as w, dreamlake.lakeshore.decorator as u, "
        "dreamlake.lakeshore.worker as k; print(w.__file__); print(u.__file__); print(k.__file__)"
    )
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": f"{bundle}{os.pathsep}{ROOT}"}
    out = subprocess.run([sys.executable, "-c", code], cwd="/", env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    wire_file, udf_file, worker_file = out.stdout.split()
    assert wire_file.startswith(str(bundle)) and udf_file.startswith(str(bundle))  # the SDK surface
    assert worker_file == str(ROOT / "dreamlake" / "lakeshore" / "worker.py")  # not bundled: installed


# --- a user's decorated module on a bare runtime ------------------------------------------------------

SDK_USER_MODULE = """
import dreamlake.lakeshore as dls

@dls.udf(queue="work")
def add(a, b):
    with dls.scope("out"):
        return {"sum": a + b, "key": dls.run.key("x"), "id": dls.run.id, "name": dls.run.name}

@dls.udf(queue="work")
def fan(n):
    return [add.submit(i, i) for i in range(n)]

@dls.udf(queue="work")
def no_worker():
    return dls.run_worker
"""


def _user_task(tmp_path: Path, fn_name: str, *args: Any) -> tuple[Path, Path]:
    """A workdir for ``sdk_user_mod.<fn_name>(*args)`` submitted inside ``scope("jobs/1")``."""
    mods = tmp_path / "mods"
    mods.mkdir(exist_ok=True)
    (mods / "sdk_user_mod.py").write_text(SDK_USER_MODULE)
    sys.path.insert(0, str(mods))
    try:
        import sdk_user_mod

        import dreamlake.lakeshore as dls

        with dls.scope("jobs/1"):
            envelope = getattr(sdk_user_mod, fn_name).thunk(*args).to_envelope()
    finally:
        sys.path.remove(str(mods))
        sys.modules.pop("sdk_user_mod", None)
    workdir = tmp_path / envelope.id
    workdir.mkdir(mode=0o700)
    (workdir / "args.msgpack").write_bytes(envelope.to_bytes())
    return workdir, mods


@pytest.mark.parametrize("which", ["3.9", "system"])
def test_bundle_runs_a_decorated_module_on_a_bare_python(bundle: Path, tmp_path: Path, which: str) -> None:
    python = _oldest_python() if which == "3.9" else SYSTEM_PYTHON
    require(python is not None and os.path.exists(python), f"a bare Python {which}")
    assert python is not None
    probe = subprocess.run([python, "-s", "-c", "import msgpack"], capture_output=True, env={})
    require(probe.returncode != 0, f"{python} without msgpack (a bare runtime)")
    workdir, mods = _user_task(tmp_path, "add", 2, 3)
    invocation = {"LAKESHORE_INVOCATION_ID": workdir.name}
    proc = _run(workdir, python=python, pythonpath=f"{bundle}{os.pathsep}{mods}", env=invocation)
    assert proc.returncode == 0, proc.stderr
    assert _result(workdir) == {"sum": 5, "key": "jobs/1/out/x", "id": workdir.name, "name": "add"}


def test_a_missing_piece_is_named_inside_the_task(bundle: Path, tmp_path: Path) -> None:
    require(_system_python_without_msgpack(), f"{SYSTEM_PYTHON} without msgpack (a bare runtime)")
    workdir, mods = _user_task(tmp_path, "fan", 2)
    env = {
        "LAKESHORE_INVOCATION_ID": workdir.name,
        "LAKESHORE_URL": "http://127.0.0.1:9",
        "LAKESHORE_TOKEN": "t",
    }
    proc = _run(workdir, python=SYSTEM_PYTHON, pythonpath=f"{bundle}{os.pathsep}{mods}", env=env)
    assert proc.returncode == 1
    error = _error(workdir)
    assert error["type"] == "ModuleNotFoundError"
    assert error["message"].startswith("submitting from inside a task")
    assert (
        "needs httpx and tenacity in the image" in error["message"]
        and "pip install httpx" in error["message"]
    )

    workdir, mods = _user_task(tmp_path, "no_worker")
    env["LAKESHORE_INVOCATION_ID"] = workdir.name
    proc = _run(workdir, python=SYSTEM_PYTHON, pythonpath=f"{bundle}{os.pathsep}{mods}", env=env)
    assert proc.returncode == 1
    assert "dls.run_worker needs dreamlake-lakeshore in the image" in _error(workdir)["message"]


def test_bundle_path_is_cached_by_content(tmp_path: Path) -> None:
    first = bundle_path(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert bundle_path(tmp_path) == first
    assert first.stat().st_mtime_ns == mtime
    assert first.parent == tmp_path and first.name.startswith("lakeshore-entry-")
    assert zipfile.is_zipfile(first)
