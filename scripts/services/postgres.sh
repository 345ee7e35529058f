#!/usr/bin/env bash
# Start an isolated PostgreSQL (15 preferred) on 127.0.0.1 with trust auth, unless one already answers.
# Usage: scripts/services/postgres.sh [PORT]   (default 5433; cluster under $LAKESHORE_SERVICES_DIR/pg-PORT)
# Installs postgresql-15 with apt when no server binaries are found (needs root). Runs the server as
# the `postgres` user when started as root (initdb refuses root).
# On success prints `export LAKESHORE_TEST_PG_URL=...` on stdout; everything else goes to stderr.
set -euo pipefail
port="${1:-5433}"
base="${LAKESHORE_SERVICES_DIR:-/tmp/lakeshore-services}/pg-$port"
url="postgresql://postgres@127.0.0.1:$port/postgres"
say() { echo "[postgres] $*" >&2; }

find_bin() {
  local v
  for v in 15 16 17 14 13; do
    if [ -x "/usr/lib/postgresql/$v/bin/pg_ctl" ]; then echo "/usr/lib/postgresql/$v/bin"; return; fi
  done
}
bin="$(find_bin)"
if [ -z "$bin" ]; then
  say "no PostgreSQL server binaries; installing postgresql-15 with apt"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq postgresql-15 || apt-get install -y -qq postgresql; } >&2
  bin="$(find_bin)"
  [ -n "$bin" ] || { say "PostgreSQL could not be installed: apt-get install postgresql-15"; exit 1; }
fi

as_owner() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}
ready() { "$bin/pg_isready" -q -h 127.0.0.1 -p "$port" -U postgres -d postgres; }

if ready; then
  say "already running on 127.0.0.1:$port"
else
  mkdir -p "$base"
  [ "$(id -u)" = 0 ] && chown postgres: "$base"
  data="$base/data"
  if [ ! -s "$data/PG_VERSION" ]; then
    as_owner "$bin/initdb" -D "$data" -U postgres --auth=trust --encoding=UTF8 --locale=C.UTF-8 >"$base/initdb.log" 2>&1 \
      || as_owner "$bin/initdb" -D "$data" -U postgres --auth=trust --encoding=UTF8 --no-locale >"$base/initdb.log" 2>&1 \
      || { say "initdb failed; see $base/initdb.log"; tail -n 20 "$base/initdb.log" >&2; exit 1; }
    # Loopback only, trust auth: a test database, never a real one.
    printf 'local all all trust\nhost all all 127.0.0.1/32 trust\n' >"$data/pg_hba.conf"
  fi
  # A stale postmaster.pid from a killed server blocks a start; pg_ctl status tells whether it is live.
  if [ -f "$data/postmaster.pid" ] && ! as_owner "$bin/pg_ctl" -D "$data" status >/dev/null 2>&1; then
    rm -f "$data/postmaster.pid"
  fi
  as_owner "$bin/pg_ctl" -D "$data" -l "$base/server.log" -w -t 60 \
    -o "-p $port -c listen_addresses=127.0.0.1 -k $base -c fsync=off -c synchronous_commit=off -c full_page_writes=off" \
    start >&2 || { say "pg_ctl start failed; see $base/server.log"; tail -n 20 "$base/server.log" >&2; exit 1; }
  ready || { say "server started but does not answer on 127.0.0.1:$port"; exit 1; }
  say "started on 127.0.0.1:$port (data in $data)"
fi
echo "export LAKESHORE_TEST_PG_URL=$url"
