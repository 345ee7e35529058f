#!/usr/bin/env bash
# Start a throwaway redis-server on 127.0.0.1 (persisting nothing) unless one already answers there.
# Usage: scripts/services/redis.sh [PORT]   (default 6390; state under $LAKESHORE_SERVICES_DIR)
# On success prints `export LAKESHORE_TEST_REDIS_URL=...` on stdout; everything else goes to stderr.
set -euo pipefail
port="${1:-6390}"
base="${LAKESHORE_SERVICES_DIR:-/tmp/lakeshore-services}/redis-$port"
url="redis://127.0.0.1:$port/0"
say() { echo "[redis] $*" >&2; }

ping() { [ "$(redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null)" = "PONG" ]; }

if ! command -v redis-server >/dev/null; then
  say "redis-server not found: apt-get install -y redis-server"
  exit 1
fi
if ping; then
  say "already running on 127.0.0.1:$port"
else
  mkdir -p "$base"
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$base" \
    --daemonize yes --pidfile "$base/redis.pid" --logfile "$base/redis.log" >&2
  for _ in $(seq 100); do ping && break; sleep 0.1; done
  if ! ping; then
    say "redis-server did not answer on 127.0.0.1:$port; see $base/redis.log"
    tail -n 20 "$base/redis.log" >&2 || true
    exit 1
  fi
  say "started on 127.0.0.1:$port (pid $(cat "$base/redis.pid"))"
fi
echo "export LAKESHORE_TEST_REDIS_URL=$url"
