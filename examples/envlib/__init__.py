"""The function of examples/07_environments.py: it needs a package the worker does not have
(``pyfiglet``, built into a pip environment by nymph), a secret and an environment variable."""

from __future__ import annotations

import os

import dreamlake.lakeshore as dls


@dls.udf(queue="envs", pip=["pyfiglet==1.0.2"], secrets=["DEMO_API_KEY"], env={"GREETING": "hello"})
def banner(name: str) -> dict[str, object]:
    import pyfiglet  # not installed on the worker: from the call's pip environment

    key = os.environ["DEMO_API_KEY"]  # the namespace's secret, in the environment only
    return {
        "art": pyfiglet.figlet_format(f"{os.environ['GREETING']} {name}", font="small"),
        "key_length": len(key),  # never return a secret: results are stored
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "pyfiglet_from": pyfiglet.__file__,
    }
