"""Which extra of ``dreamlake-lakeshore`` brings a module, for errors that say how to install it.

``pip install 'dreamlake-lakeshore[server]'`` and friends (pyproject.toml's optional dependencies):
a command that fails on a missing module names the pip command, not only ``No module named 'x'``.
"""

from __future__ import annotations

DIST = "dreamlake-lakeshore"

#: top-level module -> the extra that installs it (pyproject.toml, [project.optional-dependencies])
EXTRA_OF = {
    "starlette": "server",
    "uvicorn": "server",
    "jinja2": "server",
    "psycopg": "server",
    "httptools": "server",
    "uvloop": "server",
    "redis": "server",
    "boto3": "s3",
    "docker": "docker",
    "kubernetes": "kube",
}


def install_hint(missing: str | None) -> str:
    """``pip install 'dreamlake-lakeshore[EXTRA]'`` for a module an extra brings, else
    ``pip install NAME``; empty for no name."""
    if not missing:
        return ""
    top = missing.split(".")[0]
    extra = EXTRA_OF.get(top)
    return f"pip install '{DIST}[{extra}]'" if extra else f"pip install {top}"
