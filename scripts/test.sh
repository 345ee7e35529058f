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
# pytest in parallel (pytest-xdist): LAKESHORE_TEST_WORKERS processes (default 4: most tests wait on
# processes, sockets and leases rather than the CPU, so more workers than the CI machine's 2 cores pay
# off), each given whole files (--dist loadfile: module fixtures are set up once, a file's tests keep
# their order), the files of slow tests first (tests/conftest.py). Arguments win over these:
# `bash scripts/test.sh -n 0 tests/unit` runs serially; `python -m pytest tests/unit/test_x.py` by hand
# stays serial too.
workers="${LAKESHORE_TEST_WORKERS:-4}"
echo "== pytest ($workers workers)"
# Every process the suite starts inherits this id; scripts/leftovers.py then fails the run, listing
# them, when any outlived pytest (a fixture that did not kill what it started).
LAKESHORE_SUITE_RUN="$(python -c 'import secrets; print(secrets.token_hex(8))')"
export LAKESHORE_SUITE_RUN
rc=0
python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder "$@" || rc=$?
echo "== leftover processes"
python scripts/leftovers.py || { [ "$rc" -ne 0 ] || rc=1; }
exit "$rc"
