#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv and install the project into it.
# Usage: scripts/setup.sh [EXTRAS]   (default extras: all,test)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-all,test}"
# Resolve the real interpreter: a pyenv shim costs ~100 ms per start and hides which python runs.
py="${PYTHON:-$(command -v python3)}"
if command -v pyenv >/dev/null 2>&1 && [ "$(dirname "$py")" = "$(pyenv root 2>/dev/null)/shims" ]; then
  py="$(pyenv which python3)"
fi
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
stamp=".venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)-${extras//,/_}"
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q -e ".[${extras}]"
  rm -f .venv/.installed-*
  touch "$stamp"
fi
