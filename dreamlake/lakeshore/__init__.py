"""dreamlake.lakeshore: run Python functions remotely.

The SDK surface (``udf``, ``SyncQueue``, ``Topic``, ``run_worker``, ``scope``, ``run``, ``Dispatch``,
``HttpDispatch``, ``Invocation``, ``wait``, ``as_completed``) is imported lazily (PEP 562), so that
the runtime modules (``wire``, ``envelope``, ``daemon.entry``) start without pulling in the SDK, an
HTTP client or a database driver. Type checkers and IDEs read the ``TYPE_CHECKING`` imports below
instead: every lazy name resolves to its real type (the package ships ``py.typed``).

Inside a task with a bring-your-own image, the entry bundle carries this package with the SDK's
import-time surface (``udf``, ``UDF``, ``Thunk``, ``scope``, ``run``, ``SyncQueue``, ``Topic``, the
handles, the planes' protocol and ``HttpDispatch``); a name whose module it lacks (``run_worker``)
raises a ``ModuleNotFoundError`` saying to install dreamlake-lakeshore in the image.
"""

from __future__ import annotations

import importlib

from dreamlake.lakeshore.version import __version__ as __version__

TYPE_CHECKING = False  # typing costs start-up time; this package is imported by every invocation
if TYPE_CHECKING:
    from typing import Any

    from dreamlake.lakeshore.decorator import UDF as UDF
    from dreamlake.lakeshore.decorator import Calls as Calls
    from dreamlake.lakeshore.decorator import Thunk as Thunk
    from dreamlake.lakeshore.decorator import run as run
    from dreamlake.lakeshore.decorator import scope as scope
    from dreamlake.lakeshore.decorator import set_default_code as set_default_code
    from dreamlake.lakeshore.decorator import submit_all as submit_all
    from dreamlake.lakeshore.decorator import udf as udf
    from dreamlake.lakeshore.default_dispatch import set_default_dispatch as set_default_dispatch
    from dreamlake.lakeshore.dispatch.http import HttpDispatch as HttpDispatch
    from dreamlake.lakeshore.dispatch.local import Dispatch as Dispatch
    from dreamlake.lakeshore.errors import DispatchError as DispatchError
    from dreamlake.lakeshore.errors import StreamRestarted as StreamRestarted
    from dreamlake.lakeshore.handles import ALL_COMPLETED as ALL_COMPLETED
    from dreamlake.lakeshore.handles import FIRST_COMPLETED as FIRST_COMPLETED
    from dreamlake.lakeshore.handles import FIRST_EXCEPTION as FIRST_EXCEPTION
    from dreamlake.lakeshore.handles import Invocation as Invocation
    from dreamlake.lakeshore.handles import as_completed as as_completed
    from dreamlake.lakeshore.handles import wait as wait
    from dreamlake.lakeshore.queue import SyncQueue as SyncQueue
    from dreamlake.lakeshore.queue import Topic as Topic
    from dreamlake.lakeshore.worker import run_worker as run_worker


_LAZY = {
    "udf": "dreamlake.lakeshore.decorator",
    "UDF": "dreamlake.lakeshore.decorator",
    "Thunk": "dreamlake.lakeshore.decorator",
    "Calls": "dreamlake.lakeshore.decorator",
    "submit_all": "dreamlake.lakeshore.decorator",
    "scope": "dreamlake.lakeshore.decorator",
    "run": "dreamlake.lakeshore.decorator",
    "set_default_code": "dreamlake.lakeshore.decorator",
    "set_default_dispatch": "dreamlake.lakeshore.default_dispatch",
    "Invocation": "dreamlake.lakeshore.handles",
    "wait": "dreamlake.lakeshore.handles",
    "as_completed": "dreamlake.lakeshore.handles",
    "FIRST_COMPLETED": "dreamlake.lakeshore.handles",
    "FIRST_EXCEPTION": "dreamlake.lakeshore.handles",
    "ALL_COMPLETED": "dreamlake.lakeshore.handles",
    "SyncQueue": "dreamlake.lakeshore.queue",
    "Topic": "dreamlake.lakeshore.queue",
    "run_worker": "dreamlake.lakeshore.worker",
    "Dispatch": "dreamlake.lakeshore.dispatch",
    "HttpDispatch": "dreamlake.lakeshore.dispatch",
    "DispatchError": "dreamlake.lakeshore.errors",
    "StreamRestarted": "dreamlake.lakeshore.errors",
    "SendTimeout": "dreamlake.lakeshore.errors",
    "Interrupted": "dreamlake.lakeshore.errors",
    "attempt": "dreamlake.lakeshore.task",
    "checkpoint_dir": "dreamlake.lakeshore.task",
}

__all__ = ["__version__", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dreamlake.lakeshore' has no attribute {name!r}")
    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise  # a dependency of the module: its own import says which (dispatch names the fix)
        from dreamlake.lakeshore.errors import missing_module

        raise missing_module(f"dls.{name}", exc, "dreamlake-lakeshore", "dreamlake-lakeshore") from exc
    value = getattr(loaded, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
