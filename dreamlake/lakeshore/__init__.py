"""dreamlake.lakeshore: run Python functions remotely.

The SDK surface (``udf``, ``SyncQueue``, ``Topic``, ``run_worker``, ``scope``, ``run``, ``Dispatch``,
``HttpDispatch``) is imported lazily, so that the runtime modules (``wire``, ``envelope``,
``daemon.entry``) start without pulling in the SDK, an HTTP client or a database driver.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # typing costs start-up time; this package is imported by every invocation
if TYPE_CHECKING:
    from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "udf": "dreamlake.lakeshore.decorator",
    "UDF": "dreamlake.lakeshore.decorator",
    "Thunk": "dreamlake.lakeshore.decorator",
    "scope": "dreamlake.lakeshore.decorator",
    "run": "dreamlake.lakeshore.decorator",
    "set_default_dispatch": "dreamlake.lakeshore.decorator",
    "SyncQueue": "dreamlake.lakeshore.queue",
    "Topic": "dreamlake.lakeshore.queue",
    "run_worker": "dreamlake.lakeshore.worker",
    "Dispatch": "dreamlake.lakeshore.dispatch",
    "HttpDispatch": "dreamlake.lakeshore.dispatch",
    "DispatchError": "dreamlake.lakeshore.errors",
}

__all__ = ["__version__", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dreamlake.lakeshore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
