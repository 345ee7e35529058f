#!/usr/bin/env bash
# The whole gate: lint, format check, type check, and the test suite.
# Real services (PostgreSQL, Redis, S3, Docker/gVisor) are used when present; set
# LAKESHORE_REQUIRE_SERVICES=1 (CI does) to make a missing service a failure instead of a skip.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh all,test
. .venv/bin/activate
echo "== ruff check"; ruff check .
echo "== ruff format --check"; ruff format --check .
echo "== mypy"; mypy
echo "== pytest"; exec python -m pytest "$@"
