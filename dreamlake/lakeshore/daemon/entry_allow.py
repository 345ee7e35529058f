"""The entry's module allow-list: nymph's ``--allow-module`` patterns, as the entry applies them.

``LAKESHORE_ALLOW_MODULES`` (nymph's ``--allow-module`` patterns, comma separated): when set, a
``ref`` function is refused (exit 2, ``ModuleRefused``) unless its module matches
(:func:`module_allowed`), checked before the module is imported, and again on the callable it
resolved to (its ``__module__``), so ``allowed_module:os.system`` does not reach ``os``. nymph's
own gates (:mod:`nymph.gates`) use the same matching.

Part of the entry bundle, like :mod:`dreamlake.lakeshore.daemon.entry`: importable on Python
3.9, no ``typing`` at runtime.
"""

from __future__ import annotations

import sys

from dreamlake.lakeshore import envvars

TYPE_CHECKING = False  # no typing at runtime: start-up is what a noop invocation costs
if TYPE_CHECKING:
    from typing import Iterable, List

ALLOW_MODULES_ENV = "LAKESHORE_ALLOW_MODULES"
ALLOW_MODULE_FLAG = "--allow-module"
# Never matched by a wildcard when Python < 3.10 has no sys.stdlib_module_names (with it, every
# standard-library module is kept from wildcards).
_STDLIB_FALLBACK = frozenset(
    [
        "builtins",
        "os",
        "posix",
        "nt",
        "subprocess",
        "sys",
        "shutil",
        "importlib",
        "runpy",
        "pty",
        "ctypes",
        "code",
        "codeop",
        "pickle",
        "marshal",
        "socket",
        "multiprocessing",
        "signal",
        "tempfile",
        "io",
        "pathlib",
        "platform",
        "asyncio",
        "webbrowser",
        "threading",
    ]
)


class ModuleRefused(Exception):
    """The function's module is not one the worker allows (``--allow-module``)."""


def module_allowed(module: str, patterns: Iterable[str]) -> bool:
    """Whether ``module`` matches one of the fnmatch ``patterns`` (case-sensitive, whole name).

    ``mypkg.*`` matches ``mypkg``'s submodules, ``mypkg`` the module itself. A pattern with a
    wildcard never matches a standard-library module (``builtins``, ``subprocess``, ``os``...): such
    a module is allowed only by a pattern that names it exactly.
    """
    from fnmatch import fnmatchcase

    top = module.partition(".")[0]
    stdlib = getattr(sys, "stdlib_module_names", None) or _STDLIB_FALLBACK | set(sys.builtin_module_names)
    for pattern in patterns:
        if pattern == module:
            return True
        if top not in stdlib and fnmatchcase(module, pattern):
            return True
    return False


def allow_modules_from_env() -> List[str]:
    """The ``LAKESHORE_ALLOW_MODULES`` patterns; empty: every module is allowed."""
    raw = envvars.string(ALLOW_MODULES_ENV) or ""
    return [p.strip() for p in raw.split(",") if p.strip()]


def module_refusal(module: str, qualname: str, patterns: List[str]) -> str:
    return (
        f"function {module}:{qualname} refused: this worker runs only functions of modules matching "
        f"{ALLOW_MODULE_FLAG} {' / '.join(patterns)}; deploy the function in an allowed module, or "
        f"start nymph with {ALLOW_MODULE_FLAG} matching {module!r}"
    )


def _check_module(module: str, qualname: str, patterns: List[str]) -> None:
    if not module_allowed(module, patterns):
        raise ModuleRefused(module_refusal(module, qualname, patterns))
