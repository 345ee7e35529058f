#!/usr/bin/env bash
# Start a Docker engine with gVisor's runsc registered, and build the small python image the runner
# tests use, unless they are already there. Idempotent; safe to rerun.
# Usage: scripts/services/docker.sh [IMAGE]   (default lakeshore-python:bookworm)
#
# - /etc/docker/daemon.json gets the runsc runtime (merged into any existing content); runsc needs
#   --network=none on these hosts (see INFRA.md).
# - dockerd runs with --bridge=none --iptables=false: no private-range network is ever created.
# - The image is a debootstrap (minbase + python3 + python3-msgpack) bookworm rootfs; no registry is
#   reachable here, so nothing is pulled. The rootfs tarball is cached under
#   $LAKESHORE_IMAGE_CACHE (/var/cache/lakeshore) so a rerun on the same machine takes seconds.
# On success prints `export LAKESHORE_TEST_IMAGE=...` on stdout; everything else goes to stderr.
set -euo pipefail
image="${1:-lakeshore-python:bookworm}"
suite="bookworm"
cache="${LAKESHORE_IMAGE_CACHE:-/var/cache/lakeshore}"
tarball="$cache/python-$suite-rootfs-v2.tar"  # bump vN when the recipe changes
logdir="${LAKESHORE_SERVICES_DIR:-/tmp/lakeshore-services}/docker"
daemon_json="/etc/docker/daemon.json"
say() { echo "[docker] $*" >&2; }

for bin in dockerd docker python3; do
  if ! command -v "$bin" >/dev/null; then
    say "$bin not found: apt-get install -y docker.io runsc debootstrap"
    exit 1
  fi
done
if [ ! -x /usr/bin/runsc ]; then
  say "/usr/bin/runsc not found: apt-get install -y runsc"
  exit 1
fi

# --- 1. register runsc in daemon.json (merge, never clobber) -------------------------------------
mkdir -p "$(dirname "$daemon_json")"
changed="$(python3 - "$daemon_json" <<'EOF'
import json, os, sys
path = sys.argv[1]
try:
    with open(path) as fh:
        text = fh.read()
    conf = json.loads(text) if text.strip() else {}
except FileNotFoundError:
    conf = {}
want = {"path": "/usr/bin/runsc", "runtimeArgs": ["--network=none"]}
runtimes = conf.setdefault("runtimes", {})
if runtimes.get("runsc") == want:
    print("no")
else:
    runtimes["runsc"] = want
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(conf, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)
    print("yes")
EOF
)"
[ "$changed" = "yes" ] && say "registered runsc in $daemon_json"

# --- 2. start dockerd unless an engine answers ---------------------------------------------------
engine_up() { docker info >/dev/null 2>&1; }
if engine_up; then
  say "engine already answering"
  if [ "$changed" = "yes" ]; then
    pid="$(pgrep -xo dockerd || true)"
    if [ -n "$pid" ]; then
      kill -HUP "$pid" && say "sent SIGHUP to dockerd $pid to reload runtimes"
      sleep 0.5
    else
      say "daemon.json changed but no local dockerd to reload: reload the engine yourself"
    fi
  fi
else
  mkdir -p "$logdir"
  say "starting dockerd (log: $logdir/dockerd.log)"
  nohup dockerd --bridge=none --iptables=false >"$logdir/dockerd.log" 2>&1 </dev/null &
  echo $! >"$logdir/dockerd.pid"
  for _ in $(seq 300); do engine_up && break; sleep 0.1; done
  if ! engine_up; then
    say "dockerd did not answer within 30 s; see $logdir/dockerd.log"
    tail -n 20 "$logdir/dockerd.log" >&2 || true
    exit 1
  fi
  say "dockerd up (pid $(cat "$logdir/dockerd.pid"))"
fi
if ! docker info --format '{{json .Runtimes}}' 2>/dev/null | grep -q '"runsc"'; then
  say "warning: the engine does not list the runsc runtime; gvisor tests will be skipped"
fi

# --- 3. the python image -------------------------------------------------------------------------
if docker image inspect "$image" >/dev/null 2>&1; then
  say "image $image already present"
  echo "export LAKESHORE_TEST_IMAGE=$image"
  exit 0
fi

if [ ! -s "$tarball" ]; then
  command -v debootstrap >/dev/null || { say "debootstrap not found: apt-get install -y debootstrap"; exit 1; }
  mirror="$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)"
  mirror="${mirror:-http://deb.debian.org/debian}"
  mkdir -p "$cache"
  rootfs="$(mktemp -d "$cache/rootfs.XXXXXX")"
  trap 'rm -rf "$rootfs"' EXIT
  say "debootstrap $suite from $mirror (about 40 s)"
  debootstrap --variant=minbase --include=python3,python3-msgpack "$suite" "$rootfs" "$mirror" \
    >"$cache/debootstrap.log" 2>&1 || {
    say "debootstrap failed; see $cache/debootstrap.log"
    tail -n 20 "$cache/debootstrap.log" >&2
    exit 1
  }
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
    "$rootfs"/usr/share/locale/* "$rootfs"/var/log/* "$rootfs"/tmp/* "$rootfs"/debootstrap
  # Keep (and complete) the stdlib bytecode: without it every import compiles from source, which
  # costs ~150 ms per container start (read-only roots cannot even cache the result).
  chroot "$rootfs" python3 -m compileall -q -j 0 /usr/lib/python3 /usr/lib/python3.* >/dev/null 2>&1 || true
  tar -C "$rootfs" --numeric-owner -cf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
  rm -rf "$rootfs"
  trap - EXIT
  say "cached rootfs at $tarball ($(du -h "$tarball" | cut -f1))"
fi

say "importing $image"
docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  "$tarball" "$image" >/dev/null
docker run --rm --network none "$image" python3 -c 'import msgpack' >&2 \
  || { say "image $image cannot import msgpack"; exit 1; }
say "built $image"
echo "export LAKESHORE_TEST_IMAGE=$image"
