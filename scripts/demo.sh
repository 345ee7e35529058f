#!/usr/bin/env bash
# The main job: an embedded control plane (SQLite), one nymph with the process runner,
# and a real workload through them, with the results printed.
# Installs only what the demo needs (the server extra: no test tools, no torch).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh server
exec .venv/bin/python examples/demo.py "$@"
