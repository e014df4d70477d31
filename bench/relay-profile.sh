#!/usr/bin/env bash
# Where a relayed call's cost goes, per hop: runs the examples/local stack (dispatcher, two
# tunnel servers, one agent) in front of an nginx upstream returning 8 bytes, drives it with
# wrk, and prints per call and per process:
#   - CPU (task-clock), syscalls and context switches (`perf stat`, tracepoint
#     raw_syscalls:sys_enter), and the share of CPU spent in the kernel;
#   - the syscalls by name (`strace -c -f`, in a second, slower run: strace's own cost
#     does not enter the first table);
#   - with PERF_RECORD=1, the top user-space symbols of each process (`perf record`);
#   - where the calls are: each tunnel server's calls in flight, read from its /metrics
#     about twenty times a second over a run of its own, as shares of the samples (none,
#     some, all CONNS), and the machine's idle and steal shares of CPU over that run
#     (/proc/stat). Calls that cross the processes in one batch show as servers with all
#     calls or none, and a machine left idle between the batches.
#
# Usage: bench/relay-profile.sh                    (from the repository root; builds release)
#        BIN_DIR=target/release CONNS=16 DURATION=10s bench/relay-profile.sh
#        PERF_RECORD=1 bench/relay-profile.sh
#        SHAPE=colocated bench/relay-profile.sh   (examples/colocated: the tunnel server
#                                                   serving the front itself, and the agent)
#        WRK_THREADS=2 bench/relay-profile.sh     (wrk's threads; default 1, as the targets were set)
# Needs perf, strace, wrk and nginx (installed from Debian when missing), and the fixed
# loopback ports of examples/local (8080, 8441-8452, 8460, 9090) and 8000 free.
set -euo pipefail

CONNS=${CONNS:-16}
DURATION=${DURATION:-10s}
PERF_RECORD=${PERF_RECORD:-0}
SHAPE=${SHAPE:-local}

need=()
command -v wrk >/dev/null || need+=(wrk)
command -v nginx >/dev/null || need+=(nginx)
command -v strace >/dev/null || need+=(strace)
command -v perf >/dev/null || need+=(linux-perf)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq && apt-get install -y -qq "${need[@]}" >/dev/null
fi

if [ -z "${BIN_DIR:-}" ]; then
  cargo build --release --locked --bin relay-dispatcher --bin relay-tunnel-server --bin relay-agent
  BIN_DIR=target/release
fi
BIN=$BIN_DIR

work=$(mktemp -d)
pids=()
cleanup() {
  kill "${pids[@]}" 2>/dev/null || true
  [ -f "$work/nginx.pid" ] && kill "$(cat "$work/nginx.pid")" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

cat > "$work/nginx.conf" <<NGX
worker_processes 1;
pid $work/nginx.pid;
error_log $work/nginx-error.log;
events { worker_connections 4096; }
http {
  access_log off;
  keepalive_requests 1000000;
  server { listen 127.0.0.1:8000 reuseport; location = / { return 200 "12345678"; } }
}
NGX
nginx -c "$work/nginx.conf"

if [ "$SHAPE" = colocated ]; then
  $BIN/relay-tunnel-server --config examples/colocated/tunnel-server.toml >"$work/ts1.log" 2>&1 & TS1=$!
  $BIN/relay-agent --config examples/colocated/agent.toml >"$work/agent.log" 2>&1 & AGENT=$!
  pids+=("$TS1" "$AGENT")
  declare -A NAME=([$TS1]=colocated-server [$AGENT]=agent)
else
  $BIN/relay-dispatcher --config examples/local/dispatcher.toml >"$work/dispatcher.log" 2>&1 & DISP=$!
  $BIN/relay-tunnel-server --config examples/local/tunnel-server-1.toml >"$work/ts1.log" 2>&1 & TS1=$!
  $BIN/relay-tunnel-server --config examples/local/tunnel-server-2.toml >"$work/ts2.log" 2>&1 & TS2=$!
  $BIN/relay-agent --config examples/local/agent.toml >"$work/agent.log" 2>&1 & AGENT=$!
  pids+=("$DISP" "$TS1" "$TS2" "$AGENT")
  declare -A NAME=([$DISP]=dispatcher [$TS1]=tunnel-server-1 [$TS2]=tunnel-server-2 [$AGENT]=agent)
fi
RELAY=("${pids[@]}")

AUTH='Authorization: Bearer dev-caller-key'
URL=http://127.0.0.1:8080/relay/demo/
ok=0
for _ in $(seq 1 200); do
  if [ "$(curl -s -H "$AUTH" "$URL" || true)" = 12345678 ]; then ok=1; break; fi
  sleep 0.05
done
[ $ok = 1 ] || { echo "relay not answering"; tail "$work"/*.log; exit 1; }
# Warm up: the agent grows its streams to the load before anything is counted.
wrk -t"${WRK_THREADS:-1}" -c"$CONNS" -d3s -H "$AUTH" "$URL" >/dev/null

calls_of() { awk '/requests in/ {print $1}' "$1"; }
errors_of() {
  awk '/Non-2xx/ {e += $NF} /Socket errors/ {gsub(",", ""); e += $4 + $6 + $8 + $10} END {print e + 0}' "$1"
}

# 1. perf stat per process over one wrk run.
for p in "${pids[@]}"; do
  perf stat -x, -e task-clock,raw_syscalls:sys_enter,context-switches,cpu-migrations \
    -p "$p" -o "$work/stat.$p" &
  pids+=($!)
  eval "STAT_$p=$!"
done
sleep 0.2 # perf attaches in well under this; it has no readiness signal to wait for
wrk -t"${WRK_THREADS:-1}" -c"$CONNS" -d"$DURATION" --latency -H "$AUTH" "$URL" > "$work/wrk.out"
for p in "${RELAY[@]}"; do v="STAT_$p"; kill -INT "${!v}"; wait "${!v}" 2>/dev/null || true; done
calls=$(calls_of "$work/wrk.out")
errors=$(errors_of "$work/wrk.out")

echo "relay at $CONNS connections, $DURATION: $calls calls, $(awk '/Requests\/sec/ {print $2}' "$work/wrk.out") calls/s," \
  "p50 $(awk '/^ +50%/ {print $2}' "$work/wrk.out"), p99 $(awk '/^ +99%/ {print $2}' "$work/wrk.out"), errors: $errors"
echo
printf '%-16s %14s %14s %14s\n' process "cpu us/call" "syscalls/call" "ctx-sw/call"
for p in "${RELAY[@]}"; do
  awk -F, -v n="$calls" -v name="${NAME[$p]}" '
    $3 == "task-clock" {cpu = $1 * 1000}
    $3 == "raw_syscalls:sys_enter" {sc = $1}
    $3 == "context-switches" {cs = $1}
    END {printf "%-16s %14.1f %14.2f %14.2f\n", name, cpu / n, sc / n, cs / n}' "$work/stat.$p"
done | tee "$work/table"
awk '{c += $2; s += $3; x += $4} END {printf "%-16s %14.1f %14.2f %14.2f\n", "sum", c, s, x}' "$work/table"

# 2. user vs kernel CPU per process over a second run (from /proc/<pid>/stat).
echo
hz=$(getconf CLK_TCK)
declare -A U0 S0
for p in "${RELAY[@]}"; do read -r U0[$p] S0[$p] < <(awk '{print $14, $15}' "/proc/$p/stat"); done
wrk -t"${WRK_THREADS:-1}" -c"$CONNS" -d"$DURATION" -H "$AUTH" "$URL" > "$work/wrk2.out"
calls2=$(calls_of "$work/wrk2.out")
printf '%-16s %14s %14s %10s\n' process "user us/call" "sys us/call" "sys share"
for p in "${RELAY[@]}"; do
  read -r u s < <(awk '{print $14, $15}' "/proc/$p/stat")
  awk -v u=$((u - U0[$p])) -v s=$((s - S0[$p])) -v hz="$hz" -v n="$calls2" -v name="${NAME[$p]}" \
    'BEGIN {printf "%-16s %14.1f %14.1f %9.0f%%\n", name, u / hz * 1e6 / n, s / hz * 1e6 / n, (u + s) ? 100 * s / (u + s) : 0}'
done

# 3. syscalls by name per process (strace slows every call; its own run).
echo
for p in "${RELAY[@]}"; do
  timeout -s INT 6 strace -c -f -q -p "$p" -o "$work/strace.$p" &
  eval "TRACE_$p=$!"
done
sleep 0.5 # strace attaches to every thread; no readiness signal either
wrk -t"${WRK_THREADS:-1}" -c"$CONNS" -d4s -H "$AUTH" "$URL" > "$work/wrk3.out"
for p in "${RELAY[@]}"; do v="TRACE_$p"; wait "${!v}" 2>/dev/null || true; done
calls3=$(calls_of "$work/wrk3.out")
for p in "${RELAY[@]}"; do
  echo "${NAME[$p]}: syscalls per call by name (strace -c over $calls3 calls)"
  awk -v n="$calls3" '$1 ~ /^[0-9.]+$/ && $NF != "total" {printf "  %-16s %8.2f\n", $NF, $4 / n}' "$work/strace.$p" |
    sort -k2 -gr | head -8
done

# 4. where user CPU goes (optional: perf record needs a few seconds per process).
if [ "$PERF_RECORD" = 1 ]; then
  for p in "${RELAY[@]}"; do
    perf record -q -F 999 -g -p "$p" -o "$work/perf.$p" -- sleep 5 >/dev/null 2>&1 &
    eval "REC_$p=$!"
  done
  wrk -t"${WRK_THREADS:-1}" -c"$CONNS" -d5s -H "$AUTH" "$URL" > /dev/null
  for p in "${RELAY[@]}"; do
    v="REC_$p"; wait "${!v}" 2>/dev/null || true
    echo
    echo "${NAME[$p]}: top symbols (perf report --no-children)"
    perf report -q -i "$work/perf.$p" --no-children -g none --percent-limit "${PERCENT_LIMIT:-1.5}" --sort dso,symbol 2>/dev/null | cut -c1-120 | head -"${TOP:-20}"
  done
fi

# 5. where the calls are: each tunnel server's calls in flight, sampled from its admin
# listener (bash's /dev/tcp, so that sampling spawns no process per sample).
declare -A ADMIN=([$TS1]=9441)
[ "$SHAPE" = colocated ] || ADMIN[$TS2]=9442
in_flight() { # admin port -> $v: the server's relay_tunnel_calls_in_flight (empty if unread)
  local line
  v=""
  exec 3<>"/dev/tcp/127.0.0.1/$1" || return 0
  printf 'GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
  while IFS= read -r line <&3; do
    case $line in "relay_tunnel_calls_in_flight "*) v=${line#* } ;; esac
  done
  exec 3<&-
  v=${v%%.*}
}
cpu_ticks() { awk '/^cpu / {t = 0; for (i = 2; i <= 9; i++) t += $i; print t, $5 + $6, $9; exit}' /proc/stat; }
wrk -t"${WRK_THREADS:-1}" -c"$CONNS" -d5s -H "$AUTH" "$URL" > /dev/null &
WRK=$!
sleep 0.5 # past wrk's connecting
read -r t0 i0 s0 < <(cpu_ticks)
for _ in $(seq 1 200); do
  kill -0 "$WRK" 2>/dev/null || break
  for p in "${!ADMIN[@]}"; do in_flight "${ADMIN[$p]}"; echo "$v" >> "$work/inflight.$p"; done
  sleep 0.02
done
read -r t1 i1 s1 < <(cpu_ticks)
wait "$WRK" || true
echo
echo "where the calls are (calls in flight per tunnel server, sampled about twenty times a second at $CONNS connections):"
printf '%-16s %8s %8s %10s %10s %10s\n' process samples median "none" "some" "all"
for p in "${!ADMIN[@]}"; do
  sort -g "$work/inflight.$p" | awk -v c="$CONNS" -v name="${NAME[$p]}" '
    $1 != "" {v[++n] = $1; if ($1 == 0) z++; else if ($1 >= c) a++; else s++}
    END {if (n) printf "%-16s %8d %8d %9.0f%% %9.0f%% %9.0f%%\n", name, n, v[int((n + 1) / 2)], 100 * z / n, 100 * s / n, 100 * a / n}'
done
awk -v t=$((t1 - t0)) -v i=$((i1 - i0)) -v s=$((s1 - s0)) \
  'BEGIN {if (t) printf "machine over that run: %.0f%% idle, %.0f%% steal\n", 100 * i / t, 100 * s / t}'

echo
echo "reached limit in the relay logs: $(cat "$work"/*.log | grep -c 'reached limit' || true)"
