"""Build the self-contained entry bundle: ``python entry/build.py [OUT]``.

Writes ``entry/build/lakeshore-entry.zip`` by default. The logic lives in
:mod:`dreamlake.lakeshore.daemon.bundle` so that nymph runners can build (and cache) the same bundle.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dreamlake.lakeshore.daemon.bundle import BUNDLE_NAME, build_bundle

DEFAULT_OUT = Path(__file__).resolve().parent / "build" / BUNDLE_NAME


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the lakeshore entry bundle (a zip for PYTHONPATH).")
    parser.add_argument(
        "out", nargs="?", default=str(DEFAULT_OUT), help=f"output path (default {DEFAULT_OUT})"
    )
    parser.add_argument(
        "--no-bytecode",
        action="store_true",
        help="leave out the .pyc files compiled for this interpreter (sources only)",
    )
    ns = parser.parse_args(argv)
    path = build_bundle(ns.out, precompile=not ns.no_bytecode)
    print(f"{path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
