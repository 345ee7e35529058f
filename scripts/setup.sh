#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv and install the project into it.
# Usage: scripts/setup.sh [EXTRAS]   (default extras: all,test; the demo asks for server only)
#
# Installed extras are recorded in .venv/.installed-<pyproject hash>; a request they already cover
# (test includes all, all includes server,s3,docker,kube) installs nothing, so the demo and the tests
# never reinstall each other, and an install keeps what earlier runs installed. pip's output goes
# to .venv/pip.log and is shown only when it fails.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-all,test}"

# The extras each extra includes, as pyproject.toml's [project.optional-dependencies] says.
expand() {
  local e
  for e in ${1//,/ }; do
    case "$e" in
      test) echo test; expand all ;;
      all) printf '%s\n' all server s3 docker kube ;;
      *) echo "$e" ;;
    esac
  done
}

# Resolve the real interpreter: a pyenv shim costs ~100 ms per start and hides which python runs.
py="${PYTHON:-$(command -v python3)}"
if command -v pyenv >/dev/null 2>&1 && [ "$(dirname "$py")" = "$(pyenv root 2>/dev/null)/shims" ]; then
  py="$(pyenv which python3)"
fi
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv (first run only)" >&2
  "$py" -m venv .venv
fi
stamp=".venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)"
want="$(expand "$extras" | sort -u)"
have="$(cat "$stamp" 2>/dev/null || true)"
if [ -f "$stamp" ] && [ -z "$(comm -23 <(echo "$want") <(echo "$have"))" ]; then
  exit 0
fi
# Keep the extras an earlier run installed (under this or an older pyproject.toml).
keep="$(cat .venv/.installed-* 2>/dev/null || true)"
union="$(printf '%s\n%s\n' "$want" "$keep" | grep -v '^$' | sort -u)"
echo "setup: installing the project with extras $(echo "$union" | paste -sd, -) into .venv" >&2
if ! .venv/bin/python -m pip install -e ".[$(echo "$union" | paste -sd, -)]" >.venv/pip.log 2>&1; then
  cat .venv/pip.log >&2
  echo "setup: pip install failed (log above, also in .venv/pip.log)" >&2
  exit 1
fi
rm -f .venv/.installed-*
echo "$union" >"$stamp"
