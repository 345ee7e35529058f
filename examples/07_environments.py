"""Issue 33: each function brings its environment: packages, a secret, environment variables.

``envlib.banner`` asks for ``pip=["pyfiglet==1.0.2"]`` (absent from the worker), the secret
``DEMO_API_KEY`` and ``env={"GREETING": "hello"}``; one call also sets ``_env=`` of its own. nymph
(started with ``--allow-pip``) builds the pip environment once with ``uv`` (as the task user,
sealed read-only, keyed by the sha256 of the resolved lock), the second call reuses it; the secret
is sealed in the control plane and reaches the task's environment only. The task sees none of
nymph's own variables (``DEMO_NYMPH_ONLY`` below), only the documented base and what was asked.

Starts ``lakeshore server`` (embedded SQLite) and one nymph as real processes on loopback (the
first call downloads pyfiglet from PyPI; ``--pip-find-links DIR`` on nymph serves wheels from a
directory instead), and tears them down at the end::

    python examples/07_environments.py
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # as `python 07_environments.py` from examples/

from envlib import banner

import dreamlake.lakeshore as dls
from dreamlake.lakeshore.devstack import LocalStack
from dreamlake.lakeshore.ops_client import OpsClient


def main() -> None:
    os.environ["DEMO_NYMPH_ONLY"] = "a variable of nymph's that no task sees"
    with LocalStack(queues=["envs"], quiet=True, nymph_args=["--allow-pip"]) as stack:
        with OpsClient(stack.url, stack.tokens["admin"]) as ops:
            ops.secret_set("default", "DEMO_API_KEY", "not-a-real-key-42")
        plane = stack.plane()
        q = dls.SyncQueue("envs", dispatch=plane)
        for label, extra in (("first call (builds)", {}), ("second call (cached)", {"OMP_NUM_THREADS": "4"})):
            started = time.monotonic()
            out = q.result(banner.submit("lakeshore", _dispatch=plane, _env=extra), timeout=300)
            print(f"{label}: {time.monotonic() - started:.2f} s, OMP_NUM_THREADS={out['threads']}")
        print(out["art"])
        print("secret length seen by the task:", out["key_length"])
        print("pyfiglet came from nymph's env cache:", ".envs" in Path(str(out["pyfiglet_from"])).parts)


if __name__ == "__main__":
    main()
