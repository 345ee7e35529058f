"""The entry bundle: one zip that lets a bare ``python3`` run ``-m dreamlake.lakeshore.daemon.entry``.

Runners put it on ``PYTHONPATH`` (mounted into a container, shipped to a node). It carries the
runtime part of dreamlake.lakeshore (ids, errors, wire, envelope, daemon.entry), the SDK's
import-time surface (:data:`SDK_FILES`: ``@dls.udf``, ``dls.scope``, ``dls.run``, ``Thunk``,
``SyncQueue`` / ``Topic``, the settings and ``HttpDispatch`` with its client), msgpack's pure-Python
files (msgpack falls back to ``msgpack.fallback`` when ``_cmsgpack`` is missing) and cloudpickle's,
so an interpreter >= 3.9 with nothing installed can import a user's ``import dreamlake.lakeshore as
dls`` module and run an invocation. What the bundle does not carry is imported only when used: the
HTTP client's httpx and tenacity (a task that submits needs them in its image, and is told so),
the in-process plane and worker, the store and the server.

Precedence: ``PYTHONPATH`` entries come before site-packages, so when the runtime also has
dreamlake-lakeshore installed the bundle's modules win; the bundle is what nymph controls. The
bundled ``dreamlake``, ``dreamlake.lakeshore`` and ``dreamlake.lakeshore.dispatch`` packages extend
their ``__path__`` with the same packages found further down ``sys.path`` (plain directories), so
a module the bundle lacks (``dreamlake.lakeshore.worker``, the store) still comes from an
installed copy when the runtime has one.

Bytecode: the zip holds ``.pyc`` files compiled by the building interpreter (unchecked hash-based,
so zip timestamps never matter); any other Python version compiles the sources on each start.

:func:`build_bundle` writes a bundle; :func:`bundle_path` returns a cached one whose file name
carries a digest of its contents, so a changed source gives a new path.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import logging
import os
import py_compile
import sys
import tempfile
import zipfile
from pathlib import Path

from dreamlake import lakeshore

log = logging.getLogger(__name__)

BUNDLE_NAME = "lakeshore-entry.zip"
MANIFEST_NAME = "lakeshore-entry-manifest.json"

#: The runtime part of dreamlake.lakeshore, relative to the directory that holds ``dreamlake/``.
RUNTIME_FILES = (
    "dreamlake/__init__.py",
    "dreamlake/lakeshore/__init__.py",
    "dreamlake/lakeshore/version.py",
    "dreamlake/lakeshore/ids.py",
    "dreamlake/lakeshore/errors.py",
    "dreamlake/lakeshore/wire/__init__.py",
    "dreamlake/lakeshore/wire/base.py",
    "dreamlake/lakeshore/wire/codec.py",
    "dreamlake/lakeshore/wire/stdtypes.py",
    "dreamlake/lakeshore/wire/arrays.py",
    "dreamlake/lakeshore/wire/frames.py",
    "dreamlake/lakeshore/envelope.py",
    "dreamlake/lakeshore/envvars.py",  # every setting the entry and the SDK read
    "dreamlake/lakeshore/envelope_reader.py",
    "dreamlake/lakeshore/fn_record.py",
    "dreamlake/lakeshore/fn_transport.py",
    "dreamlake/lakeshore/fn_gates.py",
    "dreamlake/lakeshore/twoway.py",
    "dreamlake/lakeshore/daemon/__init__.py",
    "dreamlake/lakeshore/daemon/entry.py",
    "dreamlake/lakeshore/daemon/entry_allow.py",
    "dreamlake/lakeshore/daemon/entry_capture.py",
    "dreamlake/lakeshore/daemon/entry_interrupts.py",
    "dreamlake/lakeshore/daemon/entry_outputs.py",
    "dreamlake/lakeshore/daemon/entry_streams.py",
)
#: What a user's module touches when it imports the SDK, and what a task needs to submit tasks
#: (the HTTP plane; its httpx and tenacity come from the image, imported on first use).
SDK_FILES = (
    "dreamlake/lakeshore/decorator.py",
    "dreamlake/lakeshore/scopes.py",
    "dreamlake/lakeshore/calls.py",
    "dreamlake/lakeshore/labels.py",  # calls.py's selector check
    "dreamlake/lakeshore/default_dispatch.py",
    "dreamlake/lakeshore/runenv.py",
    "dreamlake/lakeshore/handles.py",
    "dreamlake/lakeshore/codeship.py",
    "dreamlake/lakeshore/queue.py",
    "dreamlake/lakeshore/settings.py",
    "dreamlake/lakeshore/states.py",
    "dreamlake/lakeshore/task.py",
    "dreamlake/lakeshore/client.py",
    "dreamlake/lakeshore/tls.py",  # client.py's TLS context (LAKESHORE_CA_FILE inside a task)
    "dreamlake/lakeshore/blobs.py",
    "dreamlake/lakeshore/keepalive.py",
    "dreamlake/lakeshore/dispatch/__init__.py",
    "dreamlake/lakeshore/dispatch/http.py",
    "dreamlake/lakeshore/dispatch/http_worker.py",
    "dreamlake/lakeshore/protocol/__init__.py",
    "dreamlake/lakeshore/protocol/routes.py",
    "dreamlake/lakeshore/protocol/limits.py",
    "dreamlake/lakeshore/protocol/shapes.py",
    "dreamlake/lakeshore/protocol/daemon.py",
    "dreamlake/lakeshore/protocol/producer.py",
    "dreamlake/lakeshore/protocol/beats.py",
    "dreamlake/lakeshore/dispatch/batching.py",
)
BUNDLED_FILES = RUNTIME_FILES + SDK_FILES
MSGPACK_FILES = ("__init__.py", "exceptions.py", "ext.py", "fallback.py")

# Appended to the bundled package __init__ files: let installed copies supply modules the bundle lacks.
_EXTEND_PATH = """

# Added by the lakeshore entry bundle: modules the bundle lacks (the worker, the store) come from the
# same package in a plain directory further down sys.path, when there is one.
def _lakeshore_extend_path(path, name):
    import os as _os
    import sys as _sys

    extended = list(path)
    for entry in _sys.path:
        if isinstance(entry, str) and entry:
            candidate = _os.path.join(entry, *name.split("."))
            if candidate not in extended and _os.path.isfile(_os.path.join(candidate, "__init__.py")):
                extended.append(candidate)
    return extended


__path__ = _lakeshore_extend_path(__path__, __name__)
del _lakeshore_extend_path
"""
_EXTENDED = (
    "dreamlake/__init__.py",
    "dreamlake/lakeshore/__init__.py",
    "dreamlake/lakeshore/dispatch/__init__.py",
)
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed; install it to build the entry bundle")
    return Path(next(iter(spec.submodule_search_locations)))


def _license(dist: str) -> bytes | None:
    from importlib import metadata

    try:
        files = metadata.files(dist) or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name.upper().startswith(("LICENSE", "COPYING")):
            try:
                return Path(f.locate()).read_bytes()
            except OSError:
                continue
    return None


def _sources() -> dict[str, bytes]:
    """Archive name -> source bytes for everything the bundle carries (no compiled extensions)."""
    root = Path(lakeshore.__file__).resolve().parent.parent.parent
    out: dict[str, bytes] = {}
    for rel in BUNDLED_FILES:
        data = (root / rel).read_bytes()
        if rel in _EXTENDED:
            data = data.rstrip(b"\n") + b"\n" + _EXTEND_PATH.encode()
        out[rel] = data
    msgpack_dir = _package_dir("msgpack")
    for name in MSGPACK_FILES:
        out[f"msgpack/{name}"] = (msgpack_dir / name).read_bytes()
    cloudpickle_dir = _package_dir("cloudpickle")
    for path in sorted(cloudpickle_dir.glob("*.py")):
        out[f"cloudpickle/{path.name}"] = path.read_bytes()
    for dist in ("msgpack", "cloudpickle"):
        text = _license(dist)
        if text is not None:
            out[f"licenses/{dist}-LICENSE"] = text
    return out


def _digest(sources: dict[str, bytes]) -> str:
    h = hashlib.sha256(sys.implementation.cache_tag.encode() if sys.implementation.cache_tag else b"")
    for name in sorted(sources):
        h.update(name.encode() + b"\0" + hashlib.sha256(sources[name]).digest())
    return h.hexdigest()


def _pyc(name: str, source: bytes) -> bytes:
    """Unchecked hash-based bytecode of ``source`` for this interpreter."""
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "m.py", Path(tmp) / "m.pyc"
        src.write_bytes(source)
        py_compile.compile(
            str(src),
            cfile=str(dst),
            dfile=name,
            doraise=True,
            invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
        )
        return dst.read_bytes()


def _zip_bytes(sources: dict[str, bytes], digest: str, *, precompile: bool) -> bytes:
    from importlib.metadata import version

    manifest = {
        "dreamlake-lakeshore": lakeshore.__version__,
        "msgpack": version("msgpack"),
        "cloudpickle": version("cloudpickle"),
        "digest": digest,
        "bytecode_for": sys.implementation.cache_tag if precompile else None,
        "files": sorted(sources),
    }
    entries = dict(sources)
    entries[MANIFEST_NAME] = json.dumps(manifest, indent=2, sort_keys=True).encode()
    if precompile:
        for name, source in sources.items():
            if name.endswith(".py"):
                entries[name + "c"] = _pyc(name, source)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name in sorted(entries):
            info = zipfile.ZipInfo(name, date_time=_FIXED_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, entries[name])
    return buf.getvalue()


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_bundle(out_path: str | os.PathLike[str], *, precompile: bool = True) -> Path:
    """Write the entry bundle to ``out_path`` (atomically) and return its path."""
    out = Path(out_path)
    sources = _sources()
    _write_atomic(out, _zip_bytes(sources, _digest(sources), precompile=precompile))
    log.info("built entry bundle %s (%d files)", out, len(sources))
    return out


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/lakeshore`` (``~/.cache/lakeshore`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lakeshore"


def bundle_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """A built bundle for the current sources, cached as ``lakeshore-entry-<digest>.zip`` in ``cache_dir``."""
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    sources = _sources()
    digest = _digest(sources)
    path = directory / f"lakeshore-entry-{digest[:16]}.zip"
    if not path.is_file():
        _write_atomic(path, _zip_bytes(sources, digest, precompile=True))
        log.info("built entry bundle %s", path)
    return path
