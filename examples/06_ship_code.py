"""Issue 13: a function from your own local package runs on a worker that has never seen it.

``shiplib/`` sits next to this script and is installed nowhere. ``@dls.udf`` ships it with the
call: the SDK zips the package the function comes from (deterministic, content-addressed, ``.git``
and ``__pycache__`` left out), nymph fetches each archive once into its code cache and puts it
first on the task's import path. Edit ``shiplib/fmt.py`` and run this again: the new code runs,
nothing restarted and nothing deployed. (``code=None`` on the udf, or ``LAKESHORE_CODE=none``,
ships nothing: the worker must then have the code installed.)

Starts ``lakeshore server`` (embedded SQLite) and one nymph whose ``PYTHONPATH`` does not hold
``examples/``, as real processes on loopback, and tears them down at the end::

    python examples/06_ship_code.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # as `python 06_ship_code.py` from examples/

from shiplib import stats

import dreamlake.lakeshore as dls
from dreamlake.lakeshore.devstack import LocalStack


def main() -> None:
    with LocalStack(queues=["ship"], quiet=True) as stack:
        plane = stack.plane()
        q = dls.SyncQueue("ship", dispatch=plane)
        inv = stats.summarize.submit([1.0, 2.5, 4.0], _dispatch=plane)
        out = q.result(inv, timeout=60)
        print(out["summary"])
        print("ran from nymph's code cache:", ".code" in Path(out["ran_from"]).parts)


if __name__ == "__main__":
    main()
