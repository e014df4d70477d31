#!/usr/bin/env bash
# Benchmarks the relay binaries against a fast upstream (nginx returning 8 bytes), with wrk
# as the backend, at 16 and 64 connections for 10 s each, and reports calls/s, p50/p99
# latency, CPU per relayed call summed over the three relay processes, and peak RSS of each
# process; then streams a 64 MiB response through the relay and reports peak RSS again.
# Direct-to-nginx figures are measured in the same run as the baseline.
#
# Usage: bench/relay-bench.sh            (from the repository root; builds release binaries)
#        BIN_DIR=/path bench/relay-bench.sh   (benchmarks the binaries in /path instead, e.g.
#                                              another version's, without building)
#        POLICY=sticky bench/relay-bench.sh    (the dispatcher's [routing] policy; default
#                                              the config's, `available`)
#        DURATION=5s CONNS=64 bench/relay-bench.sh
# Needs: nginx, wrk (Debian packages nginx-light, wrk); installs them when missing.
# Uses the fixed loopback ports of examples/local (8080, 8441-8452, 8460, 9080, 9090, 9441-9442, 8000).
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-10s}
CONNS=${CONNS:-"16 64"}

need() { command -v "$1" >/dev/null 2>&1; }
if ! need nginx || ! need wrk; then
  apt-get update -qq && apt-get install -y -qq nginx-light wrk >/dev/null
fi
if [ -z "${BIN_DIR:-}" ]; then
  cargo build --release --bins -q
fi
BIN=${BIN_DIR:-target/release}

work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -f "$work/nginx.pid" ] && kill "$(cat "$work/nginx.pid")" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

chmod 755 "$work"
head -c $((64 * 1024 * 1024)) /dev/urandom > "$work/big.bin"
cat > "$work/nginx.conf" <<NGX
worker_processes 1;
pid $work/nginx.pid;
error_log $work/nginx-error.log;
events { worker_connections 4096; }
http {
  access_log off;
  keepalive_requests 1000000;
  server {
    listen 127.0.0.1:8000 reuseport;
    location = / { return 200 "12345678"; }
    location = /big.bin { root $work; }
  }
}
NGX
nginx -c "$work/nginx.conf"

DISPATCHER_CONFIG=examples/local/dispatcher.toml
if [ -n "${POLICY:-}" ]; then
  DISPATCHER_CONFIG=$work/dispatcher.toml
  { cat examples/local/dispatcher.toml; printf '\n[routing]\npolicy = "%s"\n' "$POLICY"; } > "$DISPATCHER_CONFIG"
fi
$BIN/relay-dispatcher --config "$DISPATCHER_CONFIG" >"$work/dispatcher.log" 2>&1 & DISP=$!; pids+=($DISP)
$BIN/relay-tunnel-server --config examples/local/tunnel-server-1.toml >"$work/ts1.log" 2>&1 & TS1=$!; pids+=($TS1)
$BIN/relay-tunnel-server --config examples/local/tunnel-server-2.toml >"$work/ts2.log" 2>&1 & TS2=$!; pids+=($TS2)
$BIN/relay-agent --config examples/local/agent.toml >"$work/agent.log" 2>&1 & AGENT=$!; pids+=($AGENT)

URL=http://127.0.0.1:8080/relay/demo/
AUTH='Authorization: Bearer dev-caller-key'
for _ in $(seq 1 200); do
  if [ "$(curl -s -o /dev/null -w '%{http_code}' -H "$AUTH" "$URL")" = 200 ]; then break; fi
  sleep 0.05
done
[ "$(curl -s -H "$AUTH" "$URL")" = 12345678 ] || { echo "relay not routable"; tail "$work"/*.log; exit 1; }

ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
hwm() { awk '/VmHWM/ {print $2}' "/proc/$1/status"; }
hz=$(getconf CLK_TCK)

run_wrk() { # url conns -> "rps p50 p99 requests"
  wrk -t2 -c"$2" -d"$DURATION" --latency -H "$AUTH" "$1" > "$work/wrk.out"
  awk '
    /Requests\/sec/ {rps=$2}
    /^ +50%/ {p50=$2} /^ +99%/ {p99=$2}
    /requests in/ {n=$1}
    END {print rps, p50, p99, n}' "$work/wrk.out"
}

# Calls the tunnel servers queued so far (waited for a stream): all queue-wait samples less
# those in the first bucket (immediate hand-overs record 0).
queued_calls() {
  for port in 9441 9442; do curl -s "http://127.0.0.1:$port/metrics"; done | awk '
    /^relay_tunnel_queue_wait_seconds_count/ {n += $2}
    /^relay_tunnel_queue_wait_seconds_bucket\{le="0.0001"\}/ {z += $2}
    END {print n - z}'
}

# Calls that took the queue handshake (the dispatcher heard `Queued`).
handshakes() {
  curl -s http://127.0.0.1:9080/metrics | awk '/^relay_dispatcher_queued_total/ {n += $2} END {print n + 0}'
}

printf '%-8s %-6s %12s %10s %10s %14s %8s %10s\n' target conns calls/s p50 p99 "cpu/call(us)" queued handshakes
for c in $CONNS; do
  read -r rps p50 p99 n < <(run_wrk http://127.0.0.1:8000/ "$c")
  printf '%-8s %-6s %12s %10s %10s %14s %8s %10s\n' direct "$c" "$rps" "$p50" "$p99" "-" "-" "-"
  before=$(( $(ticks $DISP) + $(ticks $TS1) + $(ticks $TS2) + $(ticks $AGENT) ))
  q0=$(queued_calls); h0=$(handshakes)
  read -r rps p50 p99 n < <(run_wrk "$URL" "$c")
  after=$(( $(ticks $DISP) + $(ticks $TS1) + $(ticks $TS2) + $(ticks $AGENT) ))
  q1=$(queued_calls); h1=$(handshakes)
  cpu_us=$(awk -v t=$((after - before)) -v hz="$hz" -v n="$n" 'BEGIN {printf "%.1f", t / hz * 1e6 / n}')
  printf '%-8s %-6s %12s %10s %10s %14s %8s %10s\n' relayed "$c" "$rps" "$p50" "$p99" "$cpu_us" $((q1 - q0)) $((h1 - h0))
done
echo
echo "peak RSS after load (KiB): dispatcher $(hwm $DISP)  tunnel-server-1 $(hwm $TS1)  tunnel-server-2 $(hwm $TS2)  agent $(hwm $AGENT)"
bytes=$(curl -s -H "$AUTH" "${URL}big.bin" | wc -c)
echo "64 MiB response relayed: $bytes bytes"
echo "peak RSS after 64 MiB (KiB): dispatcher $(hwm $DISP)  tunnel-server-1 $(hwm $TS1)  tunnel-server-2 $(hwm $TS2)  agent $(hwm $AGENT)"
