#!/usr/bin/env bash
# Benchmarks the relay binaries against the references measured in the same run, with wrk
# as the backend and nginx returning 8 bytes as the upstream:
#   direct   wrk -> nginx
#   chain    three nginx reverse proxies in a chain (one worker each, keep-alive between
#            hops): the same number of hops as relay, done by a C proxy
#   rathole  rathole (a plain TCP reverse tunnel, no per-call routing): server + client
#   relay    dispatcher -> tunnel server -> agent (examples/local: two tunnel servers)
#   colocated  the co-located mode: a tunnel server serving the dispatcher front itself ->
#            agent (examples/colocated, moved to ports of its own)
#   base     relay as `relay`, from the binaries in BASE_BIN_DIR (another build), on ports
#            of its own: an A/B comparison whose runs alternate with relay's in every round
# at 1, 16 and 64 connections. Each round runs every target once per connection count, in
# turn; the table shows the median over ROUNDS rounds of calls/s, p50 and p99 latency, CPU
# per call summed over each target's processes, and the ratio of relay's calls/s to the
# chain's and to rathole's (relay's and colocated's), and the machine's idle and steal
# shares of CPU over the run (from /proc/stat: a target that leaves the CPU idle is held by
# the round trips through its processes, not by their work; steal is CPU the hypervisor gave
# to other machines, which makes a run slower than its neighbours). Then peak RSS per relay
# process, a 64 MiB response streamed through the relay (peak RSS again), every non-2xx
# answer or socket error wrk saw, and a search of every relay log for h2 connection guards
# tripped (`reached limit`). With `base`, relay's calls/s over base's in each round (the two
# ran seconds apart, so a slow minute of a shared machine slows both) and their median. And
# the CPU per call of each relay process (medians over the rounds), to tell which hop a
# change made dearer.
#
# Usage: bench/relay-bench.sh            (from the repository root; builds release binaries)
#        BIN_DIR=/path bench/relay-bench.sh   (benchmarks the binaries in /path instead)
#        POLICY=sticky bench/relay-bench.sh    (the dispatcher's [routing] policy)
#        DURATION=5s CONNS="16 64" ROUNDS=3 bench/relay-bench.sh
#        TARGETS="chain relay" bench/relay-bench.sh   (a subset of direct chain rathole relay colocated)
#        BASE_BIN_DIR=/other/build TARGETS="chain relay base" bench/relay-bench.sh   (A/B)
#        WRK_THREADS=2 bench/relay-bench.sh   (wrk's threads; default 1)
#        WARMUP=3s bench/relay-bench.sh       (unmeasured load on every target first; default 3s)
#        BODY_BYTES=200 bench/relay-bench.sh  (every call a POST with a body of that many bytes;
#                                             default 0: GETs)
# Needs: nginx, wrk (Debian packages nginx-light, wrk; installed when missing) and rathole
# (`cargo install rathole` into $RATHOLE_ROOT, default ~/.cache/relay-bench, once).
# Uses the fixed loopback ports of examples/local (8080, 8441-8452, 8460, 9080, 9090,
# 9441-9442, 8000), 8090, 8443, 8453, 8470, 9081, 9091, 9443 for the co-located stack,
# 8084, 8444-8445, 8454-8455, 8464, 9084, 9094, 9444-9445 for the base stack and 8101-8103,
# 8201-8202 for the references.
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-10s}
CONNS=${CONNS:-"1 16 64"}
ROUNDS=${ROUNDS:-3}
TARGETS=${TARGETS:-"direct chain rathole relay colocated"}
# wrk's threads: one by default, as the performance targets were set (wrk -t1): on a
# two-core machine a second wrk thread takes its share of a core from the proxies measured.
WRK_THREADS=${WRK_THREADS:-1}
RATHOLE_ROOT=${RATHOLE_ROOT:-$HOME/.cache/relay-bench}

need() { command -v "$1" >/dev/null 2>&1; }
if ! need nginx || ! need wrk; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq nginx-light wrk >/dev/null
fi
wants() { case " $TARGETS " in *" $1 "*) return 0;; *) return 1;; esac; }
RATHOLE=$RATHOLE_ROOT/bin/rathole
if wants rathole && [ ! -x "$RATHOLE" ]; then
  echo "installing rathole into $RATHOLE_ROOT (once)"
  # Not --locked: rathole 0.5.0's lock file pins a `time` that newer compilers refuse.
  cargo install -q rathole --version 0.5.0 --root "$RATHOLE_ROOT"
fi
if [ -z "${BIN_DIR:-}" ]; then
  cargo build --release --bins -q
fi
BIN=${BIN_DIR:-target/release}
if wants base && [ ! -x "${BASE_BIN_DIR:-}/relay-agent" ]; then
  echo "the base target needs BASE_BIN_DIR: a directory with another build's relay binaries"; exit 1
fi

# A listener left on one of the run's ports (an earlier run's nginx, say) would share it
# (nginx listens with reuseport) and skew what is measured: refuse to start.
for port in 8000 8080 8084 8090 8101 8102 8103 8201 8202 8441 8442 8443 8444 8445 8451 8452 \
  8453 8454 8455 8460 8464 8470 9080 9081 9084 9090 9091 9094 9441 9442 9443 9444 9445; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "port $port is in use (a process left from an earlier run?): stop it first"; exit 1
  fi
done

work=$(mktemp -d)
pids=()
nginx_pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  # Every nginx of the run: the upstream and the chain's three hops.
  for f in "$work"/*.pid; do [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

chmod 755 "$work"
head -c $((64 * 1024 * 1024)) /dev/urandom > "$work/big.bin"

# nginx: the upstream on 8000, and the chain 8101 -> 8102 -> 8103 -> 8000.
nginx_conf() { # name listen body
  cat > "$work/$1.conf" <<NGX
worker_processes 1;
pid $work/$1.pid;
error_log $work/$1-error.log;
events { worker_connections 4096; }
http {
  access_log off;
  keepalive_requests 1000000;
  $3
  server {
    listen 127.0.0.1:$2 reuseport;
    $4
  }
}
NGX
  nginx -c "$work/$1.conf"
}
nginx_conf nginx 8000 "" "location = / { return 200 \"12345678\"; } location = /big.bin { root $work; }"
hop() { # name listen next-port
  nginx_conf "$1" "$2" "upstream next { server 127.0.0.1:$3; keepalive 128; keepalive_requests 1000000; }" \
    "location / { proxy_pass http://next; proxy_http_version 1.1; proxy_set_header Connection \"\"; proxy_buffering off; }"
}
if wants chain; then
  hop chain3 8103 8000
  hop chain2 8102 8103
  hop chain1 8101 8102
fi

if wants rathole; then
  cat > "$work/rathole-server.toml" <<TOML
[server]
bind_addr = "127.0.0.1:8201"
[server.services.bench]
token = "bench-token"
bind_addr = "127.0.0.1:8202"
TOML
  cat > "$work/rathole-client.toml" <<TOML
[client]
remote_addr = "127.0.0.1:8201"
[client.services.bench]
token = "bench-token"
local_addr = "127.0.0.1:8000"
TOML
  "$RATHOLE" --server "$work/rathole-server.toml" >"$work/rathole-server.log" 2>&1 & RH_S=$!; pids+=($RH_S)
  "$RATHOLE" --client "$work/rathole-client.toml" >"$work/rathole-client.log" 2>&1 & RH_C=$!; pids+=($RH_C)
fi

DISPATCHER_CONFIG=examples/local/dispatcher.toml
if [ -n "${POLICY:-}" ]; then
  DISPATCHER_CONFIG=$work/dispatcher.toml
  { cat examples/local/dispatcher.toml; printf '\n[routing]\npolicy = "%s"\n' "$POLICY"; } > "$DISPATCHER_CONFIG"
fi
$BIN/relay-dispatcher --config "$DISPATCHER_CONFIG" >"$work/dispatcher.log" 2>&1 & DISP=$!; pids+=($DISP)
$BIN/relay-tunnel-server --config examples/local/tunnel-server-1.toml >"$work/ts1.log" 2>&1 & TS1=$!; pids+=($TS1)
$BIN/relay-tunnel-server --config examples/local/tunnel-server-2.toml >"$work/ts2.log" 2>&1 & TS2=$!; pids+=($TS2)
$BIN/relay-agent --config examples/local/agent.toml >"$work/agent.log" 2>&1 & AGENT=$!; pids+=($AGENT)
if wants colocated; then
  # examples/colocated beside examples/local: the same configs on ports of their own.
  sed -e 's/127.0.0.1:8080/127.0.0.1:8090/; s/127.0.0.1:8460/127.0.0.1:8470/; s/127.0.0.1:9080/127.0.0.1:9081/' \
    "$DISPATCHER_CONFIG" > "$work/front.toml"
  sed -e 's/:8441/:8443/; s/:8451/:8453/; s/:9441/:9443/; s/:8460/:8470/' \
    -e "s|^front_config = .*|front_config = \"$work/front.toml\"|" \
    examples/colocated/tunnel-server.toml > "$work/colocated.toml"
  sed -e 's/:8441/:8443/; s/:9090/:9091/' examples/colocated/agent.toml > "$work/colocated-agent.toml"
  $BIN/relay-tunnel-server --config "$work/colocated.toml" >"$work/colocated.log" 2>&1 & COLO=$!; pids+=($COLO)
  $BIN/relay-agent --config "$work/colocated-agent.toml" >"$work/colocated-agent.log" 2>&1 & COLO_AGENT=$!; pids+=($COLO_AGENT)
fi

if wants base; then
  # examples/local again, every port moved (8080 -> 8084, 8441 -> 8444, ...).
  base_ports() {
    sed -e 's/:8080"/:8084"/; s/:8460"/:8464"/g; s/:9080"/:9084"/' \
      -e 's/:8441"/:8444"/g; s/:8442"/:8445"/g; s/:8451"/:8454"/; s/:8452"/:8455"/' \
      -e 's/:9441"/:9444"/; s/:9442"/:9445"/; s/:9090"/:9094"/' "$1" > "$2"
  }
  base_ports "$DISPATCHER_CONFIG" "$work/base-dispatcher.toml"
  base_ports examples/local/tunnel-server-1.toml "$work/base-ts1.toml"
  base_ports examples/local/tunnel-server-2.toml "$work/base-ts2.toml"
  base_ports examples/local/agent.toml "$work/base-agent.toml"
  B=$BASE_BIN_DIR
  $B/relay-dispatcher --config "$work/base-dispatcher.toml" >"$work/base-dispatcher.log" 2>&1 & B_DISP=$!; pids+=($B_DISP)
  $B/relay-tunnel-server --config "$work/base-ts1.toml" >"$work/base-ts1.log" 2>&1 & B_TS1=$!; pids+=($B_TS1)
  $B/relay-tunnel-server --config "$work/base-ts2.toml" >"$work/base-ts2.log" 2>&1 & B_TS2=$!; pids+=($B_TS2)
  $B/relay-agent --config "$work/base-agent.toml" >"$work/base-agent.log" 2>&1 & B_AGENT=$!; pids+=($B_AGENT)
fi

AUTH='Authorization: Bearer dev-caller-key'
declare -A URL=(
  [direct]=http://127.0.0.1:8000/
  [chain]=http://127.0.0.1:8101/
  [rathole]=http://127.0.0.1:8202/
  [relay]=http://127.0.0.1:8080/relay/demo/
  [colocated]=http://127.0.0.1:8090/relay/demo/
  [base]=http://127.0.0.1:8084/relay/demo/
)
for t in $TARGETS; do
  for _ in $(seq 1 200); do
    if [ "$(curl -s -H "$AUTH" "${URL[$t]}" || true)" = 12345678 ]; then break; fi
    sleep 0.05
  done
  [ "$(curl -s -H "$AUTH" "${URL[$t]}")" = 12345678 ] || { echo "$t not answering"; tail "$work"/*.log; exit 1; }
done

ticks() { local s=0 p; for p in "$@"; do s=$((s + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done; echo $s; }
hwm() { awk '/VmHWM/ {print $2}' "/proc/$1/status"; }
rss() { awk '/VmRSS/ {print $2}' "/proc/$1/status"; }
hz=$(getconf CLK_TCK)
# The machine's CPU ticks so far: "total idle steal" (idle counts iowait too).
cpu_ticks() { awk '/^cpu / {t = 0; for (i = 2; i <= 9; i++) t += $i; print t, $5 + $6, $9; exit}' /proc/stat; }
workers() { pgrep -P "$(cat "$work/$1.pid")" | tr '\n' ' '; }
declare -A PROCS=(
  [direct]="$(workers nginx)"
  [relay]="$DISP $TS1 $TS2 $AGENT"
)
wants chain && PROCS[chain]="$(workers chain1) $(workers chain2) $(workers chain3)"
wants rathole && PROCS[rathole]="$RH_S $RH_C"
wants colocated && PROCS[colocated]="$COLO $COLO_AGENT"
wants base && PROCS[base]="$B_DISP $B_TS1 $B_TS2 $B_AGENT"

# POSTs with a body of BODY_BYTES bytes instead of GETs, when set.
BODY_BYTES=${BODY_BYTES:-0}
WRK_SCRIPT=()
if [ "$BODY_BYTES" -gt 0 ]; then
  printf 'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/octet-stream"\nwrk.body = string.rep("x", %d)\n' \
    "$BODY_BYTES" > "$work/post.lua"
  WRK_SCRIPT=(-s "$work/post.lua")
fi

# wrk against $1 with $2 connections -> "rps p50_ms p99_ms requests errors"
run_wrk() {
  local threads=$WRK_THREADS; [ "$2" -lt "$threads" ] && threads=$2
  wrk -t"$threads" -c"$2" -d"$DURATION" --latency -H "$AUTH" "${WRK_SCRIPT[@]}" "$1" > "$work/wrk.out"
  awk '
    function ms(v) { if (v ~ /us$/) return v / 1000; if (v ~ /ms$/) return v + 0; if (v ~ /s$/) return v * 1000; return v }
    /Requests\/sec/ {rps=$2}
    /^ +50%/ {p50=ms($2)} /^ +99%/ {p99=ms($2)}
    /requests in/ {n=$1}
    /Non-2xx/ {e += $NF}
    /Socket errors/ {gsub(",", ""); e += $4 + $6 + $8 + $10}
    END {printf "%s %.3f %.3f %s %d\n", rps, p50, p99, n, e}' "$work/wrk.out"
}

# Warm-up, not measured: every target for WARMUP at the largest connection count, so that
# each relay agent has grown its streams (a sizing tick a second) and every keep-alive pool
# is full before the first round; otherwise the first round of each target measures that.
WARMUP=${WARMUP:-3s}
max_conns=$(printf '%s\n' $CONNS | sort -n | tail -1)
for t in $TARGETS; do
  wrk -t1 -c"$max_conns" -d"$WARMUP" -H "$AUTH" "${WRK_SCRIPT[@]}" "${URL[$t]}" > /dev/null
done

declare -A RES
# CPU per call of each process of a target, in the order PROCS lists them.
declare -A EACH
errors=0
for r in $(seq 1 "$ROUNDS"); do
  for c in $CONNS; do
    for t in $TARGETS; do
      before=$(ticks ${PROCS[$t]})
      each_before=(); for p in ${PROCS[$t]}; do each_before+=("$(ticks "$p")"); done
      read -r t0 i0 s0 < <(cpu_ticks)
      read -r rps p50 p99 n e < <(run_wrk "${URL[$t]}" "$c")
      read -r t1 i1 s1 < <(cpu_ticks)
      after=$(ticks ${PROCS[$t]})
      i=0
      for p in ${PROCS[$t]}; do
        EACH[$t,$c,$i]+="$(awk -v t=$(( $(ticks "$p") - each_before[i] )) -v hz="$hz" -v n="$n" \
          'BEGIN {printf "%.1f", n ? t / hz * 1e6 / n : 0}')"$'\n'
        i=$((i + 1))
      done
      cpu=$(awk -v t=$((after - before)) -v hz="$hz" -v n="$n" 'BEGIN {printf "%.1f", n ? t / hz * 1e6 / n : 0}')
      idle=$(awk -v i=$((i1 - i0)) -v t=$((t1 - t0)) 'BEGIN {printf "%.0f", t ? 100 * i / t : 0}')
      steal=$(awk -v s=$((s1 - s0)) -v t=$((t1 - t0)) 'BEGIN {printf "%.0f", t ? 100 * s / t : 0}')
      RES[$t,$c]+="$rps $p50 $p99 $cpu $idle $steal"$'\n'
      if [ "$e" -gt 0 ]; then
        echo "errors: round $r, $t at $c connections: $e non-2xx answers or socket errors"
        errors=$((errors + e))
      fi
    done
  done
done

median() { sort -g | awk '{v[NR]=$1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
col() { printf '%s' "${RES[$1,$2]}" | awk -v k="$3" 'NF {print $k}' | median; }

echo
what="GET"; [ "$BODY_BYTES" -gt 0 ] && what="POST of $BODY_BYTES bytes"
echo "medians of $ROUNDS rounds, $DURATION each (wrk, $what; nginx upstream returning 8 bytes)"
printf '%-10s %-6s %12s %10s %10s %14s %10s %10s %7s %7s\n' target conns calls/s p50-ms p99-ms "cpu/call(us)" "x chain" "x rathole" "idle%" "steal%"
for c in $CONNS; do
  for t in $TARGETS; do
    rps=$(col "$t" "$c" 1)
    vs_chain=-; vs_rh=-
    if [ "$t" = relay ] || [ "$t" = colocated ] || [ "$t" = base ]; then
      wants chain && vs_chain=$(awk -v a="$rps" -v b="$(col chain "$c" 1)" 'BEGIN {printf "%.2f", a / b}')
      wants rathole && vs_rh=$(awk -v a="$rps" -v b="$(col rathole "$c" 1)" 'BEGIN {printf "%.2f", a / b}')
    fi
    printf '%-10s %-6s %12s %10s %10s %14s %10s %10s %7s %7s\n' "$t" "$c" "$rps" "$(col "$t" "$c" 2)" \
      "$(col "$t" "$c" 3)" "$(col "$t" "$c" 4)" "$vs_chain" "$vs_rh" "$(col "$t" "$c" 5)" "$(col "$t" "$c" 6)"
  done
done
if wants base && wants relay; then
  echo
  for c in $CONNS; do
    # Round by round: relay's calls/s over base's.
    ratios=$(paste <(printf '%s' "${RES[relay,$c]}" | awk 'NF {print $1}') \
      <(printf '%s' "${RES[base,$c]}" | awk 'NF {print $1}') | awk '{printf "%.2f\n", $1 / $2}')
    echo "relay x base at $c connections, per round: $(echo $ratios); median $(echo "$ratios" | median)"
  done
fi
echo
for t in relay colocated base; do
  wants "$t" || continue
  for c in $CONNS; do
    i=0; line=""
    for p in ${PROCS[$t]}; do
      name=$(tr '\0' ' ' < "/proc/$p/cmdline" | awk '{n = $1; sub(".*/", "", n); sub("^relay-", "", n); print n}')
      line+=" $name $(printf '%s' "${EACH[$t,$c,$i]}" | awk 'NF' | median)"
      i=$((i + 1))
    done
    echo "cpu/call(us) by process, $t at $c connections:$line"
  done
done
echo
echo "errors: $errors non-2xx answers or socket errors over every run"
echo "peak RSS after load (KiB): dispatcher $(hwm $DISP)  tunnel-server-1 $(hwm $TS1)  tunnel-server-2 $(hwm $TS2)  agent $(hwm $AGENT)"
echo "RSS at rest after load (KiB): dispatcher $(rss $DISP)  tunnel-server-1 $(rss $TS1)  tunnel-server-2 $(rss $TS2)  agent $(rss $AGENT)"
wants rathole && echo "peak RSS after load (KiB): rathole server $(hwm $RH_S)  rathole client $(hwm $RH_C)"
bytes=$(curl -s -H "$AUTH" "${URL[relay]}big.bin" | wc -c)
echo "64 MiB response relayed: $bytes bytes"
echo "peak RSS after 64 MiB (KiB): dispatcher $(hwm $DISP)  tunnel-server-1 $(hwm $TS1)  tunnel-server-2 $(hwm $TS2)  agent $(hwm $AGENT)"
if wants colocated; then
  echo "peak RSS after load (KiB): co-located tunnel server $(hwm $COLO)  agent $(hwm $COLO_AGENT)"
  echo "RSS at rest after load (KiB): co-located tunnel server $(rss $COLO)  agent $(rss $COLO_AGENT)"
  bytes=$(curl -s -H "$AUTH" "${URL[colocated]}big.bin" | wc -c)
  echo "64 MiB response relayed co-located: $bytes bytes"
  echo "peak RSS after 64 MiB (KiB): co-located tunnel server $(hwm $COLO)  agent $(hwm $COLO_AGENT)"
fi
if wants base; then
  echo "RSS at rest after load (KiB), base: dispatcher $(rss $B_DISP)  tunnel-server-1 $(rss $B_TS1)  tunnel-server-2 $(rss $B_TS2)  agent $(rss $B_AGENT)"
fi
limits=$(cat "$work"/dispatcher.log "$work"/ts*.log "$work"/agent.log "$work"/colocated*.log "$work"/base-*.log 2>/dev/null | grep -c 'reached limit' || true)
echo "h2 guards tripped (\`reached limit\` in the relay logs): $limits"
