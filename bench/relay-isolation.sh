#!/usr/bin/env bash
# Isolation figures of the relay binaries on examples/local (one dispatcher, two tunnel
# servers, one agent; `relay-fleet upstream` as the upstream):
#
# 1. Stalled downloads: other callers' calls/s and latency (wrk, 16 connections,
#    GET /relay/demo/hello) alone and with STALLS callers of another tenant (a caller key
#    of their own) that each read their 256 MiB download's response head and then nothing
#    (`relay-fleet stall`), and every relay process's RSS (VmRSS now, VmHWM so far) while
#    they hold on. Between rounds the stalled
#    callers leave and the dispatcher is waited on to have no call in flight.
# 2. A silent partition: the agent reaches tunnel server 1 through `relay-fleet forward`,
#    which goes silent for PARTITION (connections left open) under `relay-fleet soak` in
#    external mode (50 callers, upstream 50 ms). When tunnel server 1 dropped the agent's
#    streams, when the agent dropped its own there, when server 1 was back at its reserve
#    after the heal, and every call that failed, by reason.
#
# Usage: bench/relay-isolation.sh              (from the repository root; builds release binaries)
#        BIN_DIR=/path bench/relay-isolation.sh
#        STALLS="0 8 64 256" DURATION=10s PARTITION=10s bench/relay-isolation.sh
# Needs wrk (Debian package; installed when missing). Uses the fixed loopback ports of
# examples/local (8000, 8080, 8441-8452, 8460, 9080, 9090, 9441-9442) and 8449.
set -euo pipefail
cd "$(dirname "$0")/.."
STALLS=${STALLS:-"0 8 64 256"}
DURATION=${DURATION:-10s}
PARTITION=${PARTITION:-10s}
if ! command -v wrk >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq wrk >/dev/null
fi
if [ -z "${BIN_DIR:-}" ]; then
  cargo build --release --bins -q
fi
BIN=${BIN_DIR:-target/release}
for port in 8000 8080 8441 8442 8449 8451 8452 8460 9080 9090 9441 9442; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "port $port is in use (a process left from an earlier run?): stop it first"; exit 1
  fi
done

work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
AUTH='Authorization: Bearer dev-caller-key'
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }
metric() { # admin-port metric-name [label-filter]
  curl -s "http://127.0.0.1:$1/metrics" | grep "^$2" | grep -- "${3:-}" | awk '{ s += $2 } END { print s + 0 }'
}
rss() { # pid -> "VmRSS/VmHWM MiB"
  awk '/^VmRSS/ { r = $2 } /^VmHWM/ { h = $2 } END { printf "%.1f/%.1f", r / 1024, h / 1024 }' "/proc/$1/status"
}
wait_for() { # what seconds command...
  local what=$1 secs=$2; shift 2
  for _ in $(seq 1 $((secs * 20))); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.05
  done
  echo "not within ${secs}s: $what"; tail -n 20 "$work"/*.log; exit 1
}
answers() { [ "$(curl -s -H "$AUTH" http://127.0.0.1:8080/relay/demo/hello)" = "hello from upstream" ]; }
no_calls_in_flight() { [ "$(metric 9080 relay_dispatcher_calls_in_flight)" = 0 ]; }

# The stalled callers are another tenant: a caller key of their own, so that the calls they
# hold count toward their own max_concurrent_calls (256 by default), not the measured
# caller's.
{ cat examples/local/dispatcher.toml
  printf '\n[[callers]]\nname = "stalled"\nkey = "stalled-caller-key"\ntunnels = ["*"]\n'
} > "$work/dispatcher.toml"
start_stack() { # agent flags...
  $BIN/relay-fleet upstream --listen 127.0.0.1:8000 --latency-ms "${UPSTREAM_MS:-0}" >"$work/upstream.log" 2>&1 & UP=$!; pids+=($UP)
  $BIN/relay-dispatcher --config "$work/dispatcher.toml" >"$work/dispatcher.log" 2>&1 & DISP=$!; pids+=($DISP)
  $BIN/relay-tunnel-server --config examples/local/tunnel-server-1.toml >"$work/ts1.log" 2>&1 & TS1=$!; pids+=($TS1)
  $BIN/relay-tunnel-server --config examples/local/tunnel-server-2.toml >"$work/ts2.log" 2>&1 & TS2=$!; pids+=($TS2)
  $BIN/relay-agent --config examples/local/agent.toml "$@" >"$work/agent.log" 2>&1 & AGENT=$!; pids+=($AGENT)
  wait_for "the stack answers" 30 answers
}
stop_stack() {
  kill "$UP" "$DISP" "$TS1" "$TS2" "$AGENT" 2>/dev/null || true
  wait "$UP" "$DISP" "$TS1" "$TS2" "$AGENT" 2>/dev/null || true
}

echo "== stalled downloads: wrk -c16 GET /relay/demo/hello for $DURATION beside N stalled callers (256 MiB each)"
start_stack
wrk -t1 -c16 -d3s -H "$AUTH" http://127.0.0.1:8080/relay/demo/hello >/dev/null
printf '%-8s %10s %9s %9s %9s %8s | %-15s %-15s %-15s %-15s\n' stalled calls/s p50 p99 max errors \
  "dispatcher MiB" "ts-1 MiB" "ts-2 MiB" "agent MiB"
for k in $STALLS; do
  stall_pid=""
  if [ "$k" -gt 0 ]; then
    $BIN/relay-fleet stall --front 127.0.0.1:8080 --callers "$k" --caller-key stalled-caller-key \
      --path /relay/demo/bytes/268435456 --hold 1h >"$work/stall-$k.log" 2>&1 & stall_pid=$!; pids+=($stall_pid)
    wait_for "$k stalled downloads hold their heads" 120 grep -q "hold their response head" "$work/stall-$k.log"
    # Held up: the upstream's answers stop moving once every window on the way is full.
    sleep 3
  fi
  out=$(wrk -t1 -c16 -d"$DURATION" --latency -H "$AUTH" http://127.0.0.1:8080/relay/demo/hello)
  rate=$(awk '/^Requests\/sec/ { print $2 }' <<<"$out")
  p50=$(awk '$1 == "50%" { print $2 }' <<<"$out")
  p99=$(awk '$1 == "99%" { print $2 }' <<<"$out")
  max=$(awk '$1 == "Latency" { print $4 }' <<<"$out")
  errors=$(awk '/Non-2xx|Socket errors/ { n += 1 } END { print n + 0 }' <<<"$out")
  printf '%-8s %10s %9s %9s %9s %8s | %-15s %-15s %-15s %-15s\n' "$k" "$rate" "$p50" "$p99" "$max" "$errors" \
    "$(rss "$DISP")" "$(rss "$TS1")" "$(rss "$TS2")" "$(rss "$AGENT")"
  grep -E "Non-2xx|Socket errors" <<<"$out" || true
  if [ -n "$stall_pid" ]; then
    grep -E "got no response head|statuses" "$work/stall-$k.log" | head -3 || true
    kill "$stall_pid" 2>/dev/null || true
    wait "$stall_pid" 2>/dev/null || true
    wait_for "the stalled calls end" 60 no_calls_in_flight
  fi
done
echo "peak RSS (VmHWM) over the rounds: dispatcher $(rss "$DISP"), ts-1 $(rss "$TS1"), ts-2 $(rss "$TS2"), agent $(rss "$AGENT") (VmRSS/VmHWM MiB)"
stop_stack

echo
echo "== a $PARTITION silent partition between the agent and ts-1 under 50 callers (upstream 50 ms)"
$BIN/relay-fleet forward --listen 127.0.0.1:8449 --to 127.0.0.1:8441 >"$work/forward.log" 2>&1 & FWD=$!; pids+=($FWD)
UPSTREAM_MS=50 start_stack --tunnel http://127.0.0.1:8449 --tunnel http://127.0.0.1:8442
streams() { metric "$1" relay_tunnel_streams 'tunnel_id="demo"'; }
both_hold() { [ "$(streams 9441)" -gt 0 ] && [ "$(streams 9442)" -gt 0 ]; }
ts1_at_reserve() { [ "$(streams 9441)" -ge 2 ]; }
wait_for "both servers hold streams" 30 both_hold
$BIN/relay-fleet soak --dispatcher http://127.0.0.1:8080 --tunnel-id demo --concurrency 50 \
  --duration 40s >"$work/soak.log" 2>&1 & SOAK=$!; pids+=($SOAK)
sleep 10
echo "ts-1 holds $(streams 9441) streams of demo, ts-2 $(streams 9442)"
kill -USR1 "$FWD"; t0=$(now)
found_server=""; found_agent=""
while [ -z "$found_server" ] || [ -z "$found_agent" ]; do
  if [ -z "$found_server" ] && [ "$(streams 9441)" = 0 ]; then found_server=$(since "$t0"); fi
  if [ -z "$found_agent" ] && ! curl -s http://127.0.0.1:9090/systemcheck | grep -q '"server_id":"ts-1"[^}]*"streams":[1-9]'; then
    found_agent=$(since "$t0")
  fi
  if awk -v s="$(since "$t0")" -v p="${PARTITION%s}" 'BEGIN { exit !(s > p) }'; then break; fi
  sleep 0.05
done
echo "silent at 0 s: ts-1 dropped the agent's streams after ${found_server:-never} s, the agent its own there after ${found_agent:-never} s"
sleep "$(awk -v s="$(since "$t0")" -v p="${PARTITION%s}" 'BEGIN { d = p - s; print (d > 0 ? d : 0) }')"
kill -USR2 "$FWD"; t1=$(now)
wait_for "ts-1 back at its reserve (2)" 60 ts1_at_reserve
echo "healed at $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }') s: ts-1 back at its reserve $(since "$t1") s after the heal"
wait "$SOAK" || true
grep -vE "^\s*$" "$work/soak.log" | tail -n 30
