"""Code archives: the user's own code shipped with the call, named in ``Envelope.cfg["code"]``.

``@dls.udf(code=...)`` (or ``dls.scope(code=...)``, or :func:`set_default_code` /
``LAKESHORE_CODE``) says what to ship:

- ``"auto"`` (the default): the local, non-installed top-level package (or single module) the
  function comes from; nothing for a function from the standard library, site-packages (an
  installed distribution) or the SDK itself; for a ``__main__`` function (it travels pickled, by
  value) the local packages its body names (``mylib.g(x)``, a ``g`` imported from ``mylib``),
  which the unpickling worker must import. An editable install
  (``pip install -e``) counts as local: its files are not in site-packages, and the worker may
  not have them;
- a list of paths: each directory (a package) or ``.py`` file is packed under its own name, so
  ``code=["src/mylib", "tools.py"]`` makes ``mylib`` and ``tools`` importable on the worker;
- ``None`` (``LAKESHORE_CODE=none``): nothing, the function's module must be deployed on the worker.

The archive is a deterministic zip: entries sorted, timestamps fixed (1980-01-01), modes fixed,
``__pycache__``, ``.git``, ``*.pyc`` and what the packed root's ``.gitignore`` names dropped
(``pathspec``'s gitignore rules). It is content-addressed by sha256, refused over
``LAKESHORE_CODE_MAX_BYTES`` (default 32 MiB) with what to exclude, and built again only when a
file changed (a stat of every packed file per submit: an edit is picked up by the next call).
Archives up to ``INLINE_THRESHOLD_BYTES`` (seed 003: 256 KiB) travel inline in the
Envelope; larger ones go through the payload store once per content and control plane per
process (:func:`_store_archive`: ``dreamlake.lakeshore.blobs`` through the presign route, kind
``code``). The record (docs/protocol.md "Code archives")::

    {"sha256": "<64 hex>", "size": <archive bytes>, "roots": ["mylib"], "inline": b"PK..."}
    {"sha256": "<64 hex>", "size": <archive bytes>, "roots": ["mylib"],
     "ref": {"bucket", "key", "size", "sha256"}, "namespace": "<the presign route's namespace>"}

Submitter side: the entry never imports it (nymph unpacks, see ``nymph.codecache``), but the entry
bundle carries it (Python >= 3.9, ``pathspec`` optional), so a task's own ``.submit()`` ships its
code to its children.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import stat
import sys
import sysconfig
import threading
import time
import zipfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from dreamlake.lakeshore import envvars
from dreamlake.lakeshore.errors import TransportError

__all__ = [
    "AUTO",
    "CODE_ENV",
    "CODE_MAX_BYTES",
    "code_record",
    "local_root",
    "normalize_code",
    "pack",
]

AUTO = "auto"
CODE_ENV = "LAKESHORE_CODE"  # auto | none: the process default when neither udf nor scope says
MAX_ENV = "LAKESHORE_CODE_MAX_BYTES"
THRESHOLD_ENV = "INLINE_THRESHOLD_BYTES"  # envvars.py (LAKESHORE_INLINE_THRESHOLD_BYTES: deprecated)
CODE_MAX_BYTES = 32 * 1024 * 1024
STORED_FOR_S = 24 * 3600.0  # a stored archive is uploaded again after this (the store prunes old blobs)
FIXED_TIME = (1980, 1, 1, 0, 0, 0)  # the zip epoch: the same bytes whenever the files are the same
ALWAYS_DROPPED = ("__pycache__", ".git", ".hg", ".svn", ".mypy_cache", ".pytest_cache", ".ruff_cache")
DROPPED_SUFFIXES = (".pyc", ".pyo")
# Never shipped by "auto": the worker's runtime (the entry bundle) brings its own copy.
RUNTIME_PACKAGES = frozenset(("dreamlake", "nymph"))


def normalize_code(code: object) -> str | tuple[str, ...] | None:
    """``"auto"``, ``None`` or a tuple of paths (absolute, checked later); TypeError / ValueError otherwise."""
    if code is None or code == AUTO:
        return code
    if isinstance(code, (str, os.PathLike)):
        raise TypeError(f"code={code!r}: pass 'auto', None, or a list of paths like ['src/mylib']")
    if not isinstance(code, Iterable):
        raise TypeError(f"code must be 'auto', None or a list of paths, got {type(code).__name__}")
    paths = tuple(os.path.abspath(os.fspath(p)) for p in code)
    if not paths:
        raise ValueError("code=[] ships nothing: pass code=None for that, or list the paths to ship")
    return paths


def default_code() -> str | None:
    """The process default: :func:`set_default_code`, else ``LAKESHORE_CODE`` (auto | none), else auto."""
    if _default is not _UNSET:
        return _default  # type: ignore[return-value]
    raw = (envvars.string(CODE_ENV) or AUTO).lower()
    if raw == AUTO:
        return AUTO
    if raw in ("none", "off", "0", "false"):
        return None
    raise ValueError(f"{CODE_ENV}={raw!r}: use 'auto' or 'none'")


_UNSET = object()
_default: object = _UNSET


def set_default_code(code: object = _UNSET) -> None:
    """Set the process default (``"auto"`` or ``None``; a list of paths too); no argument: back to the env."""
    global _default
    _default = _UNSET if code is _UNSET else normalize_code(code)


@functools.lru_cache(maxsize=1)
def _installed_dirs() -> tuple[str, ...]:
    """Directories whose modules come from an installation: the standard library and every site dir."""
    import site

    dirs = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    try:
        dirs.update(site.getsitepackages())
    except AttributeError:  # a virtualenv's old site.py
        pass
    user = site.getusersitepackages() if hasattr(site, "getusersitepackages") else None
    dirs.add(user)
    return tuple(os.path.realpath(d) + os.sep for d in dirs if d)


def local_root(module: str) -> Path | None:
    """The directory (package) or file (module) ``"auto"`` packs for ``module``; None: ship nothing."""
    top = module.partition(".")[0]
    loaded = sys.modules.get(top)
    key = (top, getattr(loaded, "__file__", None), tuple(getattr(loaded, "__path__", None) or ()))
    known = _ROOTS.get(key, _UNSET)
    if known is _UNSET:
        known = _ROOTS[key] = _local_root(top)
    return known  # type: ignore[return-value]


_ROOTS: dict[tuple[Any, ...], object] = {}  # where each loaded top-level package lives: fixed once imported


def _local_root(top: str) -> Path | None:
    if top == "__main__" or top in RUNTIME_PACKAGES or top in sys.builtin_module_names:
        return None
    if top in getattr(sys, "stdlib_module_names", ()):
        return None
    loaded = sys.modules.get(top)
    if loaded is None:
        return None
    paths = list(getattr(loaded, "__path__", None) or [])
    file = getattr(loaded, "__file__", None)
    if paths:
        if len(paths) != 1:
            return None  # a namespace package spread over several directories: name them in code=[...]
        root = os.path.realpath(paths[0])
    elif file and file.endswith(".py"):
        root = os.path.realpath(file)
    else:
        return None  # an extension module or a frozen one: installed, not packable source
    if any((root + os.sep).startswith(d) for d in _installed_dirs()):
        return None
    return Path(root)


def _roots(fn: Callable[..., Any], code: str | tuple[str, ...] | None) -> list[Path]:
    if code is None:
        return []
    if code == AUTO:
        from dreamlake.lakeshore.envelope import _underlying

        target = _underlying(fn)
        module = str(getattr(target, "__module__", None) or "__main__")
        if module == "__main__":  # pickled by value: ship the local packages its body refers to
            return _used_roots(target)
        root = local_root(module)
        return [root] if root is not None else []
    roots = []
    for raw in code:
        path = Path(raw)
        if path.is_dir() or (path.is_file() and path.suffix == ".py"):
            roots.append(path)
        else:
            raise TransportError(
                f"code path {raw!r} is neither a directory (a package) nor a .py file: "
                "list the package directories or module files to ship"
            )
    names = [p.name for p in roots]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise TransportError(f"code paths share the name {dupes[0]!r}: each is shipped under its own name")
    return roots


def _used_roots(fn: Any) -> list[Path]:
    """The local packages a ``__main__`` function's body names (``mylib.g(x)``, ``g`` imported from
    ``mylib``): cloudpickle pickles them by reference, so the worker must be able to import them."""
    code = getattr(fn, "__code__", None)
    scope = getattr(fn, "__globals__", None)
    if code is None or not isinstance(scope, dict):
        return []
    names: set[str] = set()
    stack = [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if type(k) is type(code))
    roots: dict[str, Path] = {}
    for name in sorted(names):
        value = scope.get(name)
        if value is None:
            continue
        owner = value.__name__ if type(value).__name__ == "module" else getattr(value, "__module__", None)
        if not isinstance(owner, str) or owner == "__main__":
            continue
        root = local_root(owner)
        if root is not None:
            roots.setdefault(str(root), root)
    return [roots[k] for k in sorted(roots)]


def _ignore_spec(root: Path) -> Any:
    """The root's ``.gitignore`` as a pathspec matcher, or None."""
    ignore = root / ".gitignore"
    if not root.is_dir() or not ignore.is_file():
        return None
    lines = ignore.read_text(encoding="utf-8", errors="replace").splitlines()
    try:
        import pathspec
    except ImportError:  # inside a task whose image lacks it (the entry bundle): the plain patterns
        return _PlainIgnore(lines)
    return pathspec.GitIgnoreSpec.from_lines(lines)


class _PlainIgnore:
    """``.gitignore`` without pathspec: plain fnmatch patterns (no negation), by name or path."""

    def __init__(self, lines: list[str]) -> None:
        self.patterns = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith(("#", "!"))]

    def match_file(self, rel: str) -> bool:
        from fnmatch import fnmatchcase

        path = rel.rstrip("/")
        name = path.rpartition("/")[2]
        for pattern in self.patterns:
            if pattern.endswith("/") and not rel.endswith("/"):
                continue
            pat = pattern.strip("/")
            if fnmatchcase(path, pat) or ("/" not in pat and fnmatchcase(name, pat)):
                return True
        return False


def _files(root: Path) -> list[tuple[str, str, os.stat_result]]:
    """``(archive name, source path, stat)`` of every file under ``root`` that ships, sorted by name.

    One ``os.scandir`` pass, one stat per file (a submit pays this walk to notice an edit)."""
    top = str(root)
    if not os.path.isdir(top):
        return [(root.name, top, os.stat(top))]
    spec = _ignore_spec(root)
    out: list[tuple[str, str, os.stat_result]] = []
    pending = [(top, root.name + "/", "")]
    while pending:
        here, prefix, rel_dir = pending.pop()
        with os.scandir(here) as it:
            entries = list(it)
        for entry in entries:
            name = entry.name
            rel = rel_dir + name
            if entry.is_dir(follow_symlinks=False):  # links to directories are not followed
                if name in ALWAYS_DROPPED or (spec is not None and spec.match_file(rel + "/")):
                    continue
                pending.append((entry.path, prefix + name + "/", rel + "/"))
                continue
            if name.endswith(DROPPED_SUFFIXES) or (spec is not None and spec.match_file(rel)):
                continue
            try:
                st = entry.stat()  # a link to a file ships its content; a dangling one nothing
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                out.append((prefix + name, entry.path, st))
    out.sort(key=lambda e: e[0])
    return out


def _limit() -> int:
    return envvars.integer(MAX_ENV, default=CODE_MAX_BYTES)


def _threshold() -> int:
    from dreamlake.lakeshore.protocol.limits import inline_threshold_from_env

    return inline_threshold_from_env()


def _too_big(roots: Sequence[Path], size: int, limit: int) -> TransportError:
    names = ", ".join(str(r) for r in roots)
    return TransportError(
        f"code archive of {names} is over the {limit}-byte cap ({size} bytes so far): list data, "
        "build outputs and virtualenvs in the package's .gitignore, pass code=[...] with just the "
        f"code's directories, ship nothing with code=None, or raise {MAX_ENV}"
    )


def pack(roots: Sequence[Path], limit: int | None = None) -> bytes:
    """The deterministic zip of ``roots`` (see the module docstring); TransportError over ``limit``."""
    limit = _limit() if limit is None else limit
    buf = io.BytesIO()
    raw = 0
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
        entries = sorted((e for root in roots for e in _files(root)), key=lambda e: e[0])
        for name, path, _ in entries:
            with open(path, "rb") as f:
                data = f.read()
            raw += len(data)
            if raw > 4 * limit:  # stop reading early on a directory of data
                raise _too_big(roots, raw, limit)
            info = zipfile.ZipInfo(name, date_time=FIXED_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = (stat.S_IFREG | 0o644) << 16
            info.create_system = 3  # unix, whatever platform packed it
            zf.writestr(info, data)
            if buf.tell() > limit:
                raise _too_big(roots, buf.tell(), limit)
    data = buf.getvalue()
    if len(data) > limit:
        raise _too_big(roots, len(data), limit)
    return data


def _fingerprint(roots: Sequence[Path]) -> tuple[Any, ...]:
    """What decides whether the archive must be built again: every shipped file's name, size, mtime."""
    return tuple(
        (name, st.st_size, st.st_mtime_ns, st.st_ino) for root in roots for name, _, st in _files(root)
    )


class _Shipped:
    """This process's archives: the last one built per set of roots, and the refs already stored."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.built: dict[tuple[str, ...], tuple[tuple[Any, ...], bytes, str]] = {}
        # (sha256, control plane) -> (when, {ref, namespace}): uploaded once per content and plane
        self.stored: dict[tuple[str, Any], tuple[float, dict[str, Any]]] = {}


_SHIPPED = _Shipped()


def code_record(
    fn: Callable[..., Any], code: str | tuple[str, ...] | None, plane: Any = None
) -> dict[str, Any] | None:
    """The ``cfg["code"]`` record for calling ``fn`` with ``code``; None when nothing ships."""
    roots = _roots(fn, code)
    if not roots:
        return None
    key = tuple(str(r) for r in roots)
    fingerprint = _fingerprint(roots)
    with _SHIPPED.lock:
        known = _SHIPPED.built.get(key)
    if known is not None and known[0] == fingerprint:
        _, data, digest = known
    else:
        data = pack(roots)
        digest = hashlib.sha256(data).hexdigest()
        with _SHIPPED.lock:
            _SHIPPED.built[key] = (fingerprint, data, digest)
    record: dict[str, Any] = {"sha256": digest, "size": len(data), "roots": [r.name for r in roots]}
    from dreamlake.lakeshore.protocol.limits import by_reference

    if not by_reference(len(data), _threshold()):
        record["inline"] = data
        return record
    client = plane.payload_client() if plane is not None else None
    where = (digest, client.url if client is not None else None)  # per control plane
    with _SHIPPED.lock:
        known_ref = _SHIPPED.stored.get(where)
    if known_ref is None or time.monotonic() - known_ref[0] > STORED_FOR_S:
        known_ref = (time.monotonic(), _store_archive(data, digest, plane))
        with _SHIPPED.lock:
            _SHIPPED.stored[where] = known_ref
    record.update(known_ref[1])
    return record


def _store_archive(data: bytes, digest: str, plane: Any) -> dict[str, Any]:
    """Upload an archive over the inline threshold through the payload store (the presign route of
    the namespace the plane's token acts in, kind ``code``); the record's ``ref`` and ``namespace``."""
    from dreamlake.lakeshore.client import PlaneClient

    client = plane.payload_client() if plane is not None else None
    if not isinstance(client, PlaneClient):
        raise TransportError(
            f"code archive is {len(data)} bytes, over the {_threshold()}-byte inline threshold, and "
            f"{type(plane).__name__ if plane is not None else 'no plane'} has no payload store to ship "
            "it through: submit through an HttpDispatch (a control plane), ship less code (a "
            f".gitignore, code=[...]) or raise {THRESHOLD_ENV}"
        )
    try:
        from dreamlake.lakeshore import blobs
    except ModuleNotFoundError as exc:  # inside a task whose image has only the entry bundle
        raise TransportError(
            f"code archive is {len(data)} bytes, over the {_threshold()}-byte inline threshold, and "
            f"the payload store client cannot load here ({exc}): install dreamlake-lakeshore in the "
            "image, or ship less code (code=[...])"
        ) from exc
    namespace = _namespace(client)
    ref = blobs.put(client, namespace, memoryview(data), job_id=digest, kind="code")
    return {"ref": ref, "namespace": namespace}


def _namespace(client: Any) -> str:
    """The namespace the client's token acts in (``GET /v1/ops/whoami``; unbound: ``default``)."""
    known = _NAMESPACES.get(id(client))
    if known is not None and known[0] is client:
        return known[1]
    from dreamlake.lakeshore.protocol.routes import WHOAMI

    who = client.request("GET", WHOAMI, as_json=True)
    namespace = str((who or {}).get("namespace") or "default")
    _NAMESPACES[id(client)] = (client, namespace)
    return namespace


_NAMESPACES: dict[int, tuple[Any, str]] = {}
