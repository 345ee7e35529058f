"""The pip-environment cache: what a call's ``cfg["pip"]`` asks for, built once per lock on each host.

A call says ``@dls.udf(pip=["pyfiglet==1.0.2"])`` (or ``requirements="reqs.txt"``, a
``pylock.toml``, a ``uv.lock``: :func:`dreamlake.lakeshore.runenv.pip_record`). nymph, started with
``--allow-pip``, turns it into a directory of installed packages with ``uv`` (a dependency of
nymph's side, ``pip install 'dreamlake-lakeshore[pip]'``) and the task gets it on its import path
after the code the call shipped and before the task interpreter's own packages: the entry and the
SDK's dependencies stay importable, the environment's packages win where both have one.

Two steps, each done once per host and each under a file lock (``flock``), so that concurrent
first calls (threads of one nymph, or several nymphs on one host) wait for one build:

1. **resolve**: the requirements (their text, the interpreter, the index and find-links of this
   nymph) hash to a *spec key*; ``uv pip compile`` turns them into a lock (pinned versions), kept
   in ``{env_cache}/.specs/<spec key>``. A ``pylock.toml`` is its own lock.
2. **build**: the lock and the interpreter hash to the environment's sha256, its directory
   ``{env_cache}/<sha256>/`` (``uv pip install --target``), built in a staging directory and
   renamed into place, sealed read-only (:mod:`nymph.cachedir`, as the code cache).

Who builds: ``uv`` runs as the task's user (nymph's task user when nymph is root, or the call's
``as_user``), never as root: a package's build backend is code the producer chose. It writes only
to its scratch directory and a uv cache inside it, both removed after the build (a uv cache kept
for the task uid would be writable by the next tenant's task as that uid); nymph then takes the
tree over (owner nymph, files 0444, directories 0555), so no task can change what the next one
runs. The task interpreter's version and platform come from the runner (:class:`Interpreter`): the
process and slurm runners build for their python, the container runners for the image's
``python3`` (probed once per image), so an image with python3 and nothing else suffices.

A failed build is :class:`EnvBuildFailed` with uv's message, final (never retried: the same
requirements fail the same way). Metrics: ``nymph_pip_envs{result=hit|built|failed}`` and
``nymph_pip_env_build_seconds``. Pruning as the code cache: unused for ``max_age_s``, then least
recently used over ``max_bytes``, never one a running task holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dreamlake.lakeshore.runenv import check_pip
from nymph import cachedir, safeio
from nymph import observability as obs
from nymph.errors import JobRefused
from nymph.taskenv import host_base

log = logging.getLogger(__name__)

ENV_MARKER = ".lakeshore-env"  # in every built environment: the entry processes its .pth files
BUILD_TIMEOUT_S = 900.0
MESSAGE_TAIL = 4000  # characters of uv's message kept in the error
DEFAULT_MAX_BYTES = 10 * 1024**3
_NETWORK_ENV = frozenset(
    {"SSL_CERT_FILE", "SSL_CERT_DIR", "HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "NO_PROXY", "UV_NATIVE_TLS"}
    | {"https_proxy", "http_proxy", "all_proxy", "no_proxy"}
)
DEFAULT_MAX_AGE_S = 7 * 24 * 3600.0
_PROBE = (
    "import json, platform, sys; print(json.dumps({'version': '%d.%d' % sys.version_info[:2], "
    "'impl': sys.implementation.cache_tag, 'machine': platform.machine(), "
    "'libc': ' '.join(platform.libc_ver())}))"
)


class EnvBuildFailed(JobRefused):
    """A pip environment could not be resolved or built; the message is uv's. Final."""

    def __init__(self, message: str) -> None:
        super().__init__("EnvBuildFailed", message)


@dataclass(frozen=True)
class Interpreter:
    """The task interpreter an environment is built for.

    ``python``: its path on this host (uv then asks it directly); None for an interpreter in an
    image, described by ``version`` (``"3.11"``) and ``platform`` (uv's ``--python-platform``)."""

    version: str
    tag: str  # what of the interpreter keys the environment (implementation, machine, libc)
    python: str | None = None
    platform: str | None = None

    def uv_args(self) -> list[str]:
        if self.python is not None:
            return ["--python", self.python]
        args = ["--python-version", self.version]
        return [*args, "--python-platform", self.platform] if self.platform else args

    @classmethod
    def from_probe(cls, info: Mapping[str, Any], python: str | None = None) -> Interpreter:
        """From :data:`_PROBE`'s answer; ``python`` None: an image's (a platform tag from its libc)."""
        version = str(info["version"])
        machine = str(info.get("machine") or "x86_64")
        libc = str(info.get("libc") or "")
        platform = None
        if python is None:
            name, _, ver = libc.partition(" ")
            major, _, minor = ver.partition(".")
            if name == "glibc" and major.isdigit() and minor.isdigit():
                platform = f"{machine}-manylinux_{major}_{minor}"
            else:
                platform = f"{machine}-unknown-linux-gnu"
        tag = f"{info.get('impl')}-{machine}-{libc.replace(' ', '')}"
        return cls(version=version, tag=tag, python=python, platform=platform)


_HOST: dict[str, Interpreter] = {}
_HOST_LOCK = threading.Lock()


def host_interpreter(python: str) -> Interpreter:
    """The interpreter at ``python`` on this host, asked once per path."""
    with _HOST_LOCK:
        found = _HOST.get(python)
    if found is not None:
        return found
    try:
        out = subprocess.run(
            [python, "-I", "-c", _PROBE],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
            env=host_base(),
        )
        found = Interpreter.from_probe(json.loads(out.stdout), python=python)
    except (OSError, subprocess.SubprocessError, ValueError, KeyError) as exc:
        raise EnvBuildFailed(f"pip environment: cannot ask the task interpreter {python} ({exc})") from exc
    with _HOST_LOCK:
        _HOST[python] = found
    return found


def probe_source() -> str:
    """The Python source a container runner runs in an image to describe its interpreter (JSON)."""
    return _PROBE


def uv_binary() -> str | None:
    """``uv``: next to nymph's interpreter (its venv), else on PATH."""
    import sys

    here = Path(sys.executable).parent / "uv"
    if os.access(here, os.X_OK):
        return str(here)
    return shutil.which("uv")


class EnvCache:
    """Environments under ``root``, one directory per sha256 (see the module docstring)."""

    def __init__(
        self,
        root: Path,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        index_url: str | None = None,
        find_links: Sequence[str] = (),
        uv: str | None = None,
    ) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.index_url = index_url
        self.find_links = tuple(find_links)
        self.uv = uv
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}
        self.builds = 0  # environments this process built (the cache's misses)
        self._swept = False  # the old uv caches removed (_prepare_root)

    def path_for(self, sha256: str) -> Path:
        return self.root / sha256

    # --- use --------------------------------------------------------------------------------------

    def acquire(self, record: Any, interp: Interpreter, user: str | None = None) -> Path:
        """The directory of the environment ``record`` (``cfg["pip"]``) asks for, built for
        ``interp`` as ``user`` (None: nymph's own) if it is new; held until :meth:`release`.
        :class:`EnvBuildFailed` when it cannot be built."""
        try:
            record = check_pip(record)
        except ValueError as exc:
            raise EnvBuildFailed(f"pip environment: {exc}") from None
        self._prepare_root()
        try:
            lock_text = self._resolve(record, interp, user)
        except EnvBuildFailed:
            obs.PIP_ENVS.labels(result="failed").inc()
            raise
        sha = hashlib.sha256(f"{interp.tag}\0{lock_text}".encode()).hexdigest()
        with self._lock:
            self._held[sha] = self._held.get(sha, 0) + 1
        try:
            target = self.path_for(sha)
            if not target.is_dir():
                with _flock(self.root / ".locks" / sha):
                    if not target.is_dir():
                        try:
                            self._build(sha, lock_text, interp, user, target)
                        except EnvBuildFailed:
                            obs.PIP_ENVS.labels(result="failed").inc()
                            raise
                        self.prune()
                        return target
            cachedir.touch(target)
            obs.PIP_ENVS.labels(result="hit").inc()
            return target
        except BaseException:
            self.release(sha)
            raise

    def hold(self, sha256: str) -> bool:
        """Hold an environment already built (a re-attached task runs from it); False when absent."""
        if not cachedir.is_sha256(sha256) or not self.path_for(sha256).is_dir():
            return False
        with self._lock:
            self._held[sha256] = self._held.get(sha256, 0) + 1
        return True

    def release(self, sha256: str) -> None:
        with self._lock:
            left = self._held.get(sha256, 0) - 1
            if left > 0:
                self._held[sha256] = left
            else:
                self._held.pop(sha256, None)

    def prune(self, now: float | None = None) -> list[str]:
        with self._lock:
            held = set(self._held)
        return cachedir.prune(
            self.root,
            max_age_s=self.max_age_s,
            max_bytes=self.max_bytes,
            held=held,
            what="pip env cache",
            now=now,
        )

    # --- resolve and build ------------------------------------------------------------------------

    def _prepare_root(self) -> None:
        for sub in ("", ".locks", ".specs"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)  # traversable by task users, not listable
        if not self._swept:  # the uv caches per uid an older nymph kept (see _workspace): unsafe
            self._swept = True
            for old in self.root.glob(".uv-*"):
                cachedir.remove(old)

    def _spec_key(self, record: Mapping[str, Any], interp: Interpreter) -> str:
        doc = [record["format"], record["text"], interp.tag, interp.version, self.index_url, self.find_links]
        return hashlib.sha256(json.dumps(doc).encode()).hexdigest()

    def _resolve(self, record: Mapping[str, Any], interp: Interpreter, user: str | None) -> str:
        """The lock of ``record`` for ``interp``: resolved once per spec key (see the docstring)."""
        if record["format"] == "pylock.toml":
            return str(record["text"])
        key = self._spec_key(record, interp)
        spec = self.root / ".specs" / key
        try:
            return spec.read_text()
        except FileNotFoundError:
            pass
        with _flock(self.root / ".locks" / f"spec-{key}"):
            try:
                return spec.read_text()
            except FileNotFoundError:
                pass
            started = time.monotonic()
            with self._workspace(user) as (work, env):
                (work / "requirements.in").write_text(record["text"])
                self._uv(
                    [
                        "pip",
                        "compile",
                        "requirements.in",
                        "-o",
                        "requirements.txt",
                        "--no-header",
                        "--no-annotate",
                        *interp.uv_args(),
                    ],
                    work,
                    env,
                    user,
                    "resolve",
                )
                # the builder's file, read as root: never through a link it left, never another's
                got = safeio.read_output(work, "requirements.txt")
                if got is None:
                    raise EnvBuildFailed("pip environment: uv's resolve left no requirements.txt of its own")
                text = got.decode("utf-8", errors="replace")
            fd, tmp = tempfile.mkstemp(dir=spec.parent, prefix=".tmp-")
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
            os.chmod(tmp, 0o644)
            os.rename(tmp, spec)
            log.info("pip environment: resolved %s in %.1fs", key[:12], time.monotonic() - started)
            return text

    def _build(self, sha: str, lock_text: str, interp: Interpreter, user: str | None, target: Path) -> None:
        started = time.monotonic()
        staging = Path(tempfile.mkdtemp(prefix=f"{cachedir.STAGING}{sha[:16]}-", dir=self.root))
        try:
            with self._workspace(user) as (work, env):
                name = (
                    "pylock.toml"
                    if lock_text.lstrip().startswith(("lock-version", "["))
                    else "requirements.txt"
                )
                (work / name).write_text(lock_text)
                site = work / "site"
                self._uv(
                    [
                        "pip",
                        "install",
                        "--target",
                        str(site),
                        "-r",
                        name,
                        "--link-mode",
                        "copy",
                        *(["--compile-bytecode"] if interp.python else []),
                        *interp.uv_args(),
                    ],
                    work,
                    env,
                    user,
                    "build",
                )
                if not stat.S_ISDIR(os.lstat(site).st_mode):  # a link the builder left: not followed
                    raise EnvBuildFailed("pip environment: uv's build left no site directory of its own")
                os.rmdir(staging)
                # nymph's own copy (the builder's is removed): links stay links, anything but a
                # file, a directory or a link (a FIFO the build left) is not copied
                shutil.copytree(site, staging, symlinks=True, ignore=_special_files)
            (staging / ENV_MARKER).write_text(f"{interp.tag}\n{lock_text}")
            cachedir.seal(staging)
            os.rename(staging, target)
        except BaseException:
            if staging.exists():
                cachedir.remove(staging)
            raise
        seconds = time.monotonic() - started
        self.builds += 1
        obs.PIP_ENVS.labels(result="built").inc()
        obs.PIP_ENV_BUILD_SECONDS.observe(seconds)
        log.info("pip environment %s built in %.1fs (%s)", sha[:12], seconds, interp.tag)

    @contextlib.contextmanager
    def _workspace(self, user: str | None) -> Iterator[tuple[Path, dict[str, str]]]:
        """A scratch directory owned by ``user`` and the environment uv runs in, its uv cache
        inside it; both removed afterwards. No uv cache is kept between builds: a cache the task
        user owns would be writable by every task that runs as that uid (a pool user serves one
        tenant, then another), and a later build of another tenant would install what one of them
        planted there, sealed into an environment every tenant with that lock imports."""
        uid, gid, home = _ids(user)
        work = Path(tempfile.mkdtemp(prefix=".work-", dir=self.root))
        cache = work / ".uv-cache"
        cache.mkdir(mode=0o700)
        if uid != os.geteuid():
            for path in (cache, work):
                os.chown(path, uid, gid)
        env = dict(host_base())
        # nymph's own network settings (a proxy, a private CA): uv is nymph's tool, not the task's
        env.update({k: v for k, v in os.environ.items() if k in _NETWORK_ENV})
        env.update(
            {
                "HOME": home,
                "UV_CACHE_DIR": str(cache),
                "UV_NO_CONFIG": "1",  # nothing of the user's uv.toml / pip.conf steers a build
                "UV_PYTHON_DOWNLOADS": "never",
                "UV_NO_PROGRESS": "1",
            }
        )
        if self.index_url:
            env["UV_INDEX_URL"] = self.index_url
        if self.find_links:
            env["UV_FIND_LINKS"] = " ".join(self.find_links)
        try:
            yield work, env
        finally:
            cachedir.remove(work)

    def _uv(self, args: list[str], cwd: Path, env: dict[str, str], user: str | None, what: str) -> None:
        uv = self.uv or uv_binary()
        if uv is None:
            raise EnvBuildFailed(
                "pip environment: uv is not installed on this worker; install it beside nymph "
                "(pip install 'dreamlake-lakeshore[pip]') or start nymph without --allow-pip"
            )
        argv = [uv, *args]
        if user is not None and _ids(user)[0] != os.geteuid():
            argv = ["runuser", "-u", user, "--", *argv]
        try:
            out = subprocess.run(
                argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired:
            raise EnvBuildFailed(
                f"pip environment: uv did not {what} it within {BUILD_TIMEOUT_S:.0f}s"
            ) from None
        except OSError as exc:
            raise EnvBuildFailed(f"pip environment: cannot run uv ({exc})") from exc
        if out.returncode != 0:
            message = (out.stderr or out.stdout).strip()[-MESSAGE_TAIL:]
            raise EnvBuildFailed(
                f"pip environment: uv could not {what} it (exit {out.returncode}): {message}"
            )


def _special_files(here: str, names: list[str]) -> set[str]:
    import stat

    out = set()
    for name in names:
        mode = os.lstat(os.path.join(here, name)).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
            out.add(name)
    return out


def _ids(user: str | None) -> tuple[int, int, str]:
    if user is None:
        return os.geteuid(), os.getegid(), os.environ.get("HOME", "/")
    rec = pwd.getpwnam(user)
    return rec.pw_uid, rec.pw_gid, rec.pw_dir


@contextlib.contextmanager
def _flock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created), for threads and processes alike."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


_SHARED: dict[Path, EnvCache] = {}
_SHARED_LOCK = threading.Lock()


def shared(root: Path, **settings: Any) -> EnvCache:
    """The one cache of this process for ``root`` (every job of a nymph shares it)."""
    key = Path(os.path.abspath(root))
    with _SHARED_LOCK:
        cache = _SHARED.get(key)
        if cache is None:
            cache = _SHARED[key] = EnvCache(key, **settings)
        else:
            for name, value in settings.items():
                setattr(cache, name, tuple(value) if name == "find_links" else value)
        return cache
