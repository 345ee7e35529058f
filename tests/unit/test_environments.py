"""What a call asks of its environment, below the agent (issue 33): the SDK's records, nymph's
task environment and mounts, the pip-environment cache (one build per lock, as the task's user,
sealed, pruned) and the kube pod's volumes for mounts. End to end: tests/integration/test_environments.py."""

from __future__ import annotations

import os
import pwd
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import dreamlake.lakeshore as dls
from dreamlake.lakeshore import runenv
from dreamlake.lakeshore.envelope import Envelope
from nymph import envcache, taskenv
from nymph.config import resolve
from nymph.errors import ConfigError, GateRefused
from tests import pip_kit
from tests.host_users import ensure_user

# --- the SDK's side ----------------------------------------------------------------------------------


def test_pip_rides_in_the_envelope_cfg_and_env_secrets_mounts_in_run_config() -> None:
    @dls.udf(pip=["pyfiglet==1.0.2"], env={"OMP_NUM_THREADS": "4"}, secrets=["HF_TOKEN"], mounts=["datasets"])
    def f() -> None: ...

    thunk = f.thunk(_env={"EXTRA": "1", "OMP_NUM_THREADS": "8"})
    envelope = Envelope.from_bytes(thunk.to_envelope().to_bytes())
    assert envelope.cfg["pip"] == {"format": "requirements", "text": "pyfiglet==1.0.2\n"}
    rc = thunk.run_config()
    assert rc["env"] == {"OMP_NUM_THREADS": "8", "EXTRA": "1"}  # per call over the udf's
    assert rc["secrets"] == ["HF_TOKEN"] and rc["mounts"] == ["datasets"]
    assert f.thunk().run_config()["env"] == {"OMP_NUM_THREADS": "4"}  # the udf's own, untouched


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"env": {"LAKESHORE_TOKEN": "x"}}, "reserved"),
        # the operator's import path, which the container runners mount: never the call's
        ({"env": {"PYTHONPATH": "/srv/other-tenant"}}, "nymph's .*code archive.*code_dirs"),
        # what the dynamic loader or a Python interpreter reads as it starts: nymph's own processes
        # (the process runner's zygote, runuser; root's on a root nymph) start the task with it
        ({"env": {"LD_PRELOAD": "/tmp/x.so"}}, "changes how the processes that start a task load"),
        ({"env": {"LD_LIBRARY_PATH": "/tmp/lib"}}, "--pass-env"),
        ({"env": {"PYTHONUSERBASE": "/tmp/u"}}, "changes how the processes"),
        ({"env": {"GLIBC_TUNABLES": "x"}}, "changes how the processes"),
        ({"secrets": ["LD_PRELOAD"]}, "changes how the processes"),  # a secret's value lands there too
        ({"secrets": ["PYTHONPATH"]}, "nymph's"),
        ({"env": {"1BAD": "x"}}, "not a variable name"),
        # a name no operator can declare (--mount NAME=...): before, accepted and failed on nymph
        # with MountRefused suggesting `--mount ../etc=/host/path`
        ({"mounts": ["../etc"]}, "not a mount name.*never by its path"),
        ({"mounts": ["/srv/datasets"]}, "not a mount name"),
        ({"mounts": ["a\nb"]}, "not a mount name"),
        ({"env": {"A": 1}}, "must be a string"),
        ({"secrets": "HF_TOKEN"}, "list of names"),
        ({"secrets": ["LAKESHORE_X"]}, "reserved"),
        ({"pip": ["--index-url http://evil"]}, "not taken"),
        ({"pip": ["a"], "requirements": "r.txt"}, "not both"),
        ({"requirements": "/nonexistent/reqs.txt"}, "cannot read"),
    ],
)
def test_bad_environment_requests_fail_at_decoration_with_what_to_do(kwargs: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        dls.udf(**kwargs)(lambda: None)


def test_requirements_files_pylock_and_uv_lock(tmp_path: Path) -> None:
    reqs = tmp_path / "reqs.txt"
    reqs.write_text("# pinned\npyfiglet==1.0.2\n")
    assert runenv.pip_record(requirements=reqs) == {"format": "requirements", "text": reqs.read_text()}
    pylock = tmp_path / "pylock.toml"
    pylock.write_text('lock-version = "1.0"\n')
    assert runenv.pip_record(requirements=str(pylock))["format"] == "pylock.toml"
    uvlock = tmp_path / "uv.lock"
    uvlock.write_text(
        'version = 1\n[[package]]\nname = "me"\nversion = "0.1"\nsource = { editable = "." }\n'
        '[[package]]\nname = "pyfiglet"\nversion = "1.0.2"\nsource = { registry = "https://pypi.org/simple" }\n'
    )
    assert runenv.pip_record(requirements=uvlock) == {"format": "requirements", "text": "pyfiglet==1.0.2\n"}


# --- nymph's task environment and mounts ----------------------------------------------------------


def test_passed_variables_never_include_nymphs_token_and_follow_the_allow_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LAKESHORE_TOKEN", "nymphs")
    monkeypatch.setenv("LAKESHORE_SOMETHING", "a")
    monkeypatch.setenv("CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setenv("MYSECRET_X", "never")
    monkeypatch.setenv("WANTED", "yes")
    got = taskenv.passed(("WANTED",))
    assert (
        got["LAKESHORE_SOMETHING"] == "a" and got["CUDA_HOME"] == "/usr/local/cuda" and got["WANTED"] == "yes"
    )
    assert "LAKESHORE_TOKEN" not in got and "MYSECRET_X" not in got
    assert "WANTED" not in taskenv.passed()
    assert "MYSECRET_X" not in taskenv.host_base()


def test_mounts_are_declared_by_the_operator_and_asked_for_by_name(tmp_path: Path) -> None:
    cfg = resolve(
        {"server": "http://x", "token": "t", "mounts": (f"datasets={tmp_path}:ro", "scratch=/srv/scratch")},
        {},
    )
    assert cfg.mounts == {"datasets": (str(tmp_path), True), "scratch": ("/srv/scratch", False)}
    env, mounts = taskenv.call_env(cfg, {"mounts": ["datasets"], "env": {"A": "1"}})
    assert env == {"A": "1"} and mounts == {"datasets": (str(tmp_path), True)}
    assert taskenv.mounts_env(mounts) == {"LAKESHORE_MOUNT_DATASETS": str(tmp_path)}
    with pytest.raises(
        GateRefused, match=r"'models' is not offered by this worker .*datasets, scratch.*--mount models="
    ):
        taskenv.call_env(cfg, {"mounts": ["models"]})
    for bad in ("noequals", "x=relative/path", "bad name=/x"):
        with pytest.raises(ConfigError):
            taskenv.parse_mount(bad)
    assert taskenv.parse_mount("claims=pvc:datasets-pvc:ro") == ("claims", "pvc:datasets-pvc", True)


def test_kube_pods_mount_host_paths_and_claims_by_name() -> None:
    from nymph_kube import podspec

    opts = podspec.PodOptions(
        namespace="ns",
        image="python:3.11",
        image_pull_policy="Never",
        service_account=None,
        node_name="node-1",
    )
    manifest = podspec.pod_manifest(
        opts, name="nymph-x-a1", image="python:3.11", script=None, env={}, host_workdir="/w/x",
        host_bundle="/w/b.zip", uid=1000, gid=1000, pod_labels={}, annotations={}, container_resources={},
        shm_bytes=None, user_mounts={"datasets": ("/srv/data", True), "models": ("pvc:models", False)},
    )  # fmt: skip
    volumes = {v["name"]: v for v in manifest["spec"]["volumes"]}
    assert volumes["mount-0"]["hostPath"] == {"path": "/srv/data", "type": "Directory"}
    assert volumes["mount-1"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": False}
    mounts = {m["mountPath"]: m for m in manifest["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["/mnt/lakeshore/datasets"]["readOnly"] is True
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(manifest, "1.30", strict=True)


# --- the pip-environment cache ---------------------------------------------------------------------


@pytest.fixture
def shared_root() -> Iterator[Path]:
    """A directory any local user can traverse (a task user builds under it), removed after."""
    root = Path(tempfile.mkdtemp(prefix="lakeshore-envs-"))
    os.chmod(root, 0o755)
    yield root
    for here, dirs, _ in os.walk(root):
        for d in dirs:
            os.chmod(os.path.join(here, d), 0o755)
    shutil.rmtree(root, ignore_errors=True)


def _cache(root: Path, **kw: object) -> envcache.EnvCache:
    wheels = pip_kit.wheelhouse(root / "wheels")
    (root / "no-index").mkdir(exist_ok=True)
    return envcache.EnvCache(
        root / "envs", find_links=[str(wheels)], index_url=(root / "no-index").as_uri(), **kw
    )  # type: ignore[arg-type]


def test_eight_concurrent_first_calls_build_once(shared_root: Path) -> None:
    cache = _cache(shared_root)
    interp = envcache.host_interpreter(sys.executable)
    got: list[Path] = []
    threads = [
        threading.Thread(
            target=lambda: got.append(cache.acquire({"format": "requirements", "text": "lsdemo\n"}, interp))
        )
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(got) == 8 and len(set(got)) == 1 and cache.builds == 1
    env = got[0]
    assert (env / "lsdemo" / "__init__.py").is_file() and (env / "lsdep").is_dir()  # the dependency too
    assert os.stat(env).st_mode & 0o777 == 0o555
    assert os.stat(env / "lsdemo" / "__init__.py").st_mode & 0o777 == 0o444
    # the same requirements spelled the same way resolve once; the lock keys the environment
    assert len(list((cache.root / ".specs").iterdir())) == 1


def test_a_build_runs_as_the_task_user_never_root_and_ends_owned_by_nymph(shared_root: Path) -> None:
    if os.geteuid() != 0 or not ensure_user("nymphtest"):
        pytest.skip("needs root and a task user (useradd)")
    if not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("needs the system python3 (the task user's interpreter)")
    cache = _cache(shared_root)
    user = pwd.getpwnam("nymphtest")
    env = cache.acquire(
        {"format": "requirements", "text": "lsdemo\n"},
        envcache.host_interpreter("/usr/bin/python3"),
        "nymphtest",
    )
    assert os.stat(env / "lsdemo" / "__init__.py").st_uid == 0  # nymph's copy: no task can change it
    assert not [p for p in cache.root.iterdir() if p.name.startswith(".work-")]  # the builder's tree is gone
    # nothing the task user can write is left under the cache: a uv cache kept for its uid would
    # be open to the next tenant's task as that uid (a pool user), whose code a later build of
    # another tenant would install and seal (uv's cache lived in the builder's tree, gone with it)
    left = [
        p
        for p in cache.root.rglob("*")
        if not p.is_symlink() and (p.stat().st_uid == user.pw_uid or p.stat().st_mode & 0o002)
    ]
    assert left == [], left


def test_a_bad_requirement_is_env_build_failed_with_uvs_words_and_nothing_cached(shared_root: Path) -> None:
    cache = _cache(shared_root)
    with pytest.raises(envcache.EnvBuildFailed, match="nosuchpkg-zz") as info:
        cache.acquire(
            {"format": "requirements", "text": "nosuchpkg-zz\n"}, envcache.host_interpreter(sys.executable)
        )
    assert info.value.type == "EnvBuildFailed"
    assert not [p for p in cache.root.iterdir() if envcache.cachedir.is_sha256(p.name)]


def test_prune_keeps_held_environments_and_drops_old_ones(shared_root: Path) -> None:
    cache = _cache(shared_root, max_age_s=60)
    interp = envcache.host_interpreter(sys.executable)
    held = cache.acquire({"format": "requirements", "text": "lsdemo\n"}, interp)
    old = cache.acquire({"format": "requirements", "text": "lsdep\n"}, interp)
    cache.release(old.name)
    removed = cache.prune(now=os.stat(old).st_mtime + 3600)
    assert removed == [old.name] and held.is_dir() and not old.exists()


@pytest.mark.parametrize("left", ["a link for its lock", "a link for its site"])
def test_what_the_builder_leaves_is_never_read_through_a_link(shared_root: Path, left: str) -> None:
    """nymph (root) reads what uv left in the builder's scratch directory: the resolved lock and
    the installed tree. A build backend runs the producer's code as the task user and could leave
    links there instead, to a file only root may read (another tenant's secrets): nymph reads
    neither through a link, and the build fails EnvBuildFailed with nothing of the target kept."""
    private = shared_root / "private"
    private.mkdir(mode=0o700)
    (private / "secret.env").write_text("HF_TOKEN=the-other-tenants-token\n")
    (private / "pkg").mkdir()
    (private / "pkg" / "secret.txt").write_text("the-other-tenants-token\n")
    fake = shared_root / "fake-uv"
    compile_step = f"ln -s {private / 'secret.env'} requirements.txt"
    install_step = f"ln -s {private / 'pkg'} site"
    if left == "a link for its site":
        compile_step = "echo 'lsdemo==1.0' > requirements.txt"
    fake.write_text(
        f'#!/bin/sh\ncase "$2" in\n  compile) {compile_step} ;;\n  install) {install_step} ;;\nesac\n'
    )
    fake.chmod(0o755)
    cache = envcache.EnvCache(shared_root / "envs", uv=str(fake))
    with pytest.raises(envcache.EnvBuildFailed, match="of its own"):
        cache.acquire(
            {"format": "requirements", "text": "lsdemo\n"}, envcache.host_interpreter(sys.executable)
        )
    kept = [p for p in (shared_root / "envs").rglob("*") if p.is_file() and not p.is_symlink()]
    assert not [p for p in kept if "the-other-tenants-token" in p.read_text(errors="replace")], kept
